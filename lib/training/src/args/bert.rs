//! `pretrain_bert`'s own flags (Megatron's `_add_bert_args` and the masked-LM data flags).

use anyhow::Result;
use clap::Args;

use super::PretrainArgs;
use megatron_models::{Activation, BertConfig};

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
}

/// Every flag of `pretrain_bert`: the common pretraining flags and BERT's.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct BertPretrainArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: PretrainArgs,
    #[command(flatten, next_help_heading = "BERT")]
    #[serde(flatten)]
    pub bert: BertArgs,
}

impl BertPretrainArgs {
    /// The architecture for a tokenizer of `vocab_size` tokens.
    pub fn bert_config(&self, vocab_size: i64) -> Result<BertConfig> {
        let model = &self.common.model;
        Ok(BertConfig {
            transformer: model.gpt_config(vocab_size)?,
            binary_head: self.bert.binary_head(),
            lm_head_activation: if model.openai_gelu {
                Activation::GeluTanh
            } else {
                Activation::GeluErf
            },
            task_head: None,
        })
    }
}
