//! Megatron's models in libtorch: the transformer trunk every family shares (configuration,
//! tensor-parallel-aware layers, the layer stack, the loss, the HuggingFace recipe machinery) and
//! one folder per model family (GPT, BERT, T5) holding that family's config, model, batch,
//! flags and name mappings. README.md says how to add a family.

// Shared by every family.
pub mod chunk;
pub mod config;
pub mod cross_entropy;
pub mod family;
pub mod fp8;
pub mod fused_cross_entropy;
pub mod hf;
pub mod layers;
pub mod loader;
pub mod options;
pub mod param;
pub mod partition;
pub mod rope_scaling;
pub mod stack;

// The families.
pub mod bert;
pub mod gpt;
pub mod t5;

pub use chunk::{ChunkSpec, ModelChunk};
pub use config::{Activation, Normalization, PositionEmbeddingType, TransformerConfig};
pub use cross_entropy::{cross_entropy, mask_extra_vocabulary};
pub use family::FamilyModel;
pub use layers::{AttentionMask, NamedParameter, ParamAttributes};
pub use options::{ModelOptions, Recompute, RecomputeMethod};
pub use partition::PipelineSplit;
pub use rope_scaling::{Llama3Scaling, RopeScaling, RopeScalingArgs, YarnScaling};
pub use stack::{OutputHead, ParamGate};

pub use bert::{BertBatch, BertConfig, BertModel, BertOutput, TaskHead};
pub use gpt::{ChunkInput, ChunkOutput, GptBatch, GptModel};
pub use t5::{T5Batch, T5Config, T5DecoderState, T5Input, T5Model};
