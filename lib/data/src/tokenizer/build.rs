use std::path::PathBuf;

use super::{BertWordPiece, Gpt2Bpe, HuggingFace, NullTokenizer, Tokenizer, TokenizerError};

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
}

impl TokenizerType {
    pub const NAMES: [&'static str; 9] = [
        "GPT2BPETokenizer",
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "HuggingFaceTokenizer",
        "NullTokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
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

/// Builds the tokenizer `config` describes.
pub fn build_tokenizer(config: &TokenizerConfig) -> Result<Box<dyn Tokenizer>, TokenizerError> {
    build_tokenizer_with_extra_ids(config, 0)
}

/// [`build_tokenizer`] with Megatron's `--vocab-extra-ids N`: `<extra_id_0>`..`<extra_id_{N-1}>`
/// appended to the vocabulary (T5's sentinels). Megatron's legacy WordPiece and SentencePiece
/// tokenizers take them; of those only WordPiece is supported here. (`preprocess_data` never
/// adds them, as in Megatron.)
pub fn build_tokenizer_with_extra_ids(
    config: &TokenizerConfig,
    vocab_extra_ids: usize,
) -> Result<Box<dyn Tokenizer>, TokenizerError> {
    let kind = config.kind;
    if vocab_extra_ids > 0 && !kind.is_bert() {
        return Err(TokenizerError::Config(format!(
            "--vocab-extra-ids needs a WordPiece tokenizer (BertWordPieceLowerCase or \
             BertWordPieceCase); {kind} has no sentinel tokens"
        )));
    }
    Ok(match kind {
        TokenizerType::Gpt2BpeTokenizer => Box::new(Gpt2Bpe::from_files(
            &required(&config.vocab_file, "--vocab-file", kind)?,
            &required(&config.merge_file, "--merge-file", kind)?,
        )?),
        TokenizerType::BertWordPieceLowerCase | TokenizerType::BertWordPieceCase => Box::new(
            BertWordPiece::from_file(
                &required(&config.vocab_file, "--vocab-file", kind)?,
                kind == TokenizerType::BertWordPieceLowerCase,
                config.include_special_tokens,
            )?
            .with_extra_ids(vocab_extra_ids),
        ),
        TokenizerType::HuggingFaceTokenizer => Box::new(HuggingFace::from_path(
            &required(&config.tokenizer_model, "--tokenizer-model", kind)?,
            true,
        )?),
        TokenizerType::NullTokenizer => Box::new(NullTokenizer::new(
            config
                .vocab_size
                .ok_or_else(|| TokenizerError::Config("NullTokenizer needs --vocab-size".into()))?,
        )),
        TokenizerType::SentencePieceTokenizer
        | TokenizerType::GptSentencePieceTokenizer
        | TokenizerType::Llama2Tokenizer
        | TokenizerType::TikTokenizer => {
            return Err(TokenizerError::Config(format!(
                "{kind} is not supported: there is no maintained pure-Rust loader for its model files; \
                 convert the model to a HuggingFace tokenizer.json and use --tokenizer-type HuggingFaceTokenizer"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(kind: TokenizerType, vocab_file: PathBuf) -> TokenizerConfig {
        TokenizerConfig {
            kind,
            vocab_file: Some(vocab_file),
            merge_file: None,
            tokenizer_model: None,
            vocab_size: None,
            include_special_tokens: false,
        }
    }

    #[test]
    fn extra_ids_extend_wordpiece_vocabularies_only() {
        let dir = tempfile::tempdir().unwrap();
        let vocab = dir.path().join("vocab.txt");
        std::fs::write(&vocab, "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nhello\n").unwrap();
        let bert = config(TokenizerType::BertWordPieceLowerCase, vocab.clone());
        let t = build_tokenizer_with_extra_ids(&bert, 2).unwrap();
        // 6 entries, [BOS] 6, [EOS] 7, <extra_id_0> 8, <extra_id_1> 9.
        assert_eq!(t.vocab_size(), 10);
        assert_eq!(t.tokenize("hello <extra_id_1>").unwrap()[0], 5);
        assert_eq!(t.detokenize(&[8, 9]).unwrap(), "<extra_id_0> <extra_id_1>");
        assert_eq!(build_tokenizer(&bert).unwrap().vocab_size(), 8);
        let gpt = config(TokenizerType::NullTokenizer, vocab);
        assert!(build_tokenizer_with_extra_ids(&gpt, 2).is_err());
    }
}
