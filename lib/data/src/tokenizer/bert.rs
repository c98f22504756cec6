use std::collections::HashMap;
use std::path::Path;

use unicode_general_category::{get_general_category, GeneralCategory as Gc};
use unicode_normalization::UnicodeNormalization;

use super::{Tokenizer, TokenizerError};

/// Words longer than this many characters become `[UNK]`, as in BERT's WordPiece.
const MAX_WORD_CHARS: usize = 200;

/// Megatron's legacy `BertWordPieceLowerCase` / `BertWordPieceCase`: BERT's basic tokenizer
/// (cleanup, CJK spacing, optional lower-casing with accent stripping, punctuation split)
/// followed by greedy longest-match WordPiece.
///
/// Like Megatron it adds `[BOS]` and `[EOS]` to the vocabulary when absent; `[EOS]` is the
/// end-of-document id. With `wrap_cls_sep` every encoded text is surrounded by `[CLS]` and
/// `[SEP]` and `[SEP]` is the end-of-document id, which is what Megatron's 2026 HuggingFace
/// based BERT tokenizers produce.
pub struct BertWordPiece {
    vocab: HashMap<String, u32>,
    /// The token of each id, for decoding.
    tokens: Vec<Option<String>>,
    lower_case: bool,
    unk: u32,
    cls: u32,
    sep: u32,
    eod: u32,
    vocab_size: usize,
    wrap_cls_sep: bool,
    /// Ids in the iteration order of Megatron's `inv_vocab` (first occurrence of each token,
    /// then the added tokens): the BERT dataset draws random replacement tokens from it.
    lookup_order: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    /// `<extra_id_0>`.. from `--vocab-extra-ids`, in id order (T5's sentinels).
    extra_ids: Vec<u32>,
}

impl BertWordPiece {
    pub fn from_file(
        path: &Path,
        lower_case: bool,
        wrap_cls_sep: bool,
    ) -> Result<Self, TokenizerError> {
        let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::File {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Self::from_vocab_text(&text, lower_case, wrap_cls_sep).map_err(|reason| {
            TokenizerError::File {
                path: path.into(),
                reason,
            }
        })
    }

    /// `text` holds one token per line; a token's id is its line number.
    pub fn from_vocab_text(
        text: &str,
        lower_case: bool,
        wrap_cls_sep: bool,
    ) -> Result<Self, String> {
        let mut vocab = HashMap::new();
        let mut first_seen = Vec::new();
        for (index, line) in text.lines().enumerate() {
            let token = line.trim();
            if vocab.insert(token.to_string(), index as u32).is_none() {
                first_seen.push(token);
            }
        }
        let mut lookup_order: Vec<u32> = first_seen.iter().map(|t| vocab[*t]).collect();
        let id = |vocab: &HashMap<String, u32>, t: &str| {
            vocab
                .get(t)
                .copied()
                .ok_or_else(|| format!("the vocabulary has no {t} token"))
        };
        let (unk, cls, sep) = (
            id(&vocab, "[UNK]")?,
            id(&vocab, "[CLS]")?,
            id(&vocab, "[SEP]")?,
        );
        id(&vocab, "[PAD]")?;
        id(&vocab, "[MASK]")?;
        let (eod, bos, eos) = if wrap_cls_sep {
            (sep, None, None)
        } else {
            for added in ["[BOS]", "[EOS]"] {
                add_token(&mut vocab, &mut lookup_order, added);
            }
            let (bos, eos) = (id(&vocab, "[BOS]")?, id(&vocab, "[EOS]")?);
            (eos, Some(bos), Some(eos))
        };
        Ok(BertWordPiece {
            vocab_size: vocab.len(),
            tokens: invert(&vocab),
            vocab,
            lower_case,
            unk,
            cls,
            sep,
            eod,
            wrap_cls_sep,
            lookup_order,
            bos,
            eos,
            extra_ids: Vec::new(),
        })
    }

    /// Megatron's `--vocab-extra-ids N`: appends `<extra_id_0>`..`<extra_id_{N-1}>` (each
    /// only if absent) after the other added tokens; T5 uses them as sentinels in this order.
    pub fn with_extra_ids(mut self, count: usize) -> Self {
        for i in 0..count {
            let token = format!("<extra_id_{i}>");
            let id = add_token(&mut self.vocab, &mut self.lookup_order, &token);
            self.extra_ids.push(id);
        }
        self.vocab_size = self.vocab.len();
        self.tokens = invert(&self.vocab);
        self
    }

    /// The id of a vocabulary entry.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.vocab.get(token).copied()
    }

    /// The vocabulary entry of an id (`None` for ids no entry maps to).
    pub fn id_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).and_then(Option::as_deref)
    }

    pub fn cls(&self) -> u32 {
        self.cls
    }

    pub fn sep(&self) -> u32 {
        self.sep
    }

    /// `[BOS]`, added by the legacy tokenizer (absent in `[CLS]`/`[SEP]`-wrapping mode).
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// `[EOS]`, added by the legacy tokenizer (absent in `[CLS]`/`[SEP]`-wrapping mode).
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Megatron's `additional_special_tokens_ids`: the `--vocab-extra-ids` tokens in order.
    pub fn additional_special_tokens_ids(&self) -> &[u32] {
        &self.extra_ids
    }

    /// Ids in the order Megatron's `inv_vocab` lists them.
    pub fn lookup_order(&self) -> &[u32] {
        &self.lookup_order
    }

    /// BERT's basic tokenizer: the words WordPiece then splits.
    fn words(&self, text: &str) -> Vec<String> {
        let mut spaced = String::with_capacity(text.len() + 16);
        for c in text.chars() {
            let cp = c as u32;
            if cp == 0 || cp == 0xfffd || is_control(c) {
                continue;
            }
            if is_whitespace(c) {
                spaced.push(' ');
            } else if is_cjk(cp) {
                spaced.push(' ');
                spaced.push(c);
                spaced.push(' ');
            } else {
                spaced.push(c);
            }
        }
        let mut words = Vec::new();
        for token in spaced.split_whitespace() {
            let token = if self.lower_case {
                token
                    .to_lowercase()
                    .nfd()
                    .filter(|&c| get_general_category(c) != Gc::NonspacingMark)
                    .collect()
            } else {
                token.to_string()
            };
            let mut current = String::new();
            for c in token.chars() {
                if is_punctuation(c) {
                    if !current.is_empty() {
                        words.push(std::mem::take(&mut current));
                    }
                    words.push(c.to_string());
                } else {
                    current.push(c);
                }
            }
            if !current.is_empty() {
                words.push(current);
            }
        }
        // Python re-splits the re-joined words on whitespace; lower-casing can create some.
        words
            .iter()
            .flat_map(|w| w.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .collect()
    }

    fn wordpiece(&self, word: &str, out: &mut Vec<u32>) {
        let chars: Vec<(usize, char)> = word.char_indices().collect();
        if chars.len() > MAX_WORD_CHARS {
            out.push(self.unk);
            return;
        }
        let mark = out.len();
        let mut start = 0;
        let mut candidate = String::new();
        while start < chars.len() {
            let mut end = chars.len();
            let mut found = None;
            while start < end {
                candidate.clear();
                if start > 0 {
                    candidate.push_str("##");
                }
                let byte_end = chars.get(end).map_or(word.len(), |&(b, _)| b);
                candidate.push_str(&word[chars[start].0..byte_end]);
                if let Some(&id) = self.vocab.get(candidate.as_str()) {
                    found = Some(id);
                    break;
                }
                end -= 1;
            }
            match found {
                Some(id) => out.push(id),
                None => {
                    out.truncate(mark);
                    out.push(self.unk);
                    return;
                }
            }
            start = end;
        }
    }
}

/// BERT's whitespace: space, tab, newline, carriage return and category Zs.
fn is_whitespace(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\r') || get_general_category(c) == Gc::SpaceSeparator
}

/// BERT's control characters: categories Cc and Cf, except tab, newline and carriage return.
fn is_control(c: char) -> bool {
    if matches!(c, '\t' | '\n' | '\r') {
        return false;
    }
    matches!(get_general_category(c), Gc::Control | Gc::Format)
}

/// BERT's punctuation: all non-alphanumeric ASCII symbols plus every Unicode P* category.
fn is_punctuation(c: char) -> bool {
    let cp = c as u32;
    if (33..=47).contains(&cp)
        || (58..=64).contains(&cp)
        || (91..=96).contains(&cp)
        || (123..=126).contains(&cp)
    {
        return true;
    }
    matches!(
        get_general_category(c),
        Gc::ConnectorPunctuation
            | Gc::DashPunctuation
            | Gc::OpenPunctuation
            | Gc::ClosePunctuation
            | Gc::InitialPunctuation
            | Gc::FinalPunctuation
            | Gc::OtherPunctuation
    )
}

/// The CJK Unified Ideograph blocks BERT surrounds with spaces.
fn is_cjk(cp: u32) -> bool {
    matches!(cp,
        0x4E00..=0x9FFF
        | 0x3400..=0x4DBF
        | 0x20000..=0x2A6DF
        | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F
        | 0x2B820..=0x2CEAF
        | 0xF900..=0xFAFF
        | 0x2F800..=0x2FA1F)
}

impl Tokenizer for BertWordPiece {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if self.wrap_cls_sep {
            out.push(self.cls);
        }
        for word in self.words(text) {
            self.wordpiece(&word, out);
        }
        if self.wrap_cls_sep {
            out.push(self.sep);
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }

    /// Megatron's `decode`: tokens joined by spaces, `##` continuations glued on.
    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let tokens = ids
            .iter()
            .map(|&id| {
                self.tokens
                    .get(id as usize)
                    .and_then(Option::as_deref)
                    .ok_or_else(|| super::unknown_id(id, self.vocab_size))
            })
            .collect::<Result<Vec<&str>, _>>()?;
        Ok(tokens.join(" ").replace(" ##", "").trim().to_string())
    }
}

/// Megatron's `add_token`: a new token gets id `len(vocab)`; an existing one keeps its id.
fn add_token(vocab: &mut HashMap<String, u32>, order: &mut Vec<u32>, token: &str) -> u32 {
    if let Some(&id) = vocab.get(token) {
        return id;
    }
    let id = vocab.len() as u32;
    vocab.insert(token.to_string(), id);
    // With repeated vocabulary lines the new id can be taken already; Python's `inv_vocab`
    // then overwrites that key in place.
    if !order.contains(&id) {
        order.push(id);
    }
    id
}

/// The token of each id of `vocab` (ids without a token stay `None`).
pub(super) fn invert(vocab: &HashMap<String, u32>) -> Vec<Option<String>> {
    let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let mut tokens = vec![None; size];
    for (token, &id) in vocab {
        tokens[id as usize] = Some(token.clone());
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: &str =
        "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nun\n##aff\n##able\nhello\n,\nhe\n##llo\ncafe\n";

    #[test]
    fn wordpiece_is_greedy_longest_match() {
        let t = BertWordPiece::from_vocab_text(VOCAB, true, false).unwrap();
        assert_eq!(t.tokenize("UNAFFABLE, hello").unwrap(), [5, 6, 7, 9, 8]);
        assert_eq!(t.tokenize("Café unknown").unwrap(), [12, 1]);
        assert_eq!(t.vocab_size(), 15);
        assert_eq!(t.eod(), Some(14));
        assert_eq!(t.detokenize(&[5, 6, 7, 9, 8]).unwrap(), "unaffable , hello");
        assert!(t.detokenize(&[15]).is_err());
    }

    #[test]
    fn extra_ids_follow_bos_and_eos_in_order() {
        let t = BertWordPiece::from_vocab_text(VOCAB, true, false)
            .unwrap()
            .with_extra_ids(3);
        assert_eq!((t.bos(), t.eos()), (Some(13), Some(14)));
        assert_eq!(t.additional_special_tokens_ids(), [15, 16, 17]);
        assert_eq!(t.vocab_size(), 18);
        assert_eq!(t.token_id("<extra_id_2>"), Some(17));
        assert_eq!(t.lookup_order(), (0..18).collect::<Vec<u32>>());
        assert_eq!(t.detokenize(&[5, 15]).unwrap(), "un <extra_id_0>");
    }

    #[test]
    fn repeated_vocabulary_lines_keep_the_first_position_with_the_last_id() {
        let t = BertWordPiece::from_vocab_text(
            "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n[UNK]\nx\n",
            true,
            false,
        )
        .unwrap();
        assert_eq!(t.lookup_order(), [0, 5, 2, 3, 4, 6, 7]);
    }

    #[test]
    fn cased_keeps_accents_and_wrapping_adds_cls_sep() {
        let t = BertWordPiece::from_vocab_text(VOCAB, false, true).unwrap();
        assert_eq!(t.tokenize("Café hello").unwrap(), [2, 1, 8, 3]);
        assert_eq!(t.eod(), Some(3));
        assert_eq!(t.vocab_size(), 13);
    }
}
