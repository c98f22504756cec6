//! What the masked-LM datasets need of a WordPiece tokenizer (Megatron reads these from its
//! tokenizer object): special ids, which ids are `##` continuations, the random-token lookup
//! list and the sentinels.

use anyhow::{bail, Result};

use crate::tokenizer::BertWordPiece;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WordPieceVocab {
    pub cls: i64,
    pub sep: i64,
    pub mask: i64,
    pub pad: i64,
    /// `[BOS]`/`[EOS]` (T5's decoder start and end).
    pub bos: Option<i64>,
    pub eos: Option<i64>,
    /// `--vocab-extra-ids` tokens in id order (T5's sentinels).
    pub sentinels: Vec<i64>,
    /// Per id: its vocabulary entry starts with `##`.
    continuation: Vec<bool>,
    /// Random replacement ids, in Megatron's `inv_vocab` order.
    token_lookup: Vec<i64>,
}

impl WordPieceVocab {
    pub fn from_bert(tokenizer: &BertWordPiece) -> Result<WordPieceVocab> {
        let id = |token: &str| -> Result<i64> {
            match tokenizer.token_id(token) {
                Some(id) => Ok(i64::from(id)),
                None => bail!("the vocabulary has no {token} token, which masked-LM data needs"),
            }
        };
        let lookup = tokenizer.lookup_order();
        let size = lookup.iter().map(|&i| i as usize + 1).max().unwrap_or(0);
        let continuation = (0..size as u32)
            .map(|i| tokenizer.id_token(i).is_some_and(|t| t.starts_with("##")))
            .collect();
        Ok(WordPieceVocab {
            cls: id("[CLS]")?,
            sep: id("[SEP]")?,
            mask: id("[MASK]")?,
            pad: id("[PAD]")?,
            bos: tokenizer.bos().map(i64::from),
            eos: tokenizer.eos().map(i64::from),
            sentinels: tokenizer
                .additional_special_tokens_ids()
                .iter()
                .map(|&i| i64::from(i))
                .collect(),
            continuation,
            token_lookup: lookup.iter().map(|&i| i64::from(i)).collect(),
        })
    }

    /// A vocabulary from explicit parts (tests and synthetic data): `tokens[i]` is id `i`.
    pub fn from_tokens(tokens: &[&str], sentinels: usize) -> Result<WordPieceVocab> {
        let text: String = tokens.iter().map(|t| format!("{t}\n")).collect();
        let tokenizer = BertWordPiece::from_vocab_text(&text, true, false)
            .map_err(anyhow::Error::msg)?
            .with_extra_ids(sentinels);
        WordPieceVocab::from_bert(&tokenizer)
    }

    /// True when `id`'s entry starts with `##` (ids outside the vocabulary are word starts).
    pub fn is_continuation(&self, id: i64) -> bool {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.continuation.get(i))
            .copied()
            .unwrap_or(false)
    }

    pub fn token_lookup(&self) -> &[i64] {
        &self.token_lookup
    }
}
