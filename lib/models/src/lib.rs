//! Megatron's models in libtorch (GPT, BERT, T5): configuration, tensor-parallel-aware layers, the
//! shared transformer stack, the models, their loss, and the mapping from HuggingFace checkpoints.

pub mod bert;
pub mod chunk;
pub mod config;
pub mod cross_entropy;
pub mod fp8;
pub mod fused_cross_entropy;
pub mod gpt;
pub mod hf;
pub mod layers;
pub mod loader;
pub mod param;
pub mod partition;
pub mod stack;
pub mod t5;

pub use bert::{BertConfig, BertModel, BertOutput, TaskHead};
pub use chunk::ModelChunk;
pub use config::{
    Activation, Normalization, PositionEmbeddingType, RopeScaling, TransformerConfig,
};
pub use cross_entropy::{cross_entropy, mask_extra_vocabulary};
pub use gpt::{
    ChunkInput, ChunkOutput, ChunkSpec, GptModel, ModelOptions, ParamGate, Recompute,
    RecomputeMethod,
};
pub use layers::{AttentionMask, NamedParameter, ParamAttributes};
pub use partition::PipelineSplit;
pub use stack::OutputHead;
pub use t5::{T5Config, T5DecoderState, T5Input, T5Model};
