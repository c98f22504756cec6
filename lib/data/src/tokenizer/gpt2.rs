use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::path::Path;
use std::sync::Mutex;

use regex::Regex;

use super::bpe_merge::{self, MergeOrder};
use super::{Tokenizer, TokenizerError};

/// GPT-2's pre-tokenization pattern without its `\s+(?!\S)` look-ahead branch, which the
/// `regex` crate cannot express; `Gpt2Bpe::pieces` restores that branch's effect.
const PRETOKENIZE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";
const CACHE_SHARDS: usize = 64;
const CACHE_SHARD_LIMIT: usize = 1 << 14;

/// Megatron's legacy `GPT2BPETokenizer`: byte-level BPE from `vocab.json` + `merges.txt`.
pub struct Gpt2Bpe {
    pattern: Regex,
    /// Internal symbol id of each byte's printable stand-in character.
    byte_symbol: [u32; 256],
    /// (left, right) symbol pair -> (merge rank, merged symbol).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Vocabulary id of each internal symbol (0 when the vocabulary lacks it, as Megatron does).
    symbol_token: Vec<u32>,
    vocab_size: usize,
    eod: u32,
    /// The token of each id, for decoding.
    tokens: Vec<Option<String>>,
    /// The byte behind each printable stand-in character of the byte table.
    char_byte: HashMap<char, u8>,
    cache: Vec<Mutex<HashMap<String, Vec<u32>>>>,
}

/// GPT-2's reversible map from bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u32 {
        let printable =
            (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap()
        };
    }
    table
}

struct Interner {
    ids: HashMap<String, u32>,
    names: Vec<String>,
}

impl Interner {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.ids.get(s) {
            return id;
        }
        let id = self.names.len() as u32;
        self.ids.insert(s.to_string(), id);
        self.names.push(s.to_string());
        id
    }
}

impl Gpt2Bpe {
    pub fn from_files(vocab_file: &Path, merge_file: &Path) -> Result<Self, TokenizerError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|e| TokenizerError::File {
                path: p.into(),
                reason: e.to_string(),
            })
        };
        let vocab: HashMap<String, u32> =
            serde_json::from_str(&read(vocab_file)?).map_err(|e| TokenizerError::File {
                path: vocab_file.into(),
                reason: format!("not a JSON object of token -> id: {e}"),
            })?;
        Self::new(vocab, &read(merge_file)?).map_err(|reason| TokenizerError::File {
            path: vocab_file.into(),
            reason,
        })
    }

    /// `merges` is the merges file's text. Like Megatron, the first line (the version header)
    /// and the last line (expected to be empty, after the final newline) are skipped.
    pub fn new(vocab: HashMap<String, u32>, merges: &str) -> Result<Self, String> {
        let eod = *vocab
            .get("<|endoftext|>")
            .ok_or("the vocabulary has no <|endoftext|> token")?;
        let mut interner = Interner {
            ids: HashMap::new(),
            names: Vec::new(),
        };
        let byte_chars = bytes_to_unicode();
        let mut byte_symbol = [0u32; 256];
        for (b, c) in byte_chars.iter().enumerate() {
            byte_symbol[b] = interner.id(&c.to_string());
        }
        let lines: Vec<&str> = merges.split('\n').collect();
        let body = if lines.len() >= 2 {
            &lines[1..lines.len() - 1]
        } else {
            &[][..]
        };
        let mut merge_map = HashMap::new();
        for (rank, line) in body.iter().enumerate() {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if let [left, right] = parts[..] {
                let pair = (interner.id(left), interner.id(right));
                let merged = interner.id(&format!("{left}{right}"));
                merge_map.insert(pair, (rank as u32, merged));
            }
        }
        let symbol_token = interner
            .names
            .iter()
            .map(|s| vocab.get(s).copied().unwrap_or(0))
            .collect();
        Ok(Gpt2Bpe {
            pattern: Regex::new(PRETOKENIZE).expect("valid pattern"),
            byte_symbol,
            merges: merge_map,
            symbol_token,
            vocab_size: vocab.len(),
            eod,
            tokens: super::bert::invert(&vocab),
            char_byte: byte_chars
                .iter()
                .enumerate()
                .map(|(b, &c)| (c, b as u8))
                .collect(),
            cache: (0..CACHE_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
        })
    }

    /// Splits text exactly like GPT-2's pattern, including `\s+(?!\S)`: a whitespace run
    /// followed by text gives up its last character, which then starts the next piece.
    fn pieces<'t>(&self, text: &'t str, mut emit: impl FnMut(&'t str)) {
        let mut pos = 0;
        while let Some(m) = self.pattern.find_at(text, pos) {
            let piece = m.as_str();
            let is_space_run = piece.chars().next().is_some_and(char::is_whitespace)
                && m.end() < text.len()
                && !piece.chars().any(|c| !c.is_whitespace());
            if is_space_run && piece.chars().count() > 1 {
                let last = piece.char_indices().last().unwrap().0;
                emit(&piece[..last]);
                pos = m.start() + last;
            } else {
                emit(piece);
                pos = m.end();
            }
        }
    }

    fn bpe(&self, piece: &str, out: &mut Vec<u32>) {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        piece.hash(&mut hasher);
        let shard = &self.cache[hasher.finish() as usize % CACHE_SHARDS];
        if let Some(ids) = shard.lock().unwrap().get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let mut word: Vec<u32> = piece
            .bytes()
            .map(|b| self.byte_symbol[b as usize])
            .collect();
        bpe_merge::merge(&mut word, MergeOrder::EveryOccurrence, |left, right| {
            self.merges.get(&(left, right)).copied()
        });
        let ids: Vec<u32> = word
            .iter()
            .map(|&s| self.symbol_token[s as usize])
            .collect();
        out.extend_from_slice(&ids);
        let mut shard = shard.lock().unwrap();
        if shard.len() >= CACHE_SHARD_LIMIT {
            shard.clear();
        }
        shard.insert(piece.to_string(), ids);
    }
}

impl Tokenizer for Gpt2Bpe {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        self.pieces(text, |piece| self.bpe(piece, out));
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn eod(&self) -> Option<u32> {
        Some(self.eod)
    }

    /// GPT-2 begins sequences with the same `<|endoftext|>`.
    fn bos(&self) -> Option<u32> {
        Some(self.eod)
    }

    /// Megatron's `decode`: the tokens' characters mapped back to bytes, decoded as UTF-8
    /// with replacement characters.
    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let token = self
                .tokens
                .get(id as usize)
                .and_then(Option::as_deref)
                .ok_or_else(|| super::unknown_id(id, self.vocab_size))?;
            for c in token.chars() {
                match self.char_byte.get(&c) {
                    Some(&b) => bytes.push(b),
                    // Tokens outside the byte alphabet (added specials) decode as their UTF-8.
                    None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<String> {
        let vocab = HashMap::from([("<|endoftext|>".to_string(), 0)]);
        let t = Gpt2Bpe::new(vocab, "#version\n\n").unwrap();
        let mut v = Vec::new();
        t.pieces(text, |p| v.push(p.to_string()));
        v
    }

    #[test]
    fn pretokenizer_reproduces_the_lookahead_branch() {
        assert_eq!(pieces("Hello   world"), ["Hello", "  ", " world"]);
        assert_eq!(pieces("a\n\nb"), ["a", "\n", "\n", "b"]);
        assert_eq!(pieces("a \nb"), ["a", " ", "\n", "b"]);
        assert_eq!(pieces("end  "), ["end", "  "]);
        assert_eq!(pieces("it's 42!"), ["it", "'s", " 42", "!"]);
        assert_eq!(pieces("x  's"), ["x", " ", " '", "s"]);
    }

    #[test]
    fn byte_table_is_a_bijection_onto_printables() {
        let t = bytes_to_unicode();
        assert_eq!(t[b'!' as usize], '!');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}

#[cfg(test)]
mod vocabulary_tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;

    fn gpt2() -> &'static Gpt2Bpe {
        static TOKENIZER: OnceLock<Gpt2Bpe> = OnceLock::new();
        TOKENIZER.get_or_init(|| {
            let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
            Gpt2Bpe::from_files(
                &shared.join("gpt2-vocab.json"),
                &shared.join("gpt2-merges.txt"),
            )
            .unwrap()
        })
    }

    /// The ids of `text` with each pre-token merged by GPT-2's rescanning loop.
    fn reference_ids(t: &Gpt2Bpe, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        t.pieces(text, |piece| {
            let symbols = piece.bytes().map(|b| t.byte_symbol[b as usize]).collect();
            let merged = super::bpe_merge::tests::every_occurrence_reference(symbols, |l, r| {
                t.merges.get(&(l, r)).copied()
            });
            ids.extend(merged.iter().map(|&s| t.symbol_token[s as usize]));
        });
        ids
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn heap_merge_gives_the_reference_ids(text in "[aeinrst th.'é1]{0,80}|[aeilnorst]{0,400}") {
            let t = gpt2();
            prop_assert_eq!(t.tokenize(&text).unwrap(), reference_ids(t, &text));
        }
    }

    #[test]
    fn a_megabyte_word_without_whitespace_is_tokenized() {
        // The rescanning merge took about two minutes on this; the heap merge a fraction of a
        // second (the pair-lookup count is bounded in bpe_merge's tests).
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let word: String = (0..1 << 20)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                b"etaoinshrdlu"[(state % 12) as usize] as char
            })
            .collect();
        let t = gpt2();
        let ids = t.tokenize(&word).unwrap();
        assert!(ids.len() < word.len() / 2, "{} ids", ids.len());
        assert_eq!(t.detokenize(&ids).unwrap(), word);
    }

    #[test]
    fn megatron_reference_ids() {
        let t = gpt2();
        // The ids Megatron's tokenizer unit test expects for this text.
        assert_eq!(
            t.tokenize("hi how are you?").unwrap(),
            [5303, 703, 389, 345, 30]
        );
        assert_eq!((t.vocab_size(), t.eod()), (50257, Some(50256)));
        // <|endoftext|> inside text is ordinary text for the classic tokenizer.
        assert_ne!(t.tokenize("<|endoftext|>").unwrap(), [50256]);
        let text = "Héllo  wörld,\n\tit's 42 — ok 😀";
        assert_eq!(t.detokenize(&t.tokenize(text).unwrap()).unwrap(), text);
        assert_eq!(t.detokenize(&[50256]).unwrap(), "<|endoftext|>");
        // Half of a multi-byte character decodes to the replacement character.
        let smile = t.tokenize("😀").unwrap();
        assert!(smile.len() > 1);
        assert_eq!(t.detokenize(&smile[..1]).unwrap(), "\u{fffd}");
    }
}
