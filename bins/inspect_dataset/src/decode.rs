//! Id → text for `dump --vocab-file`: GPT-2 byte-level vocabularies (`.json`) and WordPiece
//! vocabularies (one token per line).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};

pub enum Vocabulary {
    /// Token strings in GPT-2's byte-to-unicode alphabet.
    ByteLevel(HashMap<i64, String>),
    /// WordPiece tokens; `##` marks a continuation.
    WordPiece(Vec<String>),
}

impl Vocabulary {
    pub fn load(path: &Path) -> Result<Vocabulary> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading vocabulary {}", path.display()))?;
        if path.extension().is_some_and(|e| e == "json") {
            let map: HashMap<String, i64> = serde_json::from_str(&text).with_context(|| {
                format!("{}: expected a JSON object of token → id", path.display())
            })?;
            Ok(Vocabulary::ByteLevel(
                map.into_iter().map(|(t, id)| (id, t)).collect(),
            ))
        } else {
            Ok(Vocabulary::WordPiece(
                text.lines().map(|l| l.trim().to_string()).collect(),
            ))
        }
    }

    /// Decoded text; ids outside the vocabulary show as `<unk:ID>`.
    pub fn decode(&self, ids: &[i64]) -> String {
        match self {
            Vocabulary::ByteLevel(tokens) => {
                let unicode_to_byte = byte_decoder();
                let mut bytes = Vec::new();
                for id in ids {
                    match tokens.get(id) {
                        Some(token) => bytes.extend(
                            token
                                .chars()
                                .map(|c| unicode_to_byte.get(&c).copied().unwrap_or(b'?')),
                        ),
                        None => bytes.extend(format!("<unk:{id}>").bytes()),
                    }
                }
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Vocabulary::WordPiece(tokens) => {
                let mut text = String::new();
                for id in ids {
                    let token = usize::try_from(*id)
                        .ok()
                        .and_then(|i| tokens.get(i))
                        .cloned()
                        .unwrap_or_else(|| format!("<unk:{id}>"));
                    match token.strip_prefix("##") {
                        Some(rest) => text.push_str(rest),
                        None => {
                            if !text.is_empty() {
                                text.push(' ');
                            }
                            text.push_str(&token);
                        }
                    }
                }
                text
            }
        }
    }
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable Latin-1 bytes map to themselves, the rest
/// to code points from 256 upwards in byte order.
fn byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("valid code point");
                next += 1;
                c
            };
            (c, b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_space_and_newline_decode() {
        let decoder = byte_decoder();
        assert_eq!(decoder[&'Ġ'], b' ');
        assert_eq!(decoder[&'Ċ'], b'\n');
        assert_eq!(decoder[&'a'], b'a');
        assert_eq!(decoder.len(), 256);
    }
}
