//! A whole model between a loader and a saver: unsplit tensors in Megatron-core names (TP=1,
//! PP=1 shapes, the vocabulary padded for one rank) as [`LazyTensor`]s that savers read one at
//! a time, the optimizer state per parameter, and the counters and schedules a resumed run
//! needs.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, Context, Result};
use tch::Tensor;

use super::lazy::LazyTensor;
use megatron_models::TransformerConfig;
use megatron_store::{has_vocab_rows, tensor_split, TensorSplit};

/// Unsplit tensors by Megatron-core name.
pub type Tensors = BTreeMap<String, LazyTensor>;

/// Tensors already in memory as [`Tensors`].
pub fn in_memory(tensors: impl IntoIterator<Item = (String, Tensor)>) -> Tensors {
    tensors
        .into_iter()
        .map(|(name, tensor)| (name, LazyTensor::from(tensor)))
        .collect()
}

/// Adam's state for every parameter, unsplit like the weights.
#[derive(Debug, Default)]
pub struct OptimizerState {
    /// The Adam step count of the run.
    pub step: f64,
    /// float32 main parameters.
    pub main: Tensors,
    pub exp_avg: Tensors,
    pub exp_avg_sq: Tensors,
}

/// Adam state of one rank file, by the rank's (global) parameter names.
#[derive(Default)]
pub(crate) struct RankOptimizer {
    pub step: f64,
    pub main: HashMap<String, LazyTensor>,
    pub exp_avg: HashMap<String, LazyTensor>,
    pub exp_avg_sq: HashMap<String, LazyTensor>,
}

/// Counters, schedules and flags of the run that saved a checkpoint.
#[derive(Debug, Clone, Default)]
pub struct RunState {
    pub iteration: u64,
    pub consumed_train_samples: u64,
    pub consumed_valid_samples: u64,
    pub num_floating_point_operations_so_far: f64,
    /// Megatron's `opt_param_scheduler` state (its field names).
    pub opt_param_scheduler: Option<serde_json::Value>,
    pub grad_scaler: Option<serde_json::Value>,
    /// Every flag, by Megatron's argument names.
    pub args: serde_json::Value,
}

#[derive(Debug)]
pub struct ModelState {
    pub config: TransformerConfig,
    /// `float32`, `bfloat16` or `float16`.
    pub params_dtype: String,
    pub weights: Tensors,
    /// Model state outside the parameters: the MoE routers' `expert_bias` buffers
    /// (`--moe-router-enable-expert-bias`), float32 `[experts]`, by Megatron-core name
    /// (`decoder.layers.<i>.mlp.router.expert_bias`); empty without them.
    pub expert_biases: Tensors,
    pub optimizer: Option<OptimizerState>,
    pub run: RunState,
    /// The source's (tensor, pipeline) parallel sizes: the output's default.
    pub source_parallel: (usize, usize),
    /// Where the state came from (`Megatron torch`, `HuggingFace LlamaForCausalLM`, ...).
    pub source: String,
}

/// Is `name` a router's expert bias (`….mlp.router.expert_bias`), a buffer beside its weight?
pub fn is_expert_bias(name: &str) -> bool {
    name.ends_with(".mlp.router.expert_bias")
}

/// The shape of tensor-parallel rank's shard of `name` (unsplit `shape`) for `size` ranks, the
/// vocabulary padded for them.
pub fn shard_shape(name: &str, shape: &[i64], config: &TransformerConfig, size: usize) -> Vec<i64> {
    let mut shape = shape.to_vec();
    if has_vocab_rows(name) {
        shape[0] = config.padded_vocab_size(size as i64);
    }
    match tensor_split(name, config) {
        TensorSplit::Replicated => {}
        TensorSplit::Rows { .. } => shape[0] /= size as i64,
        TensorSplit::Columns => shape[1] /= size as i64,
    }
    shape
}

/// Tensor-parallel rank `rank`'s shard of `name` (unsplit `tensor`) for `size` ranks, the
/// vocabulary padded for them, as a lazy tensor that savers stream
/// ([`LazyTensor::for_each_chunk`]).
pub fn shard_of(
    name: &str,
    tensor: &LazyTensor,
    config: &TransformerConfig,
    rank: usize,
    size: usize,
) -> Result<LazyTensor> {
    let rows = has_vocab_rows(name).then(|| config.padded_vocab_size(size as i64));
    tensor
        .shard(tensor_split(name, config), rank, size, rows)
        .with_context(|| format!("cutting {name}"))
}

impl ModelState {
    pub fn tensor(&self, name: &str) -> Result<&LazyTensor> {
        match self.weights.get(name) {
            Some(t) => Ok(t),
            None => bail!("{}: no tensor {name}", self.source),
        }
    }

    /// The unsplit tensor `name`, read now.
    pub fn read(&self, name: &str) -> Result<Tensor> {
        self.tensor(name)?
            .read()
            .with_context(|| format!("{}: reading {name}", self.source))
    }

    /// Bytes of the weights and optimizer state: what a conversion reads.
    pub fn bytes(&self) -> usize {
        self.weights
            .values()
            .chain(self.optimizer.iter().flat_map(|o| {
                o.main
                    .values()
                    .chain(o.exp_avg.values())
                    .chain(o.exp_avg_sq.values())
            }))
            .map(LazyTensor::bytes)
            .sum()
    }
}
