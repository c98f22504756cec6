//! What the masked-LM datasets need of their tokenizer (Megatron reads these from its tokenizer
//! object): special ids, which ids are `##` continuations, the random-token lookup list and
//! the sentinels. Megatron's WordPiece and SentencePiece tokenizers have them; its other
//! tokenizers have no `[CLS]`, `[SEP]` or `[MASK]`.

use anyhow::{bail, Result};

use crate::tokenizer::{BertWordPiece, SentencePiece};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedLmVocab {
    pub cls: i64,
    pub sep: i64,
    pub mask: i64,
    pub pad: i64,
    /// T5's decoder start and end (`[BOS]`/`[EOS]` of WordPiece, the model's or Megatron's
    /// added bos/eos of SentencePiece).
    pub bos: Option<i64>,
    pub eos: Option<i64>,
    /// `--vocab-extra-ids` tokens in id order (T5's sentinels).
    pub sentinels: Vec<i64>,
    /// Per id: its vocabulary entry starts with `##` (Megatron's whole-word test, whatever
    /// the tokenizer).
    continuation: Vec<bool>,
    /// Random replacement ids, in Megatron's `inv_vocab` order.
    token_lookup: Vec<i64>,
}

fn ids(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&i| i64::from(i)).collect()
}

impl MaskedLmVocab {
    pub fn from_bert(tokenizer: &BertWordPiece) -> Result<MaskedLmVocab> {
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
        Ok(MaskedLmVocab {
            cls: id("[CLS]")?,
            sep: id("[SEP]")?,
            mask: id("[MASK]")?,
            pad: id("[PAD]")?,
            bos: tokenizer.bos().map(i64::from),
            eos: tokenizer.eos().map(i64::from),
            sentinels: ids(tokenizer.additional_special_tokens_ids()),
            continuation,
            token_lookup: ids(lookup),
        })
    }

    /// Megatron's `SentencePieceTokenizer` (the only SentencePiece flavor with the special
    /// tokens): its `inv_vocab` lists the model's pieces, then the added tokens, so the
    /// lookup is every id in order.
    pub fn from_sentencepiece(tokenizer: &SentencePiece) -> Result<MaskedLmVocab> {
        let Some(specials) = tokenizer.megatron_specials() else {
            bail!(
                "masked-LM data needs SentencePieceTokenizer's special tokens (<CLS>, <SEP>, \
                 <MASK>); GPTSentencePieceTokenizer and Llama2Tokenizer have none"
            );
        };
        let size = crate::tokenizer::Tokenizer::vocab_size(tokenizer) as u32;
        Ok(MaskedLmVocab {
            cls: specials.cls.into(),
            sep: specials.sep.into(),
            mask: specials.mask.into(),
            pad: specials.pad.into(),
            bos: Some(specials.bos.into()),
            eos: Some(specials.eos.into()),
            sentinels: ids(&specials.extra_ids),
            continuation: (0..size)
                .map(|i| tokenizer.id_piece(i).is_some_and(|p| p.starts_with("##")))
                .collect(),
            token_lookup: (0..i64::from(size)).collect(),
        })
    }

    /// A vocabulary from explicit parts (tests and synthetic data): `tokens[i]` is id `i`.
    pub fn from_tokens(tokens: &[&str], sentinels: usize) -> Result<MaskedLmVocab> {
        let text: String = tokens.iter().map(|t| format!("{t}\n")).collect();
        let tokenizer = BertWordPiece::from_vocab_text(&text, true, false)
            .map_err(anyhow::Error::msg)?
            .with_extra_ids(sentinels);
        MaskedLmVocab::from_bert(&tokenizer)
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
