//! `metadata.json`: everything about a checkpoint that is not a tensor.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub const CHECKPOINT_FORMAT: &str = "megatron-rs-safetensors";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMetadata {
    /// Always [`CHECKPOINT_FORMAT`]; lets tools tell our checkpoints from Megatron's pickles.
    pub format: String,
    /// Megatron's `checkpoint_version` (3.0: per-head QKV layout).
    pub checkpoint_version: f64,
    pub iteration: u64,
    /// `GPT`, `BERT` or `T5`.
    pub model_type: String,
    /// The architecture (for GPT, a serialized `GptConfig`), so other tools can rebuild the
    /// model without repeating the flags.
    pub model: serde_json::Value,
    /// `float32`, `bfloat16` or `float16`: the dtype of the stored model tensors.
    pub params_dtype: String,
    pub tensor_model_parallel_size: usize,
    pub pipeline_model_parallel_size: usize,
    pub data_parallel_size: usize,
    pub consumed_train_samples: u64,
    pub consumed_valid_samples: u64,
    pub num_floating_point_operations_so_far: f64,
    /// The LR/WD scheduler state, with Megatron's field names.
    pub opt_param_scheduler: Option<serde_json::Value>,
    /// The fp16 loss scaler state (`scale`, `growth_tracker`, `hysteresis_tracker`).
    pub grad_scaler: Option<serde_json::Value>,
    /// `adam` or `sgd` when optimizer state was saved.
    pub optimizer: Option<String>,
    pub has_rng_state: bool,
    /// Every flag of the run that saved it, by Megatron's argument names.
    pub args: serde_json::Value,
}

impl CheckpointMetadata {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let metadata: CheckpointMetadata =
            serde_json::from_str(&text).with_context(|| format!("{}: invalid checkpoint metadata", path.display()))?;
        if metadata.format != CHECKPOINT_FORMAT {
            bail!("{}: format {:?} is not {CHECKPOINT_FORMAT:?}", path.display(), metadata.format);
        }
        Ok(metadata)
    }
}
