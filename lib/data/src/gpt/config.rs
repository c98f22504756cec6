//! GPT dataset settings (Megatron's `GPTDatasetConfig`) and the tokenizer identity that enters
//! cache descriptions.

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::cache::PyJson;

use super::split::SplitMatrix;

/// How tokens become training inputs (§4.11); none of this enters the cache hash.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    pub eod_token: i64,
    /// `-1` unless the tokenizer has a distinct pad id.
    pub pad_token: i64,
    pub reset_position_ids: bool,
    pub reset_attention_mask: bool,
    pub eod_mask_loss: bool,
    pub create_attention_mask: bool,
}

#[derive(Debug, Clone)]
pub struct GptDatasetConfig {
    pub random_seed: u32,
    pub sequence_length: usize,
    /// The raw `--split` string (it is hashed verbatim, spaces included); `None` for per-split
    /// blends.
    pub split: Option<String>,
    pub split_matrix: Option<SplitMatrix>,
    /// `--data-cache-path`; without it indices are cached beside each dataset prefix.
    pub path_to_cache: Option<PathBuf>,
    pub tokenizer: TokenizerIdentity,
    pub add_extra_token_to_sequence: bool,
    pub drop_last_partial_validation_sequence: bool,
    pub mid_level_dataset_surplus: f64,
    pub sample: SampleOptions,
}

impl GptDatasetConfig {
    pub fn extra_tokens(&self) -> usize {
        usize::from(self.add_extra_token_to_sequence)
    }
}

/// The tokenizer's entry in cache descriptions (§3.4). Megatron embeds the tokenizer class and
/// file paths, so the same data with another tokenizer generation hashes differently.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizerIdentity(pub PyJson);

/// Which Megatron tokenizer generation to mirror in cache descriptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerGeneration {
    /// `megatron/core/tokenizers` (2025-09 onward, the only one since 2026-02).
    Current,
    /// `megatron/training/tokenizer` (`--legacy-tokenizer`, releases up to core_v0.14).
    Legacy,
}

impl TokenizerIdentity {
    /// Identity of `--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M`, with the
    /// paths exactly as given on the command line.
    pub fn gpt2_bpe(vocab_file: &str, merge_file: &str, generation: TokenizerGeneration) -> Self {
        let map = match generation {
            TokenizerGeneration::Legacy => vec![
                ("class", PyJson::str("_GPT2BPETokenizer")),
                (
                    "tokenizer_path",
                    PyJson::List(vec![PyJson::str(vocab_file), PyJson::str(merge_file)]),
                ),
            ],
            TokenizerGeneration::Current => vec![
                (
                    "class",
                    PyJson::str(
                        "megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText",
                    ),
                ),
                ("tokenizer_path", PyJson::str("GPT2BPETokenizer")),
                ("additional_special_tokens", PyJson::str("[]")),
                ("vocab_file", PyJson::str(vocab_file)),
                ("merges_file", PyJson::str(merge_file)),
                ("use_fast", PyJson::str("True")),
                ("trust_remote_code", PyJson::str("False")),
                ("include_special_tokens", PyJson::str("True")),
                ("use_gigatoken", PyJson::str("False")),
            ],
        };
        TokenizerIdentity(PyJson::Map(
            map.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        ))
    }

    /// Identity of Megatron's legacy `_BertWordPieceTokenizer` (`BertWordPieceLowerCase` /
    /// `BertWordPieceCase`, `--vocab-extra-ids N`). The BERT/T5 datasets of Megatron's releases
    /// (core_v0.14) use this class whatever the tokenizer generation, so it is the one
    /// identity for WordPiece data.
    pub fn bert_wordpiece(vocab_file: &str, lower_case: bool, vocab_extra_ids: usize) -> Self {
        let python_bool = if lower_case { "True" } else { "False" };
        TokenizerIdentity(PyJson::Map(vec![
            ("class".into(), PyJson::str("_BertWordPieceTokenizer")),
            (
                "tokenizer_path".into(),
                PyJson::List(vec![PyJson::str(vocab_file)]),
            ),
            ("lower_case".into(), PyJson::str(python_bool)),
            (
                "vocab_extra_ids".into(),
                PyJson::str(vocab_extra_ids.to_string()),
            ),
        ]))
    }

    /// Identity from training-style flags. Only the tokenizer types whose Megatron identity is
    /// known byte for byte are accepted, so that a cache name never silently differs.
    pub fn from_flags(
        tokenizer_type: &str,
        vocab_file: Option<&str>,
        merge_file: Option<&str>,
        generation: TokenizerGeneration,
    ) -> Result<Self> {
        match tokenizer_type {
            "GPT2BPETokenizer" => {
                let (Some(vocab), Some(merges)) = (vocab_file, merge_file) else {
                    bail!("--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file");
                };
                Ok(TokenizerIdentity::gpt2_bpe(vocab, merges, generation))
            }
            "BertWordPieceLowerCase" | "BertWordPieceCase" => {
                let Some(vocab) = vocab_file else {
                    bail!("--tokenizer-type {tokenizer_type} needs --vocab-file");
                };
                Ok(TokenizerIdentity::bert_wordpiece(
                    vocab,
                    tokenizer_type == "BertWordPieceLowerCase",
                    0,
                ))
            }
            other => bail!(
                "cache descriptions for --tokenizer-type {other} are not supported; \
                 supported: GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_gpt2_identity_is_class_and_paths() {
        let identity = TokenizerIdentity::gpt2_bpe("v.json", "m.txt", TokenizerGeneration::Legacy);
        assert_eq!(
            identity.0.dumps(),
            "{\n    \"class\": \"_GPT2BPETokenizer\",\n    \"tokenizer_path\": [\n        \
             \"v.json\",\n        \"m.txt\"\n    ]\n}"
        );
        assert!(TokenizerIdentity::from_flags(
            "GPT2BPETokenizer",
            Some("v"),
            None,
            TokenizerGeneration::Legacy
        )
        .is_err());
    }
}
