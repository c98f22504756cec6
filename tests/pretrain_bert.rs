//! `pretrain_bert` end to end on the CPU: a tiny BERT learns a corpus preprocessed with
//! `--split-sentences`, document-level data is refused with the fix, the log line has both BERT
//! losses, checkpoints carry Megatron-core BERT names, and `--bert-no-binary-head` switches the
//! binary head off.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{bin, run_ok, shared_dir};

/// The shared small corpus tokenized with BERT's uncased vocabulary, by sentence or by document.
fn bert_corpus(dir: &Path, split_sentences: bool) -> PathBuf {
    let data = shared_dir().join("data");
    let mut command = bin("preprocess_data");
    command
        .arg("--input")
        .arg(shared_dir().join("golden/preprocess/small_corpus.jsonl"))
        .arg("--output-prefix")
        .arg(dir.join("corpus"))
        .args([
            "--tokenizer-type",
            "BertWordPieceLowerCase",
            "--workers",
            "1",
        ])
        .arg("--vocab-file")
        .arg(data.join("bert-large-uncased-vocab.txt"))
        .arg("--punkt-dir")
        .arg(data.join("punkt_tab_english"));
    if split_sentences {
        command.arg("--split-sentences");
    }
    run_ok(&mut command);
    dir.join(if split_sentences {
        "corpus_text_sentence"
    } else {
        "corpus_text_document"
    })
}

/// A tiny BERT on `prefix` with the default (BertWordPieceLowerCase) tokenizer.
fn pretrain_on(prefix: &Path, extra: &[&str]) -> Command {
    let mut command = bin("pretrain_bert");
    command
        .args([
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
        ])
        .args(["--seq-length", "64", "--max-position-embeddings", "64"])
        .args([
            "--micro-batch-size",
            "8",
            "--global-batch-size",
            "8",
            "--lr",
            "5e-3",
        ])
        .args([
            "--lr-warmup-iters",
            "2",
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
        ])
        .args(["--device", "cpu", "--split", "949,50,1", "--seed", "1234"])
        .arg("--vocab-file")
        .arg(shared_dir().join("data/bert-large-uncased-vocab.txt"))
        .arg("--data-path")
        .arg(prefix)
        .args(extra);
    command
}

/// `(lm loss, sop loss)` of every iteration in the log.
fn logged_losses(stdout: &str) -> Vec<(f64, f64)> {
    let value = |line: &str, key: &str| -> f64 {
        let rest = &line[line.find(key).unwrap() + key.len()..];
        rest[..rest.find(' ').unwrap()].parse().unwrap()
    };
    stdout
        .lines()
        .filter(|l| l.contains(" iteration ") && l.contains(" lm loss: "))
        .map(|l| (value(l, " lm loss: "), value(l, " sop loss: ")))
        .collect()
}

#[test]
fn a_tiny_bert_learns_sentence_split_data() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = bert_corpus(dir.path(), true);
    let out = run_ok(&mut pretrain_on(&prefix, &["--train-iters", "30"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let losses = logged_losses(&stdout);
    assert_eq!(losses.len(), 30, "{stdout}");
    // A uniform guess over the 30592 padded entries costs ln(30592) = 10.3 nats.
    let first = losses[..3].iter().map(|l| l.0).sum::<f64>() / 3.0;
    let last = losses[25..].iter().map(|l| l.0).sum::<f64>() / 5.0;
    assert!(
        (first - 30592f64.ln()).abs() < 1.0,
        "initial lm loss {first}"
    );
    assert!(last < first - 2.0, "lm loss went from {first} to {last}");
    eprintln!("lm loss {first:.3} -> {last:.3}");
    assert!(losses.iter().all(|l| l.1 > 0.0 && l.1 < 2.0), "{losses:?}");
    // The dataset's sample index is cached under Megatron's path and names.
    let cache = prefix.join("cache/BERTMaskedWordPieceDataset_indices");
    let files = std::fs::read_dir(&cache).map(|e| e.count()).unwrap_or(0);
    assert!(files > 0, "no sample-index cache in {}", cache.display());
}

#[test]
fn document_level_data_is_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = bert_corpus(dir.path(), false);
    let out = pretrain_on(&prefix, &["--train-iters", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--split-sentences"), "{stderr}");
}

/// A tiny BERT on synthetic masked-LM data; `extra` adds or overrides flags.
fn pretrain(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_bert");
    command
        .args([
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
        ])
        .args(["--seq-length", "32", "--max-position-embeddings", "32"])
        .args(["--micro-batch-size", "4", "--global-batch-size", "8"])
        .args([
            "--lr",
            "3e-3",
            "--lr-warmup-iters",
            "1",
            "--log-interval",
            "2",
        ])
        .args([
            "--eval-interval",
            "1000",
            "--eval-iters",
            "1",
            "--device",
            "cpu",
        ])
        .args([
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "255",
        ])
        .args(extra);
    command
}

fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let mut names: Vec<String> = json
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort();
    names
}

#[test]
fn a_tiny_bert_trains_logs_both_losses_and_saves_core_names() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    let out = run_ok(pretrain(&["--train-iters", "4"]).arg("--save").arg(&save));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("iteration        4/       4 |"))
        .unwrap_or_else(|| panic!("no log line for iteration 4 in {stdout}"));
    assert!(
        line.contains(" lm loss: ") && line.contains(" sop loss: "),
        "{line}"
    );
    assert!(stdout.contains("> BERT model: "), "{stdout}");
    assert!(
        stdout.contains("validation loss at iteration 4 on validation set | lm loss value: "),
        "{stdout}"
    );
    assert!(stdout.contains("sop loss value: "), "{stdout}");
    assert!(
        stdout.contains("pretrain_bert: 4 iterations, 32 samples, lm loss "),
        "{stdout}"
    );

    let names = tensor_names(&save.join("iter_0000004/mp_rank_00/model.safetensors"));
    for name in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "embedding.tokentype_embeddings.weight",
        "encoder.layers.0.input_layernorm.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
        "encoder.layers.1.mlp.linear_fc2.bias",
        "encoder.final_layernorm.weight",
        "pooler.dense.weight",
        "lm_head.dense.weight",
        "lm_head.layer_norm.bias",
        "output_layer.bias",
        "binary_head.weight",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
    }
    assert!(
        !names.iter().any(|n| n == "output_layer.weight"),
        "the output layer is tied"
    );
    let metadata: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(save.join("iter_0000004/metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(metadata["model_type"], "BERT");
    assert_eq!(metadata["model"]["binary_head"], true);

    // Resuming a BERT checkpoint as GPT is refused by name.
    let gpt = bin("pretrain_gpt")
        .args([
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
        ])
        .args([
            "--seq-length",
            "32",
            "--max-position-embeddings",
            "32",
            "--micro-batch-size",
            "4",
        ])
        .args([
            "--lr",
            "1e-3",
            "--train-iters",
            "5",
            "--device",
            "cpu",
            "--mock-data",
        ])
        .args([
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "255",
            "--load",
        ])
        .arg(&save)
        .output()
        .unwrap();
    assert!(!gpt.status.success());
    let stderr = String::from_utf8_lossy(&gpt.stderr);
    assert!(stderr.contains("holds a BERT model, not GPT"), "{stderr}");
}

#[test]
fn without_the_binary_head_only_the_lm_loss_is_trained() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    let out = run_ok(
        pretrain(&[
            "--train-iters",
            "2",
            "--bert-binary-head",
            "--bert-no-binary-head",
        ])
        .arg("--save")
        .arg(&save),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("iteration        2/       2 |"))
        .unwrap();
    assert!(
        line.contains(" lm loss: ") && !line.contains("sop loss"),
        "{line}"
    );
    let names = tensor_names(&save.join("iter_0000002/mp_rank_00/model.safetensors"));
    assert!(
        !names.iter().any(|n| n.starts_with("binary_head")
            || n.starts_with("pooler")
            || n.contains("tokentype")),
        "{names:?}"
    );
}

#[test]
fn help_names_the_bert_flags() {
    let out = run_ok(bin("pretrain_bert").arg("--help"));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--bert-no-binary-head",
        "--bert-binary-head",
        "--mask-prob",
        "--short-seq-prob",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    assert!(help.contains("BertWordPieceLowerCase"), "{help}");
}
