//! Megatron's SentencePiece and TikToken tokenizers in `preprocess_data`: the `.bin` holds
//! exactly the ids the Python `sentencepiece` and `tiktoken` packages give, on models trained
//! for the test (`fixtures/tokenizer_references.py`, no network) and documents of the shared
//! corpora, and on hand-made SentencePiece models whose documents each aim at one behaviour.

use std::path::Path;

use megatron_e2e::{bin, run_ok, shared_dir, workspace_root};
use serde_json::Value;

fn python() -> std::path::PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// The token ids of a preprocessed `.bin` (uint16 below 65500 tokens).
fn bin_ids(prefix: &Path) -> Vec<u64> {
    let bytes = std::fs::read(format!("{}_text_document.bin", prefix.display())).unwrap();
    bytes
        .chunks_exact(2)
        .map(|b| u64::from(u16::from_le_bytes([b[0], b[1]])))
        .collect()
}

fn flat(documents: &Value) -> Vec<u64> {
    documents
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|d| d.as_array().unwrap().iter().map(|i| i.as_u64().unwrap()))
        .collect()
}

#[test]
fn sentencepiece_and_tiktoken_ids_equal_the_python_packages() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path();
    run_ok(
        std::process::Command::new(python())
            .arg(workspace_root().join("tests/fixtures/tokenizer_references.py"))
            .arg(out)
            .arg(shared_dir().join("data")),
    );
    let expected: Value =
        serde_json::from_slice(&std::fs::read(out.join("expected.json")).unwrap()).unwrap();
    let model = |name: &str| {
        vec![
            "--tokenizer-model".into(),
            out.join(name).display().to_string(),
        ]
    };
    let tiktoken = |version: &str| {
        let mut flags = model("tiktoken.json");
        flags.extend([
            "--tiktoken-pattern".into(),
            version.into(),
            "--tiktoken-num-special-tokens".into(),
            expected["tiktoken_num_special"].to_string(),
            "--vocab-size".into(),
            expected["tiktoken_vocab_size"].to_string(),
        ]);
        flags
    };
    let mut cases: Vec<(String, &str, Vec<String>)> = vec![
        (
            "unigram".into(),
            "GPTSentencePieceTokenizer",
            model("unigram.model"),
        ),
        (
            "bpe".into(),
            "GPTSentencePieceTokenizer",
            model("bpe.model"),
        ),
        ("llama2".into(), "Llama2Tokenizer", model("unigram.model")),
        (
            "unigram_extras".into(),
            "GPTSentencePieceTokenizer",
            model("unigram_extras.model"),
        ),
        (
            "bpe_extras".into(),
            "GPTSentencePieceTokenizer",
            model("bpe_extras.model"),
        ),
        ("tiktoken_v1".into(), "TikTokenizer", tiktoken("v1")),
        ("tiktoken_v2".into(), "TikTokenizer", tiktoken("v2")),
    ];
    for kind in ["unigram", "bpe"] {
        let flags = model(&format!("{kind}.model"));
        cases.push((format!("megatron_{kind}"), "SentencePieceTokenizer", flags));
    }
    for name in ["unigram", "bpe", "suffix", "noescape"] {
        let key = format!("handmade_{name}");
        let flags = model(&format!("{key}.model"));
        cases.push((key, "GPTSentencePieceTokenizer", flags));
    }
    for (key, tokenizer, flags) in cases {
        let key = key.as_str();
        let prefix = out.join(key);
        let input = match key.split('_').next() {
            Some("handmade") => "handmade.jsonl",
            Some("megatron") => "special.jsonl",
            _ => "input.jsonl",
        };
        run_ok(
            bin("preprocess_data")
                .arg("--input")
                .arg(out.join(input))
                .arg("--output-prefix")
                .arg(&prefix)
                .args(["--tokenizer-type", tokenizer, "--workers", "2"])
                .args(&flags),
        );
        let (ours, theirs) = (bin_ids(&prefix), flat(&expected[key]));
        assert_eq!(ours.len(), theirs.len(), "{key}");
        let first = ours.iter().zip(&theirs).position(|(a, b)| a != b);
        assert!(
            first.is_none(),
            "{key}: {} of {} ids differ; the first at {first:?}: ours {:?}, theirs {:?}",
            ours.iter().zip(&theirs).filter(|(a, b)| a != b).count(),
            ours.len(),
            first.map(|i| &ours[i.saturating_sub(3)..(i + 4).min(ours.len())]),
            first.map(|i| &theirs[i.saturating_sub(3)..(i + 4).min(theirs.len())]),
        );
    }
}
