//! Megatron's `TikTokenizer` (`CustomTikTokenizer`): a tiktoken byte-level BPE read from
//! Megatron's JSON vocabulary (an array of `{"rank", "token_bytes", "token_str"}`), with
//! `num_special` special tokens in front (`<unk>`, `<s>`, `</s>`, the given list, then
//! `<SPECIAL_k>` fillers) and the BPE ranks shifted behind them. `tokenize` is tiktoken's
//! `encode_ordinary`: special-token text is encoded as ordinary text.

use std::collections::HashMap;
use std::path::Path;

use fancy_regex::Regex;

use super::bpe_merge::{self, MergeOrder};
use super::{unknown_id, Tokenizer, TokenizerError};

/// Megatron's `PATTERN_TIKTOKEN` (`--tiktoken-pattern v1`).
pub const PATTERN_V1: &str =
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";
/// Megatron's `PATTERN_TIKTOKEN_V2` (`--tiktoken-pattern v2`).
pub const PATTERN_V2: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// The special tokens every TikTokenizer has, at ids 0, 1, 2.
const REQUIRED_SPECIAL: [&str; 3] = ["<unk>", "<s>", "</s>"];

/// `--tiktoken-pattern`, `--tiktoken-num-special-tokens`, `--tiktoken-special-tokens` and the
/// total `--vocab-size`, with Megatron's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TikTokenOptions {
    pub pattern: String,
    pub num_special_tokens: usize,
    pub special_tokens: Option<Vec<String>>,
    pub vocab_size: usize,
}

impl Default for TikTokenOptions {
    fn default() -> Self {
        TikTokenOptions {
            pattern: "v2".into(),
            num_special_tokens: 1000,
            special_tokens: None,
            vocab_size: 1 << 17,
        }
    }
}

pub struct TikToken {
    pattern: Regex,
    /// Token bytes → rank (before the shift by the special tokens).
    ranks: HashMap<Vec<u8>, u32>,
    /// Every id's bytes: specials first, then the ranks.
    pieces: Vec<Vec<u8>>,
    num_special: u32,
    eos: u32,
}

fn bad_file(path: &Path, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::File {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The regular expression `--tiktoken-pattern` names (`v1` or `v2`).
pub fn pattern_regex(name: &str) -> Result<&'static str, TokenizerError> {
    match name {
        "v1" => Ok(PATTERN_V1),
        "v2" => Ok(PATTERN_V2),
        other => Err(TokenizerError::Config(format!(
            "--tiktoken-pattern must be v1 or v2, not {other:?}"
        ))),
    }
}

impl TikToken {
    pub fn from_file(path: &Path, options: &TikTokenOptions) -> Result<Self, TokenizerError> {
        let pattern = pattern_regex(&options.pattern)?;
        let mut specials: Vec<String> = options
            .special_tokens
            .clone()
            .unwrap_or_else(|| REQUIRED_SPECIAL.map(String::from).to_vec());
        let config = |reason: String| Err(TokenizerError::Config(reason));
        if let Some(missing) = REQUIRED_SPECIAL
            .iter()
            .find(|r| !specials.iter().any(|s| s == *r))
        {
            return config(format!("--tiktoken-special-tokens must include {missing}"));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = specials.iter().find(|s| !seen.insert(s.as_str())) {
            return config(format!("special token {twice} is given twice"));
        }
        let num_special = options.num_special_tokens;
        if !(specials.len() <= num_special && num_special < options.vocab_size) {
            return config(format!(
                "TikTokenizer needs {} special tokens <= --tiktoken-num-special-tokens ({num_special}) < --vocab-size ({})",
                specials.len(),
                options.vocab_size
            ));
        }
        specials.extend((specials.len()..num_special).map(|k| format!("<SPECIAL_{k}>")));

        let text = std::fs::read_to_string(path).map_err(|e| bad_file(path, e.to_string()))?;
        let entries: Vec<serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| bad_file(path, format!("not a JSON array of tokens: {e}")))?;
        let inner = options.vocab_size - num_special;
        if inner < 256 {
            // Byte-level BPE falls back to single bytes, so every byte needs a rank.
            return config(format!(
                "--vocab-size {} with {num_special} special tokens leaves {inner} ranks, fewer than the 256 single bytes",
                options.vocab_size
            ));
        }
        if entries.len() < inner {
            return Err(bad_file(
                path,
                format!(
                    "holds {} tokens but --vocab-size {} with {num_special} special tokens needs {inner}",
                    entries.len(),
                    options.vocab_size
                ),
            ));
        }
        let mut ranks = HashMap::with_capacity(inner);
        let mut pieces: Vec<Vec<u8>> = specials.iter().map(|s| s.as_bytes().to_vec()).collect();
        for (i, entry) in entries.iter().take(inner).enumerate() {
            let rank = entry.get("rank").and_then(|r| r.as_u64());
            let encoded = entry.get("token_bytes").and_then(|b| b.as_str());
            let (Some(rank), Some(encoded)) = (rank, encoded) else {
                return Err(bad_file(
                    path,
                    format!("token {i}: needs rank and token_bytes"),
                ));
            };
            if rank != i as u64 {
                return Err(bad_file(path, format!("token {i} has rank {rank}")));
            }
            let bytes = base64::decode(encoded)
                .map_err(|e| bad_file(path, format!("token {i}: token_bytes: {e}")))?;
            if i < 256 && bytes != [i as u8] {
                return Err(bad_file(
                    path,
                    format!("token {i} must be the single byte {i}"),
                ));
            }
            if ranks.insert(bytes.clone(), i as u32).is_some() {
                return Err(bad_file(
                    path,
                    format!("token {i} repeats an earlier token"),
                ));
            }
            pieces.push(bytes);
        }
        Ok(TikToken {
            pattern: Regex::new(pattern).expect("Megatron's patterns compile"),
            ranks,
            pieces,
            num_special: num_special as u32,
            eos: 2,
        })
    }

    /// tiktoken's byte-pair merge of one pre-token: repeatedly join the adjacent pair whose
    /// joined bytes have the lowest rank (the leftmost on ties), then map each part to its rank.
    /// Every single byte has a rank (checked on loading), so every part has one.
    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(&rank) = self.ranks.get(piece) {
            out.push(rank + self.num_special);
            return;
        }
        let mut parts: Vec<(usize, usize)> = (0..piece.len()).map(|i| (i, i + 1)).collect();
        bpe_merge::merge(&mut parts, MergeOrder::OneAtATime, |left, right| {
            let joined = (left.0, right.1);
            self.ranks
                .get(&piece[joined.0..joined.1])
                .map(|&rank| (rank, joined))
        });
        out.extend(
            parts
                .iter()
                .map(|&(start, end)| self.ranks[&piece[start..end]] + self.num_special),
        );
    }
}

impl Tokenizer for TikToken {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for found in self.pattern.find_iter(text) {
            let found = found.map_err(|e| TokenizerError::Encode(e.to_string()))?;
            self.encode_piece(found.as_str().as_bytes(), out);
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    fn eod(&self) -> Option<u32> {
        Some(self.eos)
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            let piece = self
                .pieces
                .get(id as usize)
                .ok_or_else(|| unknown_id(id, self.pieces.len()))?;
            bytes.extend_from_slice(piece);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single bytes, then "ab", "abc", " a".
    fn vocabulary(dir: &Path) -> std::path::PathBuf {
        let b64 = |b: &[u8]| base64::encode(b);
        let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        tokens.extend([b"ab".to_vec(), b"abc".to_vec(), b" a".to_vec()]);
        let json: Vec<serde_json::Value> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({"rank": i, "token_bytes": b64(t), "token_str": String::from_utf8_lossy(t)})
            })
            .collect();
        let path = dir.join("vocab.json");
        std::fs::write(&path, serde_json::to_string(&json).unwrap()).unwrap();
        path
    }

    #[test]
    fn ranks_merge_after_the_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let options = TikTokenOptions {
            num_special_tokens: 5,
            vocab_size: 5 + 259,
            ..Default::default()
        };
        let tok = TikToken::from_file(&vocabulary(dir.path()), &options).unwrap();
        assert_eq!(tok.vocab_size(), 264);
        assert_eq!(tok.eod(), Some(2));
        // "abc" is one token (rank 257); in " abd" "ab" (256) merges before " a" (258) and
        // leaves the space alone; "<s>" is ordinary text.
        let ids = tok.tokenize("abc abd<s>").unwrap();
        let byte = |b: u8| b as u32 + 5;
        assert_eq!(
            ids,
            [
                257 + 5,
                byte(b' '),
                256 + 5,
                byte(b'd'),
                byte(b'<'),
                byte(b's'),
                byte(b'>')
            ]
        );
        assert_eq!(tok.detokenize(&ids).unwrap(), "abc abd<s>");
        assert_eq!(tok.detokenize(&[1, 4]).unwrap(), "<s><SPECIAL_4>");
        let too_big = TikTokenOptions {
            vocab_size: 5 + 300,
            ..options
        };
        let error = TikToken::from_file(&vocabulary(dir.path()), &too_big)
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("vocab.json: holds 259 tokens"), "{error}");
        let bytes_cut = TikTokenOptions {
            vocab_size: 5 + 100,
            ..too_big
        };
        let error = TikToken::from_file(&vocabulary(dir.path()), &bytes_cut)
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("fewer than the 256 single bytes"), "{error}");
    }
}
