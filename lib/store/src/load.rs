//! Any family's model rebuilt from checkpoint metadata, so inference tools need no model flags.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::{
    find_checkpoint, merge_model_parallel_ranks, split_for_tensor_parallel, CheckpointDirectory,
};
use megatron_models::{FamilyModel, ModelOptions, Recompute, TransformerConfig};
use megatron_parallel::ParallelState;

/// The directory of the checkpoint the tracker under `root` names and its architecture, which
/// must be of the family of `M`.
pub fn checkpoint_config<M: FamilyModel>(root: &Path) -> Result<(PathBuf, M::Config)> {
    let checkpoint = find_model_checkpoint(root, M::MODEL_TYPE)?;
    let config = model_config_of(&checkpoint)?;
    Ok((checkpoint.directory, config))
}

/// The checkpoint the tracker under `root` names, which must hold a `model_type` model.
fn find_model_checkpoint(root: &Path, model_type: &str) -> Result<CheckpointDirectory> {
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
    if checkpoint.metadata.model_type != model_type {
        bail!(
            "{} holds a {} model, not a {model_type}",
            checkpoint.directory.display(),
            checkpoint.metadata.model_type
        );
    }
    Ok(checkpoint)
}

fn model_config_of<C: serde::de::DeserializeOwned>(checkpoint: &CheckpointDirectory) -> Result<C> {
    serde_json::from_value(checkpoint.metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))
}

/// Loads the checkpoint of the family of `M` that the tracker under `root` names, in `dtype` on
/// `device`, with dropout irrelevant (inference runs with `train = false`). Whatever layout it
/// was saved in, the ranks are merged and cut again for `parallel`'s tensor-parallel rank (one
/// model without it).
pub fn load_for_inference<M: FamilyModel>(
    root: &Path,
    device: Device,
    dtype: Kind,
    parallel: &ParallelState,
) -> Result<M> {
    let checkpoint = find_model_checkpoint(root, M::MODEL_TYPE)?;
    let config: M::Config = model_config_of(&checkpoint)?;
    let tensors = rank_tensors(&checkpoint, M::trunk(&config), parallel)?;
    let model = M::build(config, inference_options(device, dtype), parallel)?;
    model
        .load_parameters(&tensors)
        .with_context(|| format!("loading {}", checkpoint.directory.display()))?;
    Ok(model)
}

fn inference_options(device: Device, dtype: Kind) -> ModelOptions {
    ModelOptions {
        params_dtype: dtype,
        device,
        recompute: Recompute::None,
        seed: 0,
        bias_dropout_fusion: true,
        rope_fusion: false,
    }
}

/// The checkpoint's tensors, ranks merged, cut for `parallel`'s tensor-parallel rank.
fn rank_tensors(
    checkpoint: &CheckpointDirectory,
    config: &TransformerConfig,
    parallel: &ParallelState,
) -> Result<std::collections::HashMap<String, tch::Tensor>> {
    let merged = merge_model_parallel_ranks(checkpoint, Device::Cpu)?;
    let (rank, size) = (
        parallel.tensor_parallel_rank(),
        parallel.tensor_parallel_size(),
    );
    Ok(if size > 1 {
        split_for_tensor_parallel(&merged, config, rank, size)
    } else {
        merged
    })
}
