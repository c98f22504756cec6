//! The Python reference scripts under `scripts/reference/` that the parity tests compare
//! against, and the tiny T5 they build.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_models::T5Config;
use megatron_store::read_tensors;
use tch::{Device, Tensor};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$MEGATRON_RS_TEST_PYTHON`, else the project venv; it must have the packages of
/// `scripts/test-requirements.txt` (torch, transformers, safetensors).
fn python() -> PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"))
}

/// Runs `scripts/reference/<script> <dir> <args>` in a new temporary directory, which holds the
/// safetensors files the script wrote.
pub fn run_script(script: &str, args: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(python())
        .arg(workspace_root().join("scripts/reference").join(script))
        .arg(dir.path())
        .args(args)
        .output()
        .expect("running the reference script");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

/// The tensors of `file`, one the reference script wrote into `dir`.
pub fn tensors(dir: &tempfile::TempDir, file: &str) -> HashMap<String, Tensor> {
    read_tensors(&dir.path().join(file), Device::Cpu).unwrap().0
}

/// The architecture `megatron_t5_reference.py` builds (2 encoder and 3 decoder layers, hidden
/// 64, 12 encoder and 8 decoder tokens, 32 positions), from Megatron's T5 flags, over a
/// vocabulary of `vocab_size`.
pub fn t5_config(vocab_size: i64) -> T5Config {
    let argv = [
        "pretrain_t5",
        "--encoder-num-layers",
        "2",
        "--decoder-num-layers",
        "3",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "128",
        "--encoder-seq-length",
        "12",
        "--decoder-seq-length",
        "8",
        "--max-position-embeddings",
        "32",
        "--no-bias-gelu-fusion",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--micro-batch-size",
        "2",
    ];
    let argv = argv.iter().map(|s| s.to_string()).collect();
    super::parse_t5_flags(argv).t5_config(vocab_size).unwrap()
}
