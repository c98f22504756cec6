//! Writing and reading checkpoints, one rank's files at a time. A save goes to a staging
//! directory that every rank writes into; rank 0 renames it into place once all are done and
//! only then moves the tracker, so a job killed at any moment leaves the previous checkpoint
//! loadable.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use megatron_checkpoint::layout::{rank_directories, rank_file};
use tch::{Device, Tensor};

use super::checksum::{checksums_enabled, FileChecksums, CHECKSUMS_KEY};
use super::layout::{
    iteration_directory, read_tracker, saved_iterations, sync_directory, write_tracker,
    TrackedCheckpoint, TRACKER_FILE,
};
use super::lock::lock_save_directory;
use super::metadata::CheckpointMetadata;
use super::tensor_file::{read_tensors, write_tensors, write_tensors_streamed, TensorEntry};

pub const METADATA_FILE: &str = "metadata.json";
pub const MODEL_FILE: &str = "model.safetensors";
pub const RNG_FILE: &str = "rng.safetensors";
/// The MoE routers' expert biases (`--moe-router-enable-expert-bias`), model state outside
/// the parameters, under their chunk-prefixed names (`decoder.layers.0.mlp.router.expert_bias`,
/// Megatron's buffer name, layers counted within the chunk).
pub const EXPERT_BIAS_FILE: &str = "expert_bias.safetensors";

/// `optimizer.safetensors`, or with the distributed optimizer one file per data-parallel rank
/// (`optimizer_dp001.safetensors`).
pub fn optimizer_file(sharded_data_rank: Option<usize>) -> String {
    match sharded_data_rank {
        Some(rank) => format!("optimizer_dp{rank:03}.safetensors"),
        None => "optimizer.safetensors".to_string(),
    }
}

/// Where the ranks write the checkpoint of `iteration` before it is committed.
pub fn staging_directory(root: &Path, iteration: u64) -> PathBuf {
    let target = iteration_directory(root, iteration);
    let name = target
        .file_name()
        .expect("iteration directories have a name")
        .to_string_lossy()
        .into_owned();
    root.join(format!(".{name}.tmp"))
}

/// Run by one rank before the others write: takes the save directory's lock (kept until the
/// process exits), creates the staging directory, clearing what an interrupted save left behind.
pub fn begin_save(root: &Path, iteration: u64) -> Result<PathBuf> {
    lock_save_directory(root)?;
    remove_abandoned_staging(root)?;
    let staging = staging_directory(root, iteration);
    fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    Ok(staging)
}

/// Writes one file of a rank's part of the checkpoint (`staging/rank_dir/file`), durably.
pub fn write_rank_file(
    staging: &Path,
    rank_dir: &str,
    file: &str,
    tensors: &[(String, Tensor)],
) -> Result<()> {
    let directory = staging.join(rank_dir);
    fs::create_dir_all(&directory).with_context(|| format!("creating {}", directory.display()))?;
    let header = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_tensors(&directory.join(file), tensors, header)?;
    sync_directory(&directory)
}

/// [`write_rank_file`] for tensors produced one at a time ([`write_tensors_streamed`]).
pub fn write_rank_file_streamed(
    staging: &Path,
    rank_dir: &str,
    file: &str,
    entries: &[TensorEntry],
    produce: impl FnMut(usize, &mut dyn FnMut(&Tensor) -> Result<()>) -> Result<()>,
) -> Result<()> {
    let directory = staging.join(rank_dir);
    fs::create_dir_all(&directory).with_context(|| format!("creating {}", directory.display()))?;
    let header = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_tensors_streamed(&directory.join(file), entries, header, produce)?;
    sync_directory(&directory)
}

/// Run by one rank once every rank has written: adds the metadata, renames the staging
/// directory into place (replacing an older save of the same iteration) and points the
/// tracker at it.
pub fn finish_save(root: &Path, metadata: &CheckpointMetadata) -> Result<PathBuf> {
    let staging = staging_directory(root, metadata.iteration);
    let metadata_path = staging.join(METADATA_FILE);
    let mut document = serde_json::to_value(metadata)?;
    if checksums_enabled() {
        let checksums = FileChecksums::of_directory(&staging, METADATA_FILE)?;
        document[CHECKSUMS_KEY] = serde_json::to_value(checksums)?;
    }
    fs::write(&metadata_path, serde_json::to_string_pretty(&document)?)
        .with_context(|| format!("writing {}", metadata_path.display()))?;
    fs::File::open(&metadata_path)
        .and_then(|file| file.sync_all())
        .with_context(|| format!("syncing {}", metadata_path.display()))?;
    sync_directory(&staging)?;
    commit_iteration(root, &staging, metadata.iteration)
}

/// Renames the complete checkpoint directory `staging` into place as `root`'s iteration
/// `iteration` (replacing an older save of the same iteration) and points the tracker at it:
/// the last step of every save, whatever the format written into `staging`.
pub fn commit_iteration(root: &Path, staging: &Path, iteration: u64) -> Result<PathBuf> {
    let target = iteration_directory(root, iteration);
    if target.exists() {
        let retired = root.join(format!(
            ".{}.old",
            target.file_name().expect("named").to_string_lossy()
        ));
        rename(&target, &retired)?;
        rename(staging, &target)?;
        fs::remove_dir_all(&retired).with_context(|| format!("removing {}", retired.display()))?;
    } else {
        rename(staging, &target)?;
    }
    sync_directory(root)?;
    write_tracker(root, iteration)?;
    Ok(target)
}

fn rename(from: &Path, to: &Path) -> Result<()> {
    fs::rename(from, to).with_context(|| format!("renaming {} to {}", from.display(), to.display()))
}

/// Removes the staging directory of a save that failed. Best effort: what cannot be removed
/// now is removed by the next save's [`begin_save`].
pub fn abandon_save(root: &Path, iteration: u64) {
    let _ = fs::remove_dir_all(staging_directory(root, iteration));
}

/// Removes the staging directories of saves that never finished. The caller holds the save
/// directory's lock, so their writers are gone (a killed run's leftovers); they were never
/// named by the tracker, so nothing refers to them.
fn remove_abandoned_staging(root: &Path) -> Result<()> {
    let entries = fs::read_dir(root).with_context(|| format!("listing {}", root.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".iter_") && (name.ends_with(".tmp") || name.ends_with(".old")) {
            fs::remove_dir_all(entry.path())
                .with_context(|| format!("removing abandoned {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// A committed checkpoint, found through the tracker (or, without one, by looking).
pub struct CheckpointDirectory {
    pub directory: PathBuf,
    pub metadata: CheckpointMetadata,
    /// The tracker said `release`: weights only, training restarts at iteration 0.
    pub release: bool,
    /// What each file's bytes were at save, checked by [`CheckpointDirectory::read`].
    pub checksums: FileChecksums,
}

/// The checkpoint the tracker under `root` names; `None` when there is none. Without a tracker
/// (deleted, or lost with a copy) the newest iteration directory that is complete and whose
/// files match their checksums is taken, and a warning says which and why; iteration
/// directories of which none is complete are an error naming them, never a fresh start.
pub fn find_checkpoint(root: &Path) -> Result<Option<CheckpointDirectory>> {
    let Some(tracked) = read_tracker(root)? else {
        return newest_complete_checkpoint(root);
    };
    let directory = tracked.directory(root);
    if !directory.is_dir() {
        bail!(
            "{} names {} but {} does not exist",
            root.join(TRACKER_FILE).display(),
            directory
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            directory.display()
        );
    }
    open_checkpoint(directory, tracked == TrackedCheckpoint::Release).map(Some)
}

fn open_checkpoint(directory: PathBuf, release: bool) -> Result<CheckpointDirectory> {
    let metadata_path = directory.join(METADATA_FILE);
    if !metadata_path.exists() {
        if let Some(format) = megatron_format(&directory) {
            // The tools that take Megatron's checkpoints import them before they get here.
            bail!(
                "{} holds a {format} checkpoint, which this tool does not load directly: \
                 pretrain_gpt and the inference tools do, and checkpoint_convert --loader core \
                 imports a GPT one",
                directory.display()
            );
        }
    }
    let metadata = CheckpointMetadata::read(&metadata_path)?;
    let checksums = if checksums_enabled() {
        FileChecksums::read(&metadata_path)?
    } else {
        FileChecksums::default()
    };
    if checksums_enabled() && checksums.0.is_empty() {
        warn_unchecked(&directory);
    }
    Ok(CheckpointDirectory {
        directory,
        metadata,
        release,
        checksums,
    })
}

/// `Megatron torch` or `Megatron torch_dist` where `directory` holds such an iteration.
fn megatron_format(directory: &Path) -> Option<&'static str> {
    if directory.join(".metadata").is_file() {
        return Some("Megatron torch_dist");
    }
    let ranks = rank_directories(directory).ok()?;
    ranks
        .iter()
        .any(|rank| rank_file(rank).is_ok())
        .then_some("Megatron torch")
}

/// Says once per process and checkpoint that its bytes cannot be checked: its metadata records
/// no checksums (saved by an older version, with --no-checkpoint-checksums, or edited).
fn warn_unchecked(directory: &Path) {
    static WARNED: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());
    if WARNED
        .lock()
        .expect("warned checkpoints")
        .insert(directory.to_path_buf())
    {
        eprintln!(
            "warning: {} records no checksums in its {METADATA_FILE}; its files are loaded \
             unchecked",
            directory.display()
        );
    }
}

/// For a `root` without a tracker: its newest iteration directory that is a whole checkpoint.
fn newest_complete_checkpoint(root: &Path) -> Result<Option<CheckpointDirectory>> {
    let iterations = saved_iterations(root)?;
    if iterations.is_empty() {
        return Ok(None);
    }
    let mut refused = Vec::new();
    for iteration in iterations {
        let directory = iteration_directory(root, iteration);
        match complete_checkpoint(directory.clone(), iteration) {
            Ok(found) => {
                let skipped = if refused.is_empty() {
                    String::new()
                } else {
                    format!(" (newer ones are not: {})", refused.join("; "))
                };
                eprintln!(
                    "warning: {} has no {TRACKER_FILE}; loading {}, its newest iteration \
                     directory that is complete{}{skipped}",
                    root.display(),
                    directory.display(),
                    if found.checksums.0.is_empty() {
                        " (it records no checksums to check its files against)"
                    } else {
                        " and whose files match their checksums"
                    }
                );
                return Ok(Some(found));
            }
            Err(error) => refused.push(format!("{}: {error:#}", directory.display())),
        }
    }
    bail!(
        "{} has no {TRACKER_FILE} and none of its iteration directories is a complete \
         checkpoint: {}",
        root.display(),
        refused.join("; ")
    )
}

/// The checkpoint in `directory` when its metadata is readable, names `iteration`, and every
/// file it records a checksum for is there with those bytes.
fn complete_checkpoint(directory: PathBuf, iteration: u64) -> Result<CheckpointDirectory> {
    let found = open_checkpoint(directory, false)?;
    if found.metadata.iteration != iteration {
        bail!(
            "its {METADATA_FILE} says iteration {}",
            found.metadata.iteration
        );
    }
    for relative in found.checksums.0.keys() {
        found
            .checksums
            .verify(relative, &found.directory.join(relative))?;
    }
    Ok(found)
}

impl CheckpointDirectory {
    /// Reads `rank_dir/file` onto `device`; `None` when the file is absent (e.g. a checkpoint
    /// saved with `--no-save-optim`). A missing rank directory is an error naming the layout the
    /// checkpoint was saved with.
    pub fn read(
        &self,
        rank_dir: &str,
        file: &str,
        device: Device,
    ) -> Result<Option<HashMap<String, Tensor>>> {
        let directory = self.directory.join(rank_dir);
        if !directory.is_dir() {
            let mut present: Vec<String> = fs::read_dir(&self.directory)
                .with_context(|| format!("listing {}", self.directory.display()))?
                .flatten()
                .filter(|e| e.path().is_dir())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            present.sort();
            bail!(
                "{} has no {rank_dir} (it holds {}; saved with {})",
                self.directory.display(),
                present.join(", "),
                self.metadata.describe_layout()
            );
        }
        let path = directory.join(file);
        if !path.exists() {
            return Ok(None);
        }
        self.checksums
            .verify(&format!("{rank_dir}/{file}"), &path)?;
        let tensors = read_tensors(&path, device)?.0;
        if file == MODEL_FILE {
            ensure_finite(&path, &tensors)?;
        }
        Ok(Some(tensors))
    }
}

/// Refuses weights holding NaN or infinity, naming the first such tensor: a model loaded from
/// them would only produce NaN (and sampling from NaN probabilities fails deep in libtorch).
fn ensure_finite(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let tensor = &tensors[name];
        if !tensor.is_floating_point() {
            continue;
        }
        let bad = tensor
            .isfinite()
            .logical_not()
            .sum(tch::Kind::Int64)
            .int64_value(&[]);
        if bad > 0 {
            bail!(
                "{}: tensor {name} holds {bad} NaN or infinite values (of {}): the weights \
                 diverged before this checkpoint was saved; load an earlier one",
                path.display(),
                tensor.numel()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Megatron iteration given where ours is expected is named as Megatron's, not as a
    /// checkpoint of ours missing its metadata.
    #[test]
    fn a_megatron_checkpoint_is_named_as_one() {
        let dir = tempfile::tempdir().unwrap();
        let iteration = dir.path().join("iter_0000005");
        fs::create_dir_all(iteration.join("mp_rank_00")).unwrap();
        fs::write(iteration.join("mp_rank_00/model_optim_rng.pt"), b"").unwrap();
        fs::write(dir.path().join(TRACKER_FILE), "5").unwrap();
        let error = format!("{:#}", find_checkpoint(dir.path()).err().unwrap());
        assert!(
            error.contains("holds a Megatron torch checkpoint"),
            "{error}"
        );
        fs::remove_dir_all(iteration.join("mp_rank_00")).unwrap();
        fs::write(iteration.join(".metadata"), b"").unwrap();
        let error = format!("{:#}", find_checkpoint(dir.path()).err().unwrap());
        assert!(
            error.contains("holds a Megatron torch_dist checkpoint"),
            "{error}"
        );
        fs::remove_file(iteration.join(".metadata")).unwrap();
        let error = format!("{:#}", find_checkpoint(dir.path()).err().unwrap());
        assert!(!error.contains("Megatron"), "{error}");
    }
}
