//! A GPT rebuilt from checkpoint metadata, so inference tools need no model flags.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::checkpoint::{find_checkpoint, merge_model_parallel_ranks, split_for_tensor_parallel};
use crate::model::{GptConfig, GptModel, ModelOptions, Recompute};
use crate::parallel::ParallelState;

/// Loads the checkpoint the tracker under `root` names, in `dtype` on `device`, with dropout
/// irrelevant (inference runs with `train = false`). Whatever layout it was saved in, the ranks
/// are merged and cut again for `parallel`'s tensor-parallel rank (one model without it).
pub fn load_gpt_for_inference(
    root: &Path,
    device: Device,
    dtype: Kind,
    parallel: &ParallelState,
) -> Result<GptModel> {
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
    let config: GptConfig = serde_json::from_value(checkpoint.metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
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
