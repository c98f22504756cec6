//! SentencePiece decoding equals the Python `sentencepiece` package's `decode_ids` on hand-made
//! models (`tests/fixtures/sentencepiece_decode.py`): leading `▁` under each whitespace option,
//! byte pieces with invalid UTF-8, control and unknown pieces, a custom unknown surface.

use std::path::{Path, PathBuf};

use megatron_data::tokenizer::{SentencePiece, SentencePieceFlavor, Tokenizer};
use serde_json::Value;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(Into::into)
        .unwrap_or_else(|| workspace().join(".venv/bin/python"))
}

#[test]
fn decoding_equals_the_python_package() {
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(python())
        .arg(workspace().join("tests/fixtures/sentencepiece_decode.py"))
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let models: Value = serde_json::from_slice(&output.stdout).unwrap();
    for model in models.as_array().unwrap() {
        let path = model["model"].as_str().unwrap();
        let tokenizer =
            SentencePiece::from_file(Path::new(path), SentencePieceFlavor::Gpt, 0).unwrap();
        for case in model["cases"].as_array().unwrap() {
            let ids: Vec<u32> = case[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect();
            let text = tokenizer.detokenize(&ids).unwrap();
            assert_eq!(text, case[1].as_str().unwrap(), "{path}: ids {ids:?}");
        }
    }
}
