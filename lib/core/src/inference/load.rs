//! A GPT rebuilt from checkpoint metadata, so inference tools need no model flags.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use crate::checkpoint::{load_checkpoint, rank_directory_name, LoadOptions};
use crate::model::{GptConfig, GptModel, ModelOptions, Recompute};
use crate::parallel::ParallelState;

/// Loads the checkpoint the tracker under `root` names, in `dtype` on `device`, with dropout
/// irrelevant (inference runs with `train = false`).
pub fn load_gpt_for_inference(root: &Path, device: Device, dtype: Kind) -> Result<GptModel> {
    let options = LoadOptions { optimizer: false, rng: false };
    let Some(checkpoint) = load_checkpoint(root, &rank_directory_name(0, 0, 1), device, options)? else {
        bail!("{} holds no checkpoint (no latest_checkpointed_iteration.txt)", root.display());
    };
    if checkpoint.metadata.model_type != "GPT" {
        bail!("{} holds a {} model, not a GPT", checkpoint.directory.display(), checkpoint.metadata.model_type);
    }
    let config: GptConfig = serde_json::from_value(checkpoint.metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
    let model = GptModel::new(config, ModelOptions { params_dtype: dtype, device, recompute: Recompute::None }, &ParallelState::single())?;
    model.load_parameters(&checkpoint.model).with_context(|| format!("loading {}", checkpoint.directory.display()))?;
    Ok(model)
}
