//! `metadata.json`: everything about a checkpoint that is not a tensor.

use std::path::Path;

use anyhow::{bail, Context, Result};
use megatron_data::blend::TrainedOn;
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
    /// The architecture (for GPT, a serialized `TransformerConfig`), so other tools can rebuild the
    /// model without repeating the flags.
    pub model: serde_json::Value,
    /// `float32`, `bfloat16` or `float16`: the dtype of the stored model tensors.
    pub params_dtype: String,
    pub tensor_model_parallel_size: usize,
    pub pipeline_model_parallel_size: usize,
    /// Model chunks per pipeline rank (virtual pipeline stages); 1 without interleaving.
    pub virtual_pipeline_stages: usize,
    /// `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`: with the
    /// sizes above they say which global layers each `mp_rank_TT_PPP` holds.
    #[serde(default)]
    pub decoder_first_pipeline_num_layers: Option<usize>,
    #[serde(default)]
    pub decoder_last_pipeline_num_layers: Option<usize>,
    pub data_parallel_size: usize,
    /// The optimizer state is sharded over the data-parallel ranks (`--use-distributed-optimizer`).
    pub distributed_optimizer: bool,
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
    /// What the run trained on, as resolved from its data flags (absent when it took no data
    /// flags, and in checkpoints converted from elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<TrainedOn>,
}

impl CheckpointMetadata {
    /// `TP=2 PP=2 (2 virtual stages) DP=4, distributed optimizer`.
    pub fn describe_layout(&self) -> String {
        let mut text = format!(
            "TP={} PP={}",
            self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        );
        if self.virtual_pipeline_stages > 1 {
            text.push_str(&format!(
                " ({} virtual stages)",
                self.virtual_pipeline_stages
            ));
        }
        text.push_str(&format!(" DP={}", self.data_parallel_size));
        if self.distributed_optimizer {
            text.push_str(", distributed optimizer");
        }
        text
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let metadata: CheckpointMetadata = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid checkpoint metadata", path.display()))?;
        if metadata.format != CHECKPOINT_FORMAT {
            bail!(
                "{}: format {:?} is not {CHECKPOINT_FORMAT:?}",
                path.display(),
                metadata.format
            );
        }
        Ok(metadata)
    }
}
