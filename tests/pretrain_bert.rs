//! `pretrain_bert` end to end on the CPU: Megatron's flags, a log line with both BERT losses,
//! Megatron-core BERT checkpoint names, and the binary head switched off by
//! `--bert-no-binary-head`.

use std::path::Path;
use std::process::Command;

use megatron_e2e::{bin, run_ok};

/// A tiny BERT on synthetic masked-LM data; `extra` adds or overrides flags.
fn pretrain(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_bert");
    command
        .args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"])
        .args(["--seq-length", "32", "--max-position-embeddings", "32"])
        .args(["--micro-batch-size", "4", "--global-batch-size", "8"])
        .args(["--lr", "3e-3", "--lr-warmup-iters", "1", "--log-interval", "2"])
        .args(["--eval-interval", "1000", "--eval-iters", "1", "--device", "cpu"])
        .args(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "255"])
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
    assert!(line.contains(" lm loss: ") && line.contains(" sop loss: "), "{line}");
    assert!(stdout.contains("> BERT model: "), "{stdout}");
    assert!(stdout.contains("validation loss at iteration 4 on validation set | lm loss value: "), "{stdout}");
    assert!(stdout.contains("sop loss value: "), "{stdout}");
    assert!(stdout.contains("pretrain_bert: 4 iterations, 32 samples, lm loss "), "{stdout}");

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
    assert!(!names.iter().any(|n| n == "output_layer.weight"), "the output layer is tied");
    let metadata: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(save.join("iter_0000004/metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(metadata["model_type"], "BERT");
    assert_eq!(metadata["model"]["binary_head"], true);

    // Resuming a BERT checkpoint as GPT is refused by name.
    let gpt = bin("pretrain_gpt")
        .args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"])
        .args(["--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "4"])
        .args(["--lr", "1e-3", "--train-iters", "5", "--device", "cpu", "--mock-data"])
        .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--load"])
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
        pretrain(&["--train-iters", "2", "--bert-binary-head", "--bert-no-binary-head"])
            .arg("--save")
            .arg(&save),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("iteration        2/       2 |"))
        .unwrap();
    assert!(line.contains(" lm loss: ") && !line.contains("sop loss"), "{line}");
    let names = tensor_names(&save.join("iter_0000002/mp_rank_00/model.safetensors"));
    assert!(
        !names
            .iter()
            .any(|n| n.starts_with("binary_head") || n.starts_with("pooler") || n.contains("tokentype")),
        "{names:?}"
    );
}

#[test]
fn help_names_the_bert_flags() {
    let out = run_ok(bin("pretrain_bert").arg("--help"));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--bert-no-binary-head", "--bert-binary-head", "--mask-prob", "--short-seq-prob"] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    assert!(help.contains("BertWordPieceLowerCase"), "{help}");
}
