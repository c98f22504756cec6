//! `pretrain_t5`'s own flags (Megatron's `_add_data_args` T5 part and the masked-LM data flags).

use anyhow::{bail, Result};
use clap::{Args, Command};

use super::PretrainArgs;
use megatron_models::T5Config;

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

/// Every flag of `pretrain_t5`: the common pretraining flags and T5's.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct T5PretrainArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: PretrainArgs,
    #[command(flatten, next_help_heading = "T5")]
    #[serde(flatten)]
    pub t5: T5Args,
}

/// T5's spelling of the trunk's flags on a parser holding [`T5PretrainArgs`]: Megatron's
/// `--encoder-num-layers` and `--encoder-seq-length` name the trunk's `--num-layers` and
/// `--seq-length` (either spelling works), and the tokenizer defaults to
/// BertWordPieceLowerCase as in `pretrain_t5.py`.
pub fn t5_flags(command: Command) -> Command {
    command
        .mut_arg("num_layers", |arg| {
            arg.visible_alias("encoder-num-layers")
                .help("Encoder layers (also the decoder's without --decoder-num-layers)")
        })
        .mut_arg("seq_length", |arg| {
            arg.visible_alias("encoder-seq-length")
                .help("Maximum encoder sequence length")
        })
        .mut_arg("tokenizer_type", |arg| {
            arg.default_value("BertWordPieceLowerCase")
        })
}

impl T5PretrainArgs {
    /// The architecture for a tokenizer of `vocab_size` tokens (sentinels included).
    pub fn t5_config(&self, vocab_size: i64) -> Result<T5Config> {
        let model = &self.common.model;
        if self.t5.decoder_seq_length < 1 {
            bail!("--decoder-seq-length must be at least 1");
        }
        let transformer = model.gpt_config(vocab_size)?;
        if self.t5.decoder_seq_length > transformer.max_position_embeddings {
            bail!(
                "--decoder-seq-length {} exceeds --max-position-embeddings {} (the decoder shares the position table)",
                self.t5.decoder_seq_length,
                transformer.max_position_embeddings
            );
        }
        Ok(T5Config {
            encoder_num_layers: model.num_layers,
            decoder_num_layers: self.t5.decoder_num_layers.unwrap_or(model.num_layers),
            transformer,
        })
    }
}
