//! The tokenizer flags Megatron's tools share (`--tokenizer-type` and its files and options).

use std::path::PathBuf;

use clap::Args;

use super::{TikTokenOptions, TokenizerConfig, TokenizerType};

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
    /// TikTokenizer: pre-tokenization pattern, v1 or v2 (Megatron's PATTERN_TIKTOKEN(_V2))
    /// [default: v2]. Whether it was given enters cache descriptions, as in Megatron.
    #[arg(long, value_parser = ["v1", "v2"])]
    pub tiktoken_pattern: Option<String>,
    /// TikTokenizer: ids reserved for special tokens in front of the BPE ranks.
    #[arg(long, default_value_t = 1000)]
    pub tiktoken_num_special_tokens: usize,
    /// TikTokenizer: the special tokens (must include <unk>, <s>, </s>; default exactly those).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub tiktoken_special_tokens: Option<Vec<String>>,
    /// Megatron's legacy tokenizers (up to core_v0.14): index caches named as they name them,
    /// and WordPiece with their [BOS]/[EOS] additions (the vocabulary `preprocess_data`
    /// tokenizes with unless given --tokenizer-hf-include-special-tokens).
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
                pattern: self.tiktoken_pattern.clone().unwrap_or_else(|| "v2".into()),
                num_special_tokens: self.tiktoken_num_special_tokens,
                special_tokens: self.tiktoken_special_tokens.clone(),
                ..Default::default()
            },
            // The generations differ for WordPiece: the legacy one adds [BOS] and [EOS] (the
            // end of document), the current one wraps texts in [CLS] ... [SEP].
            include_special_tokens: !self.legacy_tokenizer,
        })
    }
}
