use super::{Tokenizer, TokenizerError};

/// Megatron's legacy `NullTokenizer`: the text already is space-separated token ids.
/// `--vocab-size N` gives ids `0..N`, end-of-document `N` and a reported size of `N + 1`.
pub struct NullTokenizer {
    vocab_size: u32,
}

impl NullTokenizer {
    pub fn new(vocab_size: u32) -> Self {
        NullTokenizer { vocab_size }
    }
}

impl Tokenizer for NullTokenizer {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for field in text.split(' ').filter(|f| !f.trim().is_empty()) {
            let id: u32 = field.trim().parse().map_err(|_| {
                TokenizerError::Encode(format!(
                    "NullTokenizer expects space-separated non-negative ids, found {field:?}"
                ))
            })?;
            if id > self.vocab_size {
                return Err(TokenizerError::Encode(format!(
                    "token id {id} exceeds --vocab-size {}",
                    self.vocab_size
                )));
            }
            out.push(id);
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size as usize + 1
    }

    fn eod(&self) -> Option<u32> {
        Some(self.vocab_size)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if let Some(&id) = ids.iter().find(|&&id| id > self.vocab_size) {
            return Err(super::unknown_id(id, self.vocab_size()));
        }
        Ok(ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ids_and_rejects_words() {
        let t = NullTokenizer::new(100);
        assert_eq!(t.tokenize("1 2  30").unwrap(), [1, 2, 30]);
        assert!(t.tokenize("").unwrap().is_empty());
        assert!(t.tokenize("1 two").is_err());
        assert!(t.tokenize("101").is_err());
        assert_eq!((t.vocab_size(), t.eod()), (101, Some(100)));
        assert_eq!(t.detokenize(&[1, 2, 100]).unwrap(), "1 2 100");
        assert!(t.detokenize(&[101]).is_err());
    }
}
