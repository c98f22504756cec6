//! T5's own flags (Megatron's `_add_data_args` T5 part and the masked-LM data flags), which
//! `pretrain_t5` adds to the pretraining flags every family shares.

use anyhow::{bail, Result};
use clap::Args;

use super::config::T5Config;
use crate::config::TransformerConfig;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct T5Args {
    /// Decoder layers [default: the encoder's, --encoder-num-layers].
    #[arg(long)]
    pub decoder_num_layers: Option<usize>,
    /// Maximum decoder sequence length (the decoder's input and targets).
    #[arg(long)]
    pub decoder_seq_length: i64,
    /// Sentinel tokens `<extra_id_0>`.. appended to the WordPiece vocabulary.
    #[arg(long, default_value_t = 0)]
    pub vocab_extra_ids: usize,
    /// Probability of masking a token (spans of whole words, as Megatron's dataset).
    #[arg(long, default_value_t = 0.15)]
    pub mask_prob: f64,
    /// Probability of a sample shorter than the encoder length.
    #[arg(long, default_value_t = 0.1)]
    pub short_seq_prob: f64,
}

impl T5Args {
    /// The architecture over the trunk `transformer` (whose `num_layers` is the encoder's).
    pub fn config(&self, transformer: TransformerConfig) -> Result<T5Config> {
        if self.decoder_seq_length < 1 {
            bail!("--decoder-seq-length must be at least 1");
        }
        if self.decoder_seq_length > transformer.max_position_embeddings {
            bail!(
                "--decoder-seq-length {} exceeds --max-position-embeddings {} (the decoder shares the position table)",
                self.decoder_seq_length,
                transformer.max_position_embeddings
            );
        }
        Ok(T5Config {
            encoder_num_layers: transformer.num_layers,
            decoder_num_layers: self.decoder_num_layers.unwrap_or(transformer.num_layers),
            transformer,
        })
    }
}
