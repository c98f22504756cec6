use std::path::PathBuf;

use super::{
    BertWordPiece, Gpt2Bpe, HuggingFace, NullTokenizer, SentencePiece, SentencePieceFlavor,
    TikToken, TikTokenOptions, Tokenizer, TokenizerError,
};

/// Megatron's `--tokenizer-type` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerType {
    Gpt2BpeTokenizer,
    BertWordPieceLowerCase,
    BertWordPieceCase,
    HuggingFaceTokenizer,
    NullTokenizer,
    SentencePieceTokenizer,
    GptSentencePieceTokenizer,
    Llama2Tokenizer,
    TikTokenizer,
    /// Megatron's `SFTTokenizer`: a HuggingFace tokenizer for `--sft`, encoding without the
    /// model's automatic special tokens (the prompt format places them).
    SftTokenizer,
}

impl TokenizerType {
    pub const NAMES: [&'static str; 10] = [
        "GPT2BPETokenizer",
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "HuggingFaceTokenizer",
        "NullTokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
        "SFTTokenizer",
    ];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// True for the BERT family, which Megatron expects to be used with `--split-sentences`.
    pub fn is_bert(self) -> bool {
        matches!(
            self,
            TokenizerType::BertWordPieceLowerCase | TokenizerType::BertWordPieceCase
        )
    }
}

impl std::str::FromStr for TokenizerType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        use TokenizerType::*;
        let all = [
            Gpt2BpeTokenizer,
            BertWordPieceLowerCase,
            BertWordPieceCase,
            HuggingFaceTokenizer,
            NullTokenizer,
            SentencePieceTokenizer,
            GptSentencePieceTokenizer,
            Llama2Tokenizer,
            TikTokenizer,
            SftTokenizer,
        ];
        all.into_iter().find(|t| t.name() == s).ok_or_else(|| {
            format!(
                "unknown tokenizer type {s:?} (choose from {})",
                Self::NAMES.join(", ")
            )
        })
    }
}

impl std::fmt::Display for TokenizerType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The tokenizer flags Megatron's tools share.
#[derive(Debug, Clone)]
pub struct TokenizerConfig {
    pub kind: TokenizerType,
    pub vocab_file: Option<PathBuf>,
    pub merge_file: Option<PathBuf>,
    pub tokenizer_model: Option<PathBuf>,
    pub vocab_size: Option<u32>,
    /// `TikTokenizer`'s pattern and special tokens (its `vocab_size` is `vocab_size` above).
    pub tiktoken: TikTokenOptions,
    /// Megatron's 2026 behaviour: BERT wraps every text in `[CLS]` ... `[SEP]`. HuggingFace
    /// tokenizers always add their model's special tokens, as Megatron's do.
    pub include_special_tokens: bool,
}

fn required(
    value: &Option<PathBuf>,
    flag: &str,
    kind: TokenizerType,
) -> Result<PathBuf, TokenizerError> {
    value
        .clone()
        .ok_or_else(|| TokenizerError::Config(format!("{kind} needs {flag}")))
}

/// Builds the tokenizer `config` describes. (T5's sentinels, `--vocab-extra-ids`, belong to the
/// masked-LM tokenizers: `masked::MaskedTokenizer`.)
pub fn build_tokenizer(config: &TokenizerConfig) -> Result<Box<dyn Tokenizer>, TokenizerError> {
    let kind = config.kind;
    Ok(match kind {
        TokenizerType::Gpt2BpeTokenizer => Box::new(Gpt2Bpe::from_files(
            &required(&config.vocab_file, "--vocab-file", kind)?,
            &required(&config.merge_file, "--merge-file", kind)?,
        )?),
        TokenizerType::BertWordPieceLowerCase | TokenizerType::BertWordPieceCase => {
            Box::new(BertWordPiece::from_file(
                &required(&config.vocab_file, "--vocab-file", kind)?,
                kind == TokenizerType::BertWordPieceLowerCase,
                config.include_special_tokens,
            )?)
        }
        TokenizerType::HuggingFaceTokenizer => Box::new(HuggingFace::from_path(
            &required(&config.tokenizer_model, "--tokenizer-model", kind)?,
            true,
        )?),
        TokenizerType::SftTokenizer => Box::new(HuggingFace::from_path(
            &required(&config.tokenizer_model, "--tokenizer-model", kind)?,
            false,
        )?),
        TokenizerType::NullTokenizer => {
            Box::new(NullTokenizer::new(config.vocab_size.ok_or_else(|| {
                TokenizerError::Config("NullTokenizer needs --vocab-size".into())
            })?))
        }
        TokenizerType::SentencePieceTokenizer
        | TokenizerType::GptSentencePieceTokenizer
        | TokenizerType::Llama2Tokenizer => {
            let flavor = match kind {
                TokenizerType::SentencePieceTokenizer => SentencePieceFlavor::Megatron,
                TokenizerType::GptSentencePieceTokenizer => SentencePieceFlavor::Gpt,
                _ => SentencePieceFlavor::Llama2,
            };
            Box::new(SentencePiece::from_file(
                &required(&config.tokenizer_model, "--tokenizer-model", kind)?,
                flavor,
                0,
            )?)
        }
        TokenizerType::TikTokenizer => {
            let mut options = config.tiktoken.clone();
            if let Some(size) = config.vocab_size {
                options.vocab_size = size as usize;
            }
            Box::new(TikToken::from_file(
                &required(&config.tokenizer_model, "--tokenizer-model", kind)?,
                &options,
            )?)
        }
    })
}
