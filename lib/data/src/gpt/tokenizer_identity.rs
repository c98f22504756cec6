//! The tokenizer's entry in dataset cache descriptions (spec §3.4). Megatron embeds the
//! tokenizer's class, its paths exactly as given on the command line and its options (each as
//! Python's `str()` of the value), so the same data named by another tokenizer, path spelling or
//! tokenizer generation hashes to other cache files. Both generations are mirrored for every
//! `--tokenizer-type`:
//! - legacy (`--legacy-tokenizer`): `megatron/training/tokenizer` of core_v0.14, where `class`
//!   is the short class name and `tokenizer_path` a list of the positional paths;
//! - current: `megatron/core/tokenizers` (Megatron's main branch, where the GPT dataset goldens
//!   come from), where `class` is the module path, `tokenizer_path` one string, and the options
//!   are the builder's keyword arguments. Options whose flags Megatron added to that generation
//!   only (`--tokenizer-special-tokens`, `--chat-template`, `--trust-remote-code`, ...) are
//!   recorded at their defaults, which is what these tokenizers do here.

use anyhow::{bail, Result};

use crate::cache::{python_str_list_repr, PyJson};
use crate::tokenizer::{pattern_regex, TokenizerArgs, TokenizerType};

/// The tokenizer's entry in cache descriptions: a JSON object in Megatron's key order.
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

/// The class of every tokenizer of the current generation.
const CURRENT_CLASS: &str = "megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText";

/// The current generation's `BertWordPieceCase` always carries these 100 sentinels.
const CASED_BERT_SENTINELS: usize = 100;

fn str_or_none(value: Option<&str>) -> PyJson {
    PyJson::str(value.unwrap_or("None"))
}

fn python_bool(value: bool) -> PyJson {
    PyJson::str(if value { "True" } else { "False" })
}

fn map(entries: Vec<(&str, PyJson)>) -> TokenizerIdentity {
    TokenizerIdentity(PyJson::Map(
        entries
            .into_iter()
            .map(|(key, value)| (key.to_string(), value))
            .collect(),
    ))
}

/// A legacy identity: the short class name, the positional paths, then the options.
fn legacy(class: &str, paths: Vec<PyJson>, options: Vec<(&str, PyJson)>) -> TokenizerIdentity {
    let mut entries = vec![
        ("class", PyJson::str(class)),
        ("tokenizer_path", PyJson::List(paths)),
    ];
    entries.extend(options);
    map(entries)
}

/// A current identity: the one class, the path (or type name), then the builder's options.
fn current(path: PyJson, options: Vec<(&str, PyJson)>) -> TokenizerIdentity {
    let mut entries = vec![
        ("class", PyJson::str(CURRENT_CLASS)),
        ("tokenizer_path", path),
    ];
    entries.extend(options);
    map(entries)
}

/// The HuggingFace options the current generation records after a tokenizer's files (GPT-2 BPE,
/// WordPiece and `HuggingFaceTokenizer`), at their defaults.
fn hf_switches() -> [(&'static str, PyJson); 3] {
    [
        ("use_fast", python_bool(true)),
        ("trust_remote_code", python_bool(false)),
        ("include_special_tokens", python_bool(true)),
    ]
}

impl TokenizerIdentity {
    /// Identity of `--tokenizer-type GPT2BPETokenizer --vocab-file V --merge-file M`, with the
    /// paths exactly as given on the command line.
    pub fn gpt2_bpe(vocab_file: &str, merge_file: &str, generation: TokenizerGeneration) -> Self {
        match generation {
            TokenizerGeneration::Legacy => legacy(
                "_GPT2BPETokenizer",
                vec![PyJson::str(vocab_file), PyJson::str(merge_file)],
                vec![],
            ),
            TokenizerGeneration::Current => Self::current_hf_backed(
                "GPT2BPETokenizer",
                Some(vocab_file),
                Some(merge_file),
                "[]",
            ),
        }
    }

    /// Identity of Megatron's legacy `_BertWordPieceTokenizer` (`BertWordPieceLowerCase` /
    /// `BertWordPieceCase`, `--vocab-extra-ids N`). The BERT/T5 datasets of Megatron's releases
    /// (core_v0.14) use this class whatever the tokenizer generation, so it is the one
    /// identity for WordPiece data there.
    pub fn bert_wordpiece(vocab_file: &str, lower_case: bool, vocab_extra_ids: usize) -> Self {
        legacy(
            "_BertWordPieceTokenizer",
            vec![PyJson::str(vocab_file)],
            vec![
                ("lower_case", python_bool(lower_case)),
                ("vocab_extra_ids", PyJson::str(vocab_extra_ids.to_string())),
            ],
        )
    }

    /// The current generation's GPT-2 BPE, WordPiece and HuggingFace tokenizers: the path (the
    /// type name for the built-in kinds), the files, then the HuggingFace options.
    fn current_hf_backed(
        path: &str,
        vocab_file: Option<&str>,
        merge_file: Option<&str>,
        additional_special_tokens: &str,
    ) -> Self {
        let mut options = vec![
            (
                "additional_special_tokens",
                PyJson::str(additional_special_tokens),
            ),
            ("vocab_file", str_or_none(vocab_file)),
            ("merges_file", str_or_none(merge_file)),
        ];
        options.extend(hf_switches());
        options.push(("use_gigatoken", python_bool(false)));
        current(PyJson::str(path), options)
    }

    /// The identity Megatron records for the tokenizer `flags` name, in the generation they
    /// ask for (`--legacy-tokenizer`); `vocab_extra_ids` is `--vocab-extra-ids` (T5's
    /// sentinels, 0 elsewhere).
    pub fn from_flags(flags: &TokenizerArgs, vocab_extra_ids: usize) -> Result<Self> {
        let kind: TokenizerType = flags.tokenizer_type.parse().map_err(anyhow::Error::msg)?;
        let path = |value: &Option<std::path::PathBuf>| {
            value.as_ref().map(|p| p.to_string_lossy().into_owned())
        };
        let (vocab_file, merge_file, model) = (
            path(&flags.vocab_file),
            path(&flags.merge_file),
            path(&flags.tokenizer_model),
        );
        let needs = |value: &Option<String>, flag: &str| -> Result<String> {
            match value {
                Some(value) => Ok(value.clone()),
                None => bail!("--tokenizer-type {kind} needs {flag}"),
            }
        };
        let generation = if flags.legacy_tokenizer {
            TokenizerGeneration::Legacy
        } else {
            TokenizerGeneration::Current
        };
        let special_tokens = flags
            .tiktoken_special_tokens
            .as_deref()
            .map(python_str_list_repr);
        Ok(match (kind, generation) {
            (TokenizerType::Gpt2BpeTokenizer, _) => Self::gpt2_bpe(
                &needs(&vocab_file, "--vocab-file")?,
                &needs(&merge_file, "--merge-file")?,
                generation,
            ),
            (
                TokenizerType::BertWordPieceLowerCase | TokenizerType::BertWordPieceCase,
                TokenizerGeneration::Legacy,
            ) => Self::bert_wordpiece(
                &needs(&vocab_file, "--vocab-file")?,
                kind == TokenizerType::BertWordPieceLowerCase,
                vocab_extra_ids,
            ),
            (TokenizerType::BertWordPieceLowerCase, TokenizerGeneration::Current) => {
                Self::current_hf_backed(
                    kind.name(),
                    Some(&needs(&vocab_file, "--vocab-file")?),
                    merge_file.as_deref(),
                    "[]",
                )
            }
            (TokenizerType::BertWordPieceCase, TokenizerGeneration::Current) => {
                let sentinels: Vec<String> = (0..CASED_BERT_SENTINELS)
                    .map(|i| format!("<extra_id_{i}>"))
                    .collect();
                Self::current_hf_backed(
                    kind.name(),
                    Some(&needs(&vocab_file, "--vocab-file")?),
                    merge_file.as_deref(),
                    &python_str_list_repr(&sentinels),
                )
            }
            (
                TokenizerType::HuggingFaceTokenizer | TokenizerType::SftTokenizer,
                TokenizerGeneration::Legacy,
            ) => legacy(
                "_HuggingFaceTokenizer",
                vec![PyJson::str(needs(&model, "--tokenizer-model")?)],
                vec![],
            ),
            (
                TokenizerType::HuggingFaceTokenizer | TokenizerType::SftTokenizer,
                TokenizerGeneration::Current,
            ) => {
                let mut options = vec![
                    ("chat_template", PyJson::str("None")),
                    ("vocab_file", str_or_none(vocab_file.as_deref())),
                    ("merges_file", str_or_none(merge_file.as_deref())),
                ];
                options.push(("additional_special_tokens", PyJson::str("[]")));
                options.extend(hf_switches());
                options.push(("use_gigatoken", python_bool(false)));
                current(PyJson::str(needs(&model, "--tokenizer-model")?), options)
            }
            (
                TokenizerType::SentencePieceTokenizer
                | TokenizerType::GptSentencePieceTokenizer
                | TokenizerType::Llama2Tokenizer,
                TokenizerGeneration::Legacy,
            ) => {
                let (class, extra_ids) = match kind {
                    TokenizerType::SentencePieceTokenizer => {
                        ("_SentencePieceTokenizer", vocab_extra_ids)
                    }
                    // These two pass a constant 0 whatever --vocab-extra-ids says.
                    TokenizerType::GptSentencePieceTokenizer => ("_GPTSentencePieceTokenizer", 0),
                    _ => ("_Llama2Tokenizer", 0),
                };
                legacy(
                    class,
                    vec![PyJson::str(needs(&model, "--tokenizer-model")?)],
                    vec![("vocab_extra_ids", PyJson::str(extra_ids.to_string()))],
                )
            }
            // The current generation records no type for SentencePiece models: the three kinds
            // share one identity (and so one cache).
            (
                TokenizerType::SentencePieceTokenizer
                | TokenizerType::GptSentencePieceTokenizer
                | TokenizerType::Llama2Tokenizer,
                TokenizerGeneration::Current,
            ) => current(
                PyJson::str(needs(&model, "--tokenizer-model")?),
                vec![
                    ("chat_template", PyJson::str("None")),
                    ("ignore_extra_whitespaces", python_bool(true)),
                    ("legacy", python_bool(false)),
                    ("special_tokens", PyJson::str("None")),
                ],
            ),
            (TokenizerType::TikTokenizer, TokenizerGeneration::Legacy) => {
                // The whole regular expression, not its name; --tiktoken-pattern is v2 unless
                // given (core_v0.14 requires the flag).
                let pattern = pattern_regex(flags.tiktoken_pattern.as_deref().unwrap_or("v2"))?;
                legacy(
                    "CustomTikTokenizer",
                    vec![PyJson::str(needs(&model, "--tokenizer-model")?)],
                    vec![
                        ("pattern", PyJson::str(pattern)),
                        (
                            "vocab_size",
                            str_or_none(flags.vocab_size.map(|v| v.to_string()).as_deref()),
                        ),
                        (
                            "num_special_tokens",
                            PyJson::str(flags.tiktoken_num_special_tokens.to_string()),
                        ),
                        ("special_tokens", str_or_none(special_tokens.as_deref())),
                    ],
                )
            }
            (TokenizerType::TikTokenizer, TokenizerGeneration::Current) => {
                let mut options = vec![("chat_template", PyJson::str("None"))];
                if let Some(pattern) = &flags.tiktoken_pattern {
                    options.push(("pattern", PyJson::str(pattern.as_str())));
                }
                if let Some(size) = flags.vocab_size.filter(|&size| size > 0) {
                    options.push(("vocab_size", PyJson::str(size.to_string())));
                }
                options.push((
                    "num_special_tokens",
                    PyJson::str(flags.tiktoken_num_special_tokens.to_string()),
                ));
                options.push(("special_tokens", str_or_none(special_tokens.as_deref())));
                current(PyJson::str(needs(&model, "--tokenizer-model")?), options)
            }
            (TokenizerType::NullTokenizer, generation) => {
                let Some(size) = flags.vocab_size else {
                    bail!("--tokenizer-type NullTokenizer needs --vocab-size");
                };
                let size = PyJson::str(size.to_string());
                match generation {
                    TokenizerGeneration::Legacy => legacy(
                        "_NullTokenizer",
                        vec![PyJson::Null],
                        vec![("vocab_size", size)],
                    ),
                    TokenizerGeneration::Current => current(
                        PyJson::Null,
                        vec![("vocab_size", size), ("pad_id", PyJson::str("-1"))],
                    ),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        tokenizer: TokenizerArgs,
    }

    fn identity(flags: &[&str]) -> String {
        let parsed = Flags::try_parse_from([&["test"], flags].concat()).unwrap();
        TokenizerIdentity::from_flags(&parsed.tokenizer, 0)
            .unwrap()
            .0
            .dumps()
    }

    #[test]
    fn legacy_gpt2_identity_is_class_and_paths() {
        assert_eq!(
            identity(&[
                "--legacy-tokenizer",
                "--vocab-file",
                "v.json",
                "--merge-file",
                "m.txt"
            ]),
            "{\n    \"class\": \"_GPT2BPETokenizer\",\n    \"tokenizer_path\": [\n        \
             \"v.json\",\n        \"m.txt\"\n    ]\n}"
        );
        let parsed = Flags::try_parse_from(["test", "--vocab-file", "v"]).unwrap();
        let error = TokenizerIdentity::from_flags(&parsed.tokenizer, 0).unwrap_err();
        assert!(error.to_string().contains("--merge-file"), "{error}");
    }

    #[test]
    fn sentencepiece_kinds_share_the_current_identity_and_differ_in_the_legacy_one() {
        let of = |kind: &str, legacy: bool| {
            let mut flags = vec!["--tokenizer-type", kind, "--tokenizer-model", "sp.model"];
            if legacy {
                flags.push("--legacy-tokenizer");
            }
            identity(&flags)
        };
        let kinds = [
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
        ];
        for kind in kinds {
            assert_eq!(of(kind, false), of(kinds[0], false));
        }
        assert!(of("Llama2Tokenizer", true).contains("\"class\": \"_Llama2Tokenizer\""));
        assert_ne!(of(kinds[1], true), of(kinds[2], true));
    }

    #[test]
    fn null_tokenizer_path_is_null_in_both_generations() {
        let legacy = identity(&[
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "8192",
            "--legacy-tokenizer",
        ]);
        assert!(
            legacy.contains("\"tokenizer_path\": [\n        null\n    ]"),
            "{legacy}"
        );
        let current = identity(&["--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"]);
        assert!(current.contains("\"tokenizer_path\": null,"), "{current}");
        assert!(current.ends_with("\"pad_id\": \"-1\"\n}"), "{current}");
    }
}
