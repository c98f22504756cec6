//! `--ckpt-format`: saves in a format other than ours. Training cannot write Megatron's formats
//! itself (their writers are `checkpoint_convert`'s, in `megatron-convert`, a crate beside this
//! one), so the binary hands the engine a [`CheckpointExport`]: the ranks save their parts in
//! our format into [`EXPORT_SOURCE`] under `--save`, as every save does, and rank 0 has the
//! export rewrite that checkpoint into `--save` (streamed, tensor by tensor) and then removes it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};

use super::async_save::{self, Commit};

/// Our own checkpoint format's `--ckpt-format` name, the default.
pub const OURS: &str = "safetensors";

/// The hidden directory under `--save` that holds a save in our format until it is exported.
pub const EXPORT_SOURCE: &str = ".megatron-rs-export-source";

/// Rewrites a checkpoint of ours in another format; given by the binary that links the writer.
pub trait CheckpointExport: Send + Sync {
    /// The `--ckpt-format` name of what it writes.
    fn format(&self) -> &'static str;

    /// Rewrites the checkpoint the tracker under `ours` names into `save`, atomically (the
    /// iteration directory appears complete, then the tracker moves).
    fn export(&self, ours: &Path, save: &Path) -> Result<PathBuf>;
}

/// Where the ranks save in our format before rank 0 exports into `save`.
pub fn source_root(save: &Path) -> PathBuf {
    save.join(EXPORT_SOURCE)
}

/// Rank 0's part after the ranks saved under [`source_root`]: the export into `save`, then the
/// source removed (an abandoned one is replaced by the next save).
pub fn export_and_clean(export: &dyn CheckpointExport, save: &Path) -> Result<()> {
    let source = source_root(save);
    export.export(&source, save)?;
    std::fs::remove_dir_all(&source)
        .with_context(|| format!("removing {} after the export", source.display()))
}

/// An `--async-save` write whose commit (rank 0's, in its own thread) is followed by the export,
/// so the tracker under `save` moves only once the exported checkpoint is in place.
pub fn exporting_write(
    write: async_save::Write,
    export: Arc<dyn CheckpointExport>,
    save: PathBuf,
) -> async_save::Write {
    Box::new(move || {
        let commit = write()?;
        Ok(commit.map(|commit| {
            Box::new(move || {
                commit()?;
                export_and_clean(export.as_ref(), &save)
            }) as Commit
        }))
    })
}
