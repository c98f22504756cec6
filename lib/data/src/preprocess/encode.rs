use crate::sentence::SentenceSplitter;
use crate::tokenizer::{Tokenizer, TokenizerError};

use super::FieldText;

/// The tokens of one JSON key of one document, cut into sequences.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EncodedField {
    pub tokens: Vec<u32>,
    /// Tokens per non-empty sentence (one entry without sentence splitting).
    pub lengths: Vec<usize>,
}

/// Megatron's per-document encoding: optional sentence split, tokenize each sentence, drop
/// empty ones, and append the end-of-document token to the last sentence of non-empty documents.
pub struct Encoder {
    tokenizer: Box<dyn Tokenizer>,
    splitter: Option<SentenceSplitter>,
    eod: Option<u32>,
}

impl Encoder {
    /// `append_eod` needs a tokenizer with an end-of-document token.
    pub fn new(
        tokenizer: Box<dyn Tokenizer>,
        splitter: Option<SentenceSplitter>,
        append_eod: bool,
    ) -> Result<Self, TokenizerError> {
        let eod = if append_eod {
            Some(tokenizer.eod().ok_or_else(|| {
                TokenizerError::Config(
                    "--append-eod: this tokenizer has no end-of-document token".into(),
                )
            })?)
        } else {
            None
        };
        Ok(Encoder {
            tokenizer,
            splitter,
            eod,
        })
    }

    pub fn tokenizer(&self) -> &dyn Tokenizer {
        self.tokenizer.as_ref()
    }

    pub fn splits_sentences(&self) -> bool {
        self.splitter.is_some()
    }

    pub fn encode(&self, field: &FieldText) -> Result<EncodedField, TokenizerError> {
        let sentences: Vec<&str> = match (field, &self.splitter) {
            (FieldText::Text(text), Some(splitter)) => splitter.split_document(text),
            (FieldText::Text(text), None) => vec![text.as_str()],
            (FieldText::Sentences(list), _) => list.iter().map(String::as_str).collect(),
        };
        let mut out = EncodedField::default();
        for sentence in sentences {
            let before = out.tokens.len();
            self.tokenizer.tokenize_into(sentence, &mut out.tokens)?;
            let n = out.tokens.len() - before;
            if n > 0 {
                out.lengths.push(n);
            }
        }
        if let (Some(eod), Some(last)) = (self.eod, out.lengths.last_mut()) {
            out.tokens.push(eod);
            *last += 1;
        }
        Ok(out)
    }
}
