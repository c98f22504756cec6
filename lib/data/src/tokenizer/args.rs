//! The tokenizer flags Megatron's tools share (`--tokenizer-type` and its files and options).

use std::path::PathBuf;

use clap::Args;

use super::{TikTokenOptions, TokenizerConfig, TokenizerType};

/// The tokenizer types that read `--tokenizer-model`: a command line naming one without it is
/// a usage error.
const MODEL_FILE_TYPES: [&str; 6] = [
    "HuggingFaceTokenizer",
    "SFTTokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
];

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct TokenizerArgs {
    /// GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase, HuggingFaceTokenizer,
    /// SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer,
    /// NullTokenizer or SFTTokenizer (a HuggingFace tokenizer for --sft).
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
    #[arg(long, required_if_eq_any = MODEL_FILE_TYPES.map(|kind| ("tokenizer_type", kind)))]
    pub tokenizer_model: Option<PathBuf>,
    /// Vocabulary size of the NullTokenizer; TikTokenizer's whole vocabulary (default 131072).
    #[arg(long, required_if_eq("tokenizer_type", "NullTokenizer"))]
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
    /// The tokenizer flags of a command line such as `["--tokenizer-type", "NullTokenizer",
    /// "--vocab-size", "512"]`, with every other flag at its default (tests and tools that
    /// name a tokenizer as flags).
    pub fn from_flags<I, T>(flags: I) -> Result<TokenizerArgs, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            tokenizer: TokenizerArgs,
        }
        let program = std::iter::once(std::ffi::OsString::from("tokenizer"));
        let flags = <Flags as clap::Parser>::try_parse_from(
            program.chain(flags.into_iter().map(Into::into)),
        )?;
        Ok(flags.tokenizer)
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tokenizer_type_without_its_file_or_size_is_a_usage_error() {
        for kind in MODEL_FILE_TYPES {
            let error = TokenizerArgs::from_flags(["--tokenizer-type", kind]).unwrap_err();
            assert_eq!(
                error.kind(),
                clap::error::ErrorKind::MissingRequiredArgument
            );
            assert!(error.to_string().contains("--tokenizer-model"), "{error}");
        }
        let error = TokenizerArgs::from_flags(["--tokenizer-type", "NullTokenizer"]).unwrap_err();
        assert!(error.to_string().contains("--vocab-size"), "{error}");
        let given = [
            "--tokenizer-type",
            "Llama2Tokenizer",
            "--tokenizer-model",
            "m.model",
        ];
        assert!(TokenizerArgs::from_flags(given).is_ok());
        assert!(TokenizerArgs::from_flags::<[&str; 0], &str>([]).is_ok());
    }
}
