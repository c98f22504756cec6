//! Saving and loading whole checkpoints.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Tensor};

use super::layout::{iteration_directory, read_tracker, sync_directory, write_tracker, TrackedCheckpoint};
use super::metadata::CheckpointMetadata;
use super::tensor_file::{read_tensors, write_tensors};

const METADATA_FILE: &str = "metadata.json";
const MODEL_FILE: &str = "model.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const RNG_FILE: &str = "rng.safetensors";

/// What one rank contributes to a checkpoint.
pub struct CheckpointParts {
    pub rank_directory: String,
    pub model: Vec<(String, Tensor)>,
    pub optimizer: Option<Vec<(String, Tensor)>>,
    pub rng: Option<Vec<(String, Tensor)>>,
}

/// Writes the checkpoint of `metadata.iteration` under `root` and then points the tracker at
/// it. The iteration directory appears only once complete; an existing one is replaced.
pub fn save_checkpoint(root: &Path, metadata: &CheckpointMetadata, parts: &CheckpointParts) -> Result<PathBuf> {
    fs::create_dir_all(root).with_context(|| format!("creating checkpoint directory {}", root.display()))?;
    let target = iteration_directory(root, metadata.iteration);
    let name = target.file_name().expect("iteration directories have a name").to_string_lossy().into_owned();
    remove_abandoned_staging(root)?;
    let staging = root.join(format!(".{name}.tmp-{}", std::process::id()));
    let rank_dir = staging.join(&parts.rank_directory);
    fs::create_dir_all(&rank_dir).with_context(|| format!("creating {}", rank_dir.display()))?;

    let header = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_tensors(&rank_dir.join(MODEL_FILE), &parts.model, header.clone())?;
    if let Some(optimizer) = &parts.optimizer {
        write_tensors(&rank_dir.join(OPTIMIZER_FILE), optimizer, header.clone())?;
    }
    if let Some(rng) = &parts.rng {
        write_tensors(&rank_dir.join(RNG_FILE), rng, header)?;
    }
    let metadata_path = staging.join(METADATA_FILE);
    fs::write(&metadata_path, serde_json::to_string_pretty(metadata)?)
        .with_context(|| format!("writing {}", metadata_path.display()))?;
    fs::File::open(&metadata_path)?.sync_all()?;
    sync_directory(&rank_dir)?;
    sync_directory(&staging)?;

    if target.exists() {
        let retired = root.join(format!(".{name}.old-{}", std::process::id()));
        fs::rename(&target, &retired)?;
        fs::rename(&staging, &target)?;
        fs::remove_dir_all(&retired)?;
    } else {
        fs::rename(&staging, &target).with_context(|| format!("renaming {} to {}", staging.display(), target.display()))?;
    }
    sync_directory(root)?;
    write_tracker(root, metadata.iteration)?;
    Ok(target)
}

/// Removes the staging directories of saves that never finished (a killed run's leftovers);
/// they were never named by the tracker, so nothing refers to them.
fn remove_abandoned_staging(root: &Path) -> Result<()> {
    for entry in fs::read_dir(root)?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".iter_") && (name.contains(".tmp-") || name.contains(".old-")) {
            fs::remove_dir_all(entry.path()).with_context(|| format!("removing abandoned {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// Which parts of a checkpoint to read (`--no-load-optim`, `--no-load-rng`, `--finetune`).
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub optimizer: bool,
    pub rng: bool,
}

pub struct LoadedCheckpoint {
    pub directory: PathBuf,
    pub metadata: CheckpointMetadata,
    /// The tracker said `release`: weights only, training restarts at iteration 0.
    pub release: bool,
    pub model: HashMap<String, Tensor>,
    pub optimizer: Option<HashMap<String, Tensor>>,
    pub rng: Option<HashMap<String, Tensor>>,
}

/// Loads the checkpoint the tracker under `root` names; `None` when there is none.
pub fn load_checkpoint(root: &Path, rank_directory: &str, device: Device, options: LoadOptions) -> Result<Option<LoadedCheckpoint>> {
    let Some(tracked) = read_tracker(root)? else {
        return Ok(None);
    };
    let directory = tracked.directory(root);
    if !directory.is_dir() {
        bail!(
            "{} names {} but {} does not exist",
            root.join(super::layout::TRACKER_FILE).display(),
            directory.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            directory.display()
        );
    }
    let metadata = CheckpointMetadata::read(&directory.join(METADATA_FILE))?;
    let rank_dir = directory.join(rank_directory);
    if !rank_dir.is_dir() {
        let present: Vec<String> = fs::read_dir(&directory)?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        bail!(
            "{} has no {rank_directory} (it holds {}; saved with tensor/pipeline parallel sizes {}/{})",
            directory.display(),
            present.join(", "),
            metadata.tensor_model_parallel_size,
            metadata.pipeline_model_parallel_size
        );
    }
    let (model, _) = read_tensors(&rank_dir.join(MODEL_FILE), device)?;
    let optional = |wanted: bool, file: &str| -> Result<Option<HashMap<String, Tensor>>> {
        let path = rank_dir.join(file);
        if !wanted || !path.exists() {
            return Ok(None);
        }
        Ok(Some(read_tensors(&path, device)?.0))
    };
    let optimizer = optional(options.optimizer, OPTIMIZER_FILE)?;
    let rng = optional(options.rng, RNG_FILE)?;
    Ok(Some(LoadedCheckpoint {
        directory,
        metadata,
        release: tracked == TrackedCheckpoint::Release,
        model,
        optimizer,
        rng,
    }))
}
