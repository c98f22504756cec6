//! BERT's own flags (Megatron's `_add_bert_args` and the masked-LM data flags), which
//! `pretrain_bert` adds to the pretraining flags every family shares.

use clap::Args;

use super::config::BertConfig;
use crate::config::{Activation, TransformerConfig};

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct BertArgs {
    /// Train the sentence-order (binary) head with two token types (Megatron's default).
    #[arg(long, overrides_with = "bert_no_binary_head")]
    pub bert_binary_head: bool,
    /// No sentence-order head, pooler or token types: masked-LM loss only.
    #[arg(long, overrides_with = "bert_binary_head")]
    pub bert_no_binary_head: bool,
    /// Probability of masking a token (whole words and n-grams, as Megatron's dataset).
    #[arg(long, default_value_t = 0.15)]
    pub mask_prob: f64,
    /// Probability of a sample shorter than the sequence length.
    #[arg(long, default_value_t = 0.1)]
    pub short_seq_prob: f64,
}

impl BertArgs {
    /// Whether the binary head is trained: yes unless `--bert-no-binary-head` came last.
    pub fn binary_head(&self) -> bool {
        !self.bert_no_binary_head
    }

    /// The architecture over the trunk `transformer`; `openai_gelu` (`--openai-gelu`) picks the
    /// LM head's GeLU.
    pub fn config(&self, transformer: TransformerConfig, openai_gelu: bool) -> BertConfig {
        BertConfig {
            transformer,
            binary_head: self.binary_head(),
            lm_head_activation: if openai_gelu {
                Activation::GeluTanh
            } else {
                Activation::GeluErf
            },
            task_head: None,
        }
    }
}
