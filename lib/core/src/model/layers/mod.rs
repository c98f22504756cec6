//! The building blocks of Megatron's transformer, written tensor-parallel-aware: linears and
//! embeddings hold their tensor-parallel shard and call the regions of `crate::parallel`.

mod attention;
mod embedding;
mod linear;
mod mlp;
mod norm;
mod rope;
mod transformer_layer;

pub use attention::{AttentionMask, SelfAttention};
pub use embedding::VocabParallelEmbedding;
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use mlp::Mlp;
pub use norm::Norm;
pub use rope::{RotaryEmbedding, RotaryTables};
pub use transformer_layer::TransformerLayer;

use tch::Tensor;

/// Collects `(name, tensor)` pairs under Megatron's state-dict names.
pub struct NamedTensors<'a> {
    prefix: String,
    out: &'a mut Vec<(String, Tensor)>,
}

impl<'a> NamedTensors<'a> {
    pub fn new(out: &'a mut Vec<(String, Tensor)>) -> Self {
        NamedTensors { prefix: String::new(), out }
    }

    pub fn push(&mut self, name: &str, tensor: &Tensor) {
        self.out.push((format!("{}{name}", self.prefix), tensor.shallow_clone()));
    }

    /// A collector whose names start with `prefix.`.
    pub fn scope(&mut self, prefix: &str) -> NamedTensors<'_> {
        NamedTensors { prefix: format!("{}{prefix}.", self.prefix), out: self.out }
    }
}
