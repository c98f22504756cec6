//! The building blocks of Megatron's transformer, written tensor-parallel-aware: linears and
//! embeddings hold their tensor-parallel shard and call the regions of `megatron_parallel`.

mod attention;
mod context_parallel;
mod embedding;
mod fp8_linear;
mod kv_cache;
mod linear;
mod linear_gelu;
pub(crate) mod main_grad_linear;
mod mlp;
pub mod moe;
mod norm;
mod packed;
mod qkv_projection;
mod rope;
mod transformer_layer;

pub use attention::{AttentionMask, CrossAttention, HeadNorms, MemoryKeysValues, SelfAttention};
pub use context_parallel::{ContextChunks, ContextExchange, ContextParallel};
pub use embedding::VocabParallelEmbedding;
pub use fp8_linear::Fp8Linear;
pub use kv_cache::{KvCache, LayerCache, PagedKvCache, PagedStep, BLOCK_SIZE};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use mlp::Mlp;
pub use moe::MoeLayer;
pub use norm::Norm;
pub use packed::PackedSequences;
pub use rope::{RotaryEmbedding, RotaryTables};
pub use transformer_layer::{
    enable_planned_fp8, scoped_expert_biases, scoped_fp8_linears, FeedForward, Memory, Residual,
    TransformerLayer,
};

use std::sync::Arc;

use tch::Tensor;

use crate::param::{MainGradSlot, Param};
use megatron_parallel::Communicator;

/// What a layer needs to know about tensor parallelism.
#[derive(Clone)]
pub struct TensorParallel {
    pub group: Arc<dyn Communicator>,
    /// `--sequence-parallel`: activations outside the tensor-parallel regions are split along
    /// the sequence.
    pub sequence_parallel: bool,
}

/// How a parameter is shared across ranks, which decides how its gradient is synchronised and
/// whether it counts in the gradient norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ParamAttributes {
    /// Each tensor-parallel rank holds a different slice.
    pub tensor_parallel: bool,
    /// Replicated over the tensor-parallel group, but with sequence parallelism each rank only
    /// sees its slice of the sequence: gradients are summed over the group.
    pub sequence_parallel: bool,
    /// The last pipeline stage's copy of the tied word embeddings: left out of norms.
    pub shared_embedding: bool,
    /// The tied word embeddings held by both the first and the last pipeline stage: their
    /// gradients are summed over the embedding group.
    pub tied_across_stages: bool,
    /// A routed expert of a Mixture-of-Experts layer, whole on its rank: its gradient is
    /// reduced over the expert-data-parallel group, and it counts in the experts' share of
    /// the gradient norm.
    pub expert: bool,
}

impl ParamAttributes {
    /// An ordinary parameter, identical on every tensor-parallel rank.
    pub const REPLICATED: ParamAttributes = ParamAttributes {
        tensor_parallel: false,
        sequence_parallel: false,
        shared_embedding: false,
        tied_across_stages: false,
        expert: false,
    };
}

/// A parameter under its Megatron state-dict name.
pub struct NamedParameter {
    pub name: String,
    pub tensor: Tensor,
    pub attributes: ParamAttributes,
    /// Set for parameters whose layer can accumulate straight into the optimizer's float32
    /// gradient (see [`MainGradSlot`]).
    pub main_grad: Option<MainGradSlot>,
}

/// Collects parameters under Megatron's state-dict names.
pub struct NamedTensors<'a> {
    prefix: String,
    out: &'a mut Vec<NamedParameter>,
}

impl<'a> NamedTensors<'a> {
    pub fn new(out: &'a mut Vec<NamedParameter>) -> Self {
        NamedTensors {
            prefix: String::new(),
            out,
        }
    }

    pub fn push(&mut self, name: &str, tensor: &Tensor, attributes: ParamAttributes) {
        self.out.push(NamedParameter {
            name: format!("{}{name}", self.prefix),
            tensor: tensor.shallow_clone(),
            attributes,
            main_grad: None,
        });
    }

    /// Like [`push`](Self::push), for a parameter whose layer accumulates its gradient into
    /// the optimizer's float32 buffer when asked to.
    pub fn push_fusable(&mut self, name: &str, param: &Param, attributes: ParamAttributes) {
        self.out.push(NamedParameter {
            name: format!("{}{name}", self.prefix),
            tensor: param.tensor().shallow_clone(),
            attributes,
            main_grad: Some(param.main_grad().clone()),
        });
    }

    /// Collects what `push` names under `prefix.` as routed experts' parameters (see
    /// [`ParamAttributes::expert`]).
    pub fn experts(&mut self, prefix: &str, push: impl FnOnce(&mut NamedTensors)) {
        let start = self.out.len();
        push(&mut self.scope(prefix));
        for param in &mut self.out[start..] {
            param.attributes = ParamAttributes {
                expert: true,
                ..ParamAttributes::REPLICATED
            };
        }
    }

    /// A collector whose names start with `prefix.`.
    pub fn scope(&mut self, prefix: &str) -> NamedTensors<'_> {
        NamedTensors {
            prefix: format!("{}{prefix}.", self.prefix),
            out: self.out,
        }
    }
}
