//! Tokenizers behind one trait, with the ids Megatron's classic (pre-2026) tokenizers produce.
//!
//! GPT-2 BPE and BERT WordPiece are implemented here so that their legacy quirks (merges-file
//! parsing, unknown-id fallback, BERT's added `[BOS]`/`[EOS]`) match Megatron exactly;
//! `HuggingFaceTokenizer` loads any `tokenizer.json` through the `tokenizers` crate;
//! SentencePiece `.model` files and Megatron's tiktoken JSON vocabularies are read here too.

mod args;
mod bert;
mod bpe_merge;
mod build;
mod gpt2;
mod huggingface;
mod null;
mod sentencepiece;
mod tiktoken;
mod train;

pub use args::TokenizerArgs;
pub use bert::BertWordPiece;
pub use build::{build_tokenizer, TokenizerConfig, TokenizerType};
pub use gpt2::Gpt2Bpe;
pub use huggingface::HuggingFace;
pub use null::NullTokenizer;
pub use sentencepiece::{MegatronSpecialIds, SentencePiece, SentencePieceFlavor};
pub use tiktoken::{pattern_regex, TikToken, TikTokenOptions};
pub use train::{
    read_texts, train_byte_level_bpe, BpeTrainingOptions, TrainError, TrainedBpe, END_OF_TEXT,
};

/// Why a tokenizer could not be built or could not encode a text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {reason}")]
    File {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Encode(String),
}

/// Turns text into token ids.
pub trait Tokenizer: Send + Sync {
    /// Appends the ids of `text` to `out`.
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError>;

    /// The ids of `text`.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        self.tokenize_into(text, &mut out)?;
        Ok(out)
    }

    /// Unpadded vocabulary size as Megatron reports it (it picks the `.bin` dtype).
    fn vocab_size(&self) -> usize;

    /// End-of-document id appended by `--append-eod`, if the tokenizer has one.
    fn eod(&self) -> Option<u32>;

    /// Beginning-of-sequence id, if the tokenizer has one (HuggingFace exports record it).
    fn bos(&self) -> Option<u32> {
        None
    }

    /// The text of `ids`, as Megatron's `detokenize` gives it (bytes that are not valid
    /// UTF-8 become U+FFFD, like Python's `errors='replace'`). Unknown ids are an error.
    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError>;
}

fn unknown_id(id: u32, vocab_size: usize) -> TokenizerError {
    TokenizerError::Encode(format!(
        "token id {id} is outside the vocabulary of {vocab_size} tokens"
    ))
}
