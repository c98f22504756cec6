//! Megatron's `build_tokens_types_paddings_from_ids`: `[CLS] A [SEP] (B [SEP])`, capped and padded.

use anyhow::{Context, Result};

use crate::tokenizer::BertWordPiece;

/// The special ids a pair input needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PairSpecials {
    pub cls: i64,
    pub sep: i64,
    pub pad: i64,
}

impl PairSpecials {
    pub fn from_bert(tokenizer: &BertWordPiece) -> Result<PairSpecials> {
        Ok(PairSpecials {
            cls: i64::from(tokenizer.cls()),
            sep: i64::from(tokenizer.sep()),
            pad: i64::from(
                tokenizer
                    .token_id("[PAD]")
                    .context("the vocabulary has no [PAD] token")?,
            ),
        })
    }
}

/// One BERT input of `max_seq_length` positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairInput {
    pub text: Vec<i64>,
    /// 0 for `[CLS] A [SEP]`, 1 for `B [SEP]`, the pad id on padding.
    pub types: Vec<i64>,
    /// 1 on real positions, 0 on padding.
    pub padding_mask: Vec<i64>,
}

impl PairInput {
    /// Megatron's rule: `[CLS] A [SEP]` then B; if that reaches `max_seq_length` it is cut to
    /// `max_seq_length − 1`; a final `[SEP]` follows when there is a B or a cut; then padding.
    pub fn build(
        a: &[i64],
        b: Option<&[i64]>,
        max_seq_length: usize,
        specials: PairSpecials,
    ) -> PairInput {
        let mut text = Vec::with_capacity(max_seq_length);
        text.push(specials.cls);
        text.extend_from_slice(a);
        text.push(specials.sep);
        let mut types = vec![0; text.len()];
        if let Some(b) = b {
            text.extend_from_slice(b);
            types.resize(text.len(), 1);
        }
        let trimmed = text.len() >= max_seq_length;
        if trimmed {
            let keep = max_seq_length.saturating_sub(1);
            text.truncate(keep);
            types.truncate(keep);
        }
        let mut padding_mask = vec![1; text.len()];
        if b.is_some() || trimmed {
            text.push(specials.sep);
            types.push(i64::from(b.is_some()));
            padding_mask.push(1);
        }
        text.resize(max_seq_length.max(text.len()), specials.pad);
        types.resize(text.len(), specials.pad);
        padding_mask.resize(text.len(), 0);
        PairInput {
            text,
            types,
            padding_mask,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: PairSpecials = PairSpecials {
        cls: 101,
        sep: 102,
        pad: 0,
    };

    #[test]
    fn pairs_are_typed_and_padded() {
        let p = PairInput::build(&[1, 2], Some(&[3]), 8, S);
        assert_eq!(p.text, [101, 1, 2, 102, 3, 102, 0, 0]);
        assert_eq!(p.types, [0, 0, 0, 0, 1, 1, 0, 0]);
        assert_eq!(p.padding_mask, [1, 1, 1, 1, 1, 1, 0, 0]);
    }

    #[test]
    fn reaching_the_length_cuts_to_one_less_and_ends_with_sep() {
        // 1 + 3 + 1 + 3 = 8 positions reach 8: cut to 7, then [SEP].
        let p = PairInput::build(&[1, 2, 3], Some(&[4, 5, 6]), 8, S);
        assert_eq!(p.text, [101, 1, 2, 3, 102, 4, 5, 102]);
        assert_eq!(p.types, [0, 0, 0, 0, 0, 1, 1, 1]);
        // A single text that reaches the length gets a [SEP] of type 0.
        let p = PairInput::build(&[1, 2, 3, 4], None, 4, S);
        assert_eq!(p.text, [101, 1, 2, 102]);
        assert_eq!(p.types, [0, 0, 0, 0]);
        // One that does not gets no second [SEP].
        let p = PairInput::build(&[1], None, 4, S);
        assert_eq!(p.text, [101, 1, 102, 0]);
        assert_eq!(p.padding_mask, [1, 1, 1, 0]);
    }
}
