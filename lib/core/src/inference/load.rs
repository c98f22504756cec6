//! A GPT rebuilt from checkpoint metadata, so inference tools need no model flags.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::checkpoint::{
    find_checkpoint, merge_model_parallel_ranks, split_for_tensor_parallel, CheckpointDirectory,
};
use crate::model::{GptConfig, GptModel, ModelOptions, Recompute};
use crate::parallel::ParallelState;

/// Loads the checkpoint the tracker under `root` names, in `dtype` on `device`, with dropout
/// irrelevant (inference runs with `train = false`). Whatever layout it was saved in, the ranks
/// are merged and cut again for `parallel`'s tensor-parallel rank (one model without it).
/// The directory of the checkpoint the tracker under `root` names and its GPT architecture.
pub fn checkpoint_gpt_config(root: &Path) -> Result<(PathBuf, GptConfig)> {
    let checkpoint = find_gpt_checkpoint(root)?;
    let config = gpt_config_of(&checkpoint)?;
    Ok((checkpoint.directory, config))
}

fn find_gpt_checkpoint(root: &Path) -> Result<CheckpointDirectory> {
    if !root.exists() {
        bail!("{}: no such checkpoint directory", root.display());
    }
    if !root.is_dir() {
        bail!(
            "{}: is a file; --load takes a checkpoint directory",
            root.display()
        );
    }
    let Some(checkpoint) = find_checkpoint(root)? else {
        bail!(
            "{} holds no checkpoint (no latest_checkpointed_iteration.txt)",
            root.display()
        );
    };
    if checkpoint.metadata.model_type != "GPT" {
        bail!(
            "{} holds a {} model, not a GPT",
            checkpoint.directory.display(),
            checkpoint.metadata.model_type
        );
    }
    Ok(checkpoint)
}

fn gpt_config_of(checkpoint: &CheckpointDirectory) -> Result<GptConfig> {
    serde_json::from_value(checkpoint.metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))
}

pub fn load_gpt_for_inference(
    root: &Path,
    device: Device,
    dtype: Kind,
    parallel: &ParallelState,
) -> Result<GptModel> {
    let checkpoint = find_gpt_checkpoint(root)?;
    let config = gpt_config_of(&checkpoint)?;
    let merged = merge_model_parallel_ranks(&checkpoint, Device::Cpu)?;
    let (rank, size) = (
        parallel.tensor_parallel_rank(),
        parallel.tensor_parallel_size(),
    );
    let tensors = if size > 1 {
        split_for_tensor_parallel(&merged, &config, rank, size)
    } else {
        merged
    };
    let options = ModelOptions {
        params_dtype: dtype,
        device,
        recompute: Recompute::None,
        seed: 0,
    };
    let model = GptModel::new(config, options, parallel)?;
    model
        .load_parameters(&tensors)
        .with_context(|| format!("loading {}", checkpoint.directory.display()))?;
    Ok(model)
}
