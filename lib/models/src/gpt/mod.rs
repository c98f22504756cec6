//! GPT: the causal decoder (GPT-2 and the Llama family alike) over the shared trunk. Its
//! architecture is the trunk's own [`TransformerConfig`](crate::TransformerConfig); it has no
//! flags beyond the ones every family shares.

mod batch;
pub mod hf;
pub mod hf_config;
pub mod megatron_names;
mod model;

pub use batch::GptBatch;
pub use model::{ChunkInput, ChunkOutput, GptModel};
