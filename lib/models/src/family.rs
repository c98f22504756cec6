//! What a family's model is to the tools that save, load and serve it: the model type its
//! checkpoints record, the architecture their metadata stores, and how to build it from that
//! architecture alone.

use anyhow::Result;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::chunk::ModelChunk;
use crate::config::TransformerConfig;
use crate::options::ModelOptions;
use megatron_parallel::ParallelState;

/// A model family's model, as its checkpoints name and rebuild it.
pub trait FamilyModel: ModelChunk + Sized {
    /// Megatron's model type, recorded in checkpoints: `GPT`, `BERT`, `T5`.
    const MODEL_TYPE: &'static str;
    /// The architecture, as checkpoint metadata stores it.
    type Config: Clone + Serialize + DeserializeOwned;

    /// The transformer trunk of `config` (hidden size, layers, vocabulary).
    fn trunk(config: &Self::Config) -> &TransformerConfig;
    /// The whole model (no pipeline stages) of `config`, its weights drawn from `options.seed`.
    fn build(config: Self::Config, options: ModelOptions, parallel: &ParallelState)
        -> Result<Self>;
}
