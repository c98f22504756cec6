//! Data and tokenizer flags (spec megatron-data §4).

use std::path::PathBuf;

use crate::blend::DataPathFlags;
use crate::tokenizer::{TikTokenOptions, TokenizerConfig, TokenizerType};
use clap::Args;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct DataArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub paths: DataPathFlags,
    /// Synthetic data (Megatron's mock GPT dataset) instead of --data-path.
    #[arg(long)]
    pub mock_data: bool,
    /// Where to cache the sample indices [default: beside each dataset].
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Restart position ids after every end-of-document token.
    #[arg(long)]
    pub reset_position_ids: bool,
    /// Do not attend across end-of-document tokens.
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// No loss on the token after an end-of-document token.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// Batches prepared ahead by the background loader.
    #[arg(long, default_value_t = 2)]
    pub num_workers: usize,
    /// Accepted for compatibility: single (the only sampler).
    #[arg(long, default_value = "single")]
    pub dataloader_type: String,
}

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct TokenizerArgs {
    /// GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase, HuggingFaceTokenizer,
    /// SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer or
    /// NullTokenizer.
    #[arg(
        long,
        default_value = "GPT2BPETokenizer",
        value_parser = clap::builder::PossibleValuesParser::new(TokenizerType::NAMES),
        hide_possible_values = true
    )]
    pub tokenizer_type: String,
    /// Vocabulary file (GPT-2 encoder JSON or BERT vocab.txt).
    #[arg(long)]
    pub vocab_file: Option<PathBuf>,
    /// GPT-2 BPE merges file.
    #[arg(long)]
    pub merge_file: Option<PathBuf>,
    /// HuggingFace tokenizer.json or directory, SentencePiece .model, or tiktoken JSON.
    #[arg(long)]
    pub tokenizer_model: Option<PathBuf>,
    /// Vocabulary size of the NullTokenizer; TikTokenizer's whole vocabulary (default 131072).
    #[arg(long)]
    pub vocab_size: Option<u32>,
    /// TikTokenizer: pre-tokenization pattern, v1 or v2 (Megatron's PATTERN_TIKTOKEN(_V2)).
    #[arg(long, default_value = "v2")]
    pub tiktoken_pattern: String,
    /// TikTokenizer: ids reserved for special tokens in front of the BPE ranks.
    #[arg(long, default_value_t = 1000)]
    pub tiktoken_num_special_tokens: usize,
    /// TikTokenizer: the special tokens (must include <unk>, <s>, </s>; default exactly those).
    #[arg(long, num_args = 1..)]
    pub tiktoken_special_tokens: Option<Vec<String>>,
    /// Name index caches like Megatron's legacy tokenizers (up to core_v0.14).
    #[arg(long)]
    pub legacy_tokenizer: bool,
}

impl TokenizerArgs {
    pub fn config(&self) -> anyhow::Result<TokenizerConfig> {
        let kind: TokenizerType = self.tokenizer_type.parse().map_err(anyhow::Error::msg)?;
        Ok(TokenizerConfig {
            kind,
            vocab_file: self.vocab_file.clone(),
            merge_file: self.merge_file.clone(),
            tokenizer_model: self.tokenizer_model.clone(),
            vocab_size: self.vocab_size,
            tiktoken: TikTokenOptions {
                pattern: self.tiktoken_pattern.clone(),
                num_special_tokens: self.tiktoken_num_special_tokens,
                special_tokens: self.tiktoken_special_tokens.clone(),
                ..Default::default()
            },
            include_special_tokens: true,
        })
    }
}
