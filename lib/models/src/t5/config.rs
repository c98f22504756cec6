//! The architecture of a Megatron T5: the trunk's flags and the decoder's depth.

use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

use crate::config::{PositionEmbeddingType, TransformerConfig};

/// The architecture of a Megatron T5: the trunk's flags (`num_layers` is the encoder's) plus the
/// decoder's depth.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct T5Config {
    #[serde(flatten)]
    pub transformer: TransformerConfig,
    /// `--encoder-num-layers` (the trunk's `num_layers`, repeated for the metadata's readers).
    pub encoder_num_layers: usize,
    /// `--decoder-num-layers`.
    pub decoder_num_layers: usize,
}

impl T5Config {
    /// Megatron's T5 checks on top of the trunk's.
    pub fn validate(&self, tensor_parallel_size: i64) -> Result<()> {
        self.transformer.validate(tensor_parallel_size)?;
        let trunk = &self.transformer;
        if trunk.position_embedding_type != PositionEmbeddingType::LearnedAbsolute {
            bail!("T5 uses learned absolute position embeddings (--position-embedding-type learned_absolute)");
        }
        if trunk.num_query_groups != trunk.num_attention_heads {
            bail!("T5's cross-attention has no grouped-query form: --group-query-attention is not supported");
        }
        ensure!(
            self.encoder_num_layers == trunk.num_layers,
            "the encoder's depth {} differs from the trunk's {}",
            self.encoder_num_layers,
            trunk.num_layers
        );
        ensure!(
            self.decoder_num_layers > 0,
            "--decoder-num-layers must be at least 1"
        );
        Ok(())
    }
}
