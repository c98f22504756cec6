//! `--load` of a Megatron checkpoint in a training run: Megatron's `torch` and `torch_dist`
//! directories are detected and imported, with their optimizer state (plain or distributed),
//! scheduler and counters, into one of ours laid out for the run, which it then resumes from.
//! The import streams tensor by tensor as `checkpoint_convert` does.

use std::path::Path;

use anyhow::{Context, Result};
use megatron_checkpoint::layout::{detect, Format};

use super::load::load_checkpoint;
use super::megatron_torch::LoadOptions;
use super::ours::{save_megatron_rs_sharded, OptimizerShards, TargetLayout};

/// The Megatron checkpoint under `load` imported into a temporary directory (removed when
/// dropped) in `layout`, with the optimizer state where `optimizer` (sharded as `shards` where
/// the run uses the distributed optimizer over several data-parallel ranks); `None` where
/// `load` holds something else (one of ours, or no checkpoint yet), which the run reads itself.
pub fn import_megatron_for_resume(
    load: &Path,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
) -> Result<Option<tempfile::TempDir>> {
    if !load.is_dir() {
        return Ok(None);
    }
    match detect(load) {
        Ok((Format::MegatronTorch | Format::TorchDist, _)) => {}
        _ => return Ok(None),
    }
    let state = load_checkpoint(
        load,
        Some("core"),
        &LoadOptions {
            optimizer,
            ..Default::default()
        },
    )
    .with_context(|| {
        format!(
            "--load {}: importing the Megatron checkpoint",
            load.display()
        )
    })?;
    let imported = tempfile::Builder::new()
        .prefix("megatron-rs-resume")
        .tempdir()
        .context("creating a temporary directory for the imported checkpoint")?;
    save_megatron_rs_sharded(&state, imported.path(), layout, shards).with_context(|| {
        format!(
            "--load {}: writing the imported checkpoint to {}",
            load.display(),
            imported.path().display()
        )
    })?;
    Ok(Some(imported))
}
