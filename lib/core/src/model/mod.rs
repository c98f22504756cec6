//! Megatron's GPT in libtorch: configuration, tensor-parallel-aware layers, the model, its loss,
//! and the mapping from HuggingFace checkpoints.

pub mod config;
pub mod cross_entropy;
pub mod gpt;
pub mod hf;
pub mod layers;
pub mod param;
pub mod partition;

pub use config::{Activation, GptConfig, Normalization, PositionEmbeddingType};
pub use cross_entropy::cross_entropy;
pub use gpt::{
    ChunkInput, ChunkSpec, GptModel, ModelOptions, ParamGate, Recompute, RecomputeMethod,
};
pub use layers::{AttentionMask, NamedParameter, ParamAttributes};
pub use partition::PipelineSplit;
