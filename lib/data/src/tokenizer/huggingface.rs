use std::path::{Path, PathBuf};

use super::{Tokenizer, TokenizerError};

/// End-of-text tokens tried, in order, when no `tokenizer_config.json` names the EOS token.
const KNOWN_EOS: [&str; 5] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]"];

/// `HuggingFaceTokenizer`: any `tokenizer.json` (or a directory holding one), encoded with
/// the model's automatic special tokens as Megatron's `AutoTokenizer` call does.
pub struct HuggingFace {
    inner: tokenizers::Tokenizer,
    add_special_tokens: bool,
    eod: Option<u32>,
    bos: Option<u32>,
}

impl HuggingFace {
    pub fn from_path(path: &Path, add_special_tokens: bool) -> Result<Self, TokenizerError> {
        let (file, dir) = if path.is_dir() {
            (path.join("tokenizer.json"), Some(path.to_path_buf()))
        } else {
            (path.to_path_buf(), None)
        };
        let inner = tokenizers::Tokenizer::from_file(&file).map_err(|e| TokenizerError::File {
            path: file.clone(),
            reason: format!("cannot load HuggingFace tokenizer: {e}"),
        })?;
        let configured = |key: &str| -> Result<Option<u32>, TokenizerError> {
            let Some(dir) = &dir else {
                return Ok(None);
            };
            match configured_token(dir, key)? {
                Some(name) => Ok(Some(inner.token_to_id(&name).ok_or_else(|| {
                    TokenizerError::File {
                        path: file.clone(),
                        reason: format!(
                            "{key} {name:?} from tokenizer_config.json is not in the vocabulary"
                        ),
                    }
                })?)),
                None => Ok(None),
            }
        };
        let eod = match configured("eos_token")? {
            Some(id) => Some(id),
            None => KNOWN_EOS.iter().find_map(|t| inner.token_to_id(t)),
        };
        let bos = configured("bos_token")?;
        Ok(HuggingFace {
            inner,
            add_special_tokens,
            eod,
            bos,
        })
    }
}

/// The special token `key` (`eos_token`, `bos_token`) of `dir/tokenizer_config.json`, a string
/// or `{"content": ...}`.
fn configured_token(dir: &Path, key: &str) -> Result<Option<String>, TokenizerError> {
    let path: PathBuf = dir.join("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(None);
    };
    let config: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| TokenizerError::File {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    Ok(match config.get(key) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(v) => v
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        None => None,
    })
}

impl Tokenizer for HuggingFace {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, self.add_special_tokens)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn eod(&self) -> Option<u32> {
        self.eod
    }

    fn bos(&self) -> Option<u32> {
        self.bos
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let size = self.vocab_size();
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= size) {
            return Err(super::unknown_id(id, size));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))
    }
}
