//! `pretrain_t5` end to end on the CPU: a tiny T5 learns the shared corpus (preprocessed with
//! `--split-sentences`, span-corrupted by Megatron's T5 dataset with `--vocab-extra-ids`
//! sentinels), the log and summary lines, checkpoints with Megatron-core T5 names and the model
//! flags in the metadata, both depth flags honoured, pipeline parallelism refused by name.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{bin, run_ok, shared_dir};

/// The shared small corpus split into sentences with BERT's uncased vocabulary.
fn sentence_corpus(dir: &Path) -> PathBuf {
    let data = shared_dir().join("data");
    run_ok(
        bin("preprocess_data")
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
            .arg(data.join("punkt_tab_english"))
            .arg("--split-sentences"),
    );
    dir.join("corpus_text_sentence")
}

/// `lm loss` of every iteration in the log.
fn logged_losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.contains(" iteration ") && l.contains(" lm loss: "))
        .map(|l| {
            let rest = &l[l.find(" lm loss: ").unwrap() + " lm loss: ".len()..];
            rest[..rest.find(' ').unwrap()].parse().unwrap()
        })
        .collect()
}

#[test]
fn a_tiny_t5_learns_the_span_corrupted_corpus() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = sentence_corpus(dir.path());
    let out = run_ok(
        bin("pretrain_t5")
            .args(["--encoder-num-layers", "2", "--decoder-num-layers", "2"])
            .args(["--hidden-size", "64", "--num-attention-heads", "4"])
            .args(["--encoder-seq-length", "64", "--decoder-seq-length", "32"])
            .args([
                "--max-position-embeddings",
                "64",
                "--vocab-extra-ids",
                "100",
            ])
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
            .args(["--train-iters", "30"])
            .arg("--vocab-file")
            .arg(shared_dir().join("data/bert-large-uncased-vocab.txt"))
            .arg("--data-path")
            .arg(&prefix),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let losses = logged_losses(&stdout);
    assert_eq!(losses.len(), 30, "{stdout}");
    // 30522 WordPieces, [BOS], [EOS] and 100 sentinels (30624), padded to 30720: a uniform
    // guess costs 10.3 nats.
    let first = losses[..3].iter().sum::<f64>() / 3.0;
    let last = losses[25..].iter().sum::<f64>() / 5.0;
    assert!(
        (first - 30720f64.ln()).abs() < 1.0,
        "initial lm loss {first}"
    );
    assert!(last < first - 2.0, "lm loss went from {first} to {last}");
    eprintln!("lm loss {first:.3} -> {last:.3}");
    let cache = prefix.join("cache/T5MaskedWordPieceDataset_indices");
    let files = std::fs::read_dir(&cache).map(|e| e.count()).unwrap_or(0);
    assert!(files > 0, "no sample-index cache in {}", cache.display());
}

/// A tiny T5 on synthetic span-corruption data; `extra` adds or overrides flags.
fn pretrain(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_t5");
    command
        .args(["--num-layers", "2", "--decoder-num-layers", "3"])
        .args(["--hidden-size", "32", "--num-attention-heads", "4"])
        .args(["--seq-length", "32", "--decoder-seq-length", "16"])
        .args(["--max-position-embeddings", "32"])
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
fn a_tiny_t5_trains_logs_and_saves_core_names_and_model_flags() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    let out = run_ok(pretrain(&["--train-iters", "4"]).arg("--save").arg(&save));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("iteration        4/       4 |"))
        .unwrap_or_else(|| panic!("no log line for iteration 4 in {stdout}"));
    assert!(line.contains(" lm loss: "), "{line}");
    assert!(stdout.contains("> T5 model: "), "{stdout}");
    assert!(
        stdout.contains("validation loss at iteration 4 on validation set | lm loss value: "),
        "{stdout}"
    );
    assert!(
        stdout.contains("pretrain_t5: 4 iterations, 32 samples, lm loss "),
        "{stdout}"
    );

    let names = tensor_names(&save.join("iter_0000004/mp_rank_00/model.safetensors"));
    for name in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
        "encoder.final_layernorm.weight",
        "decoder.layers.2.self_attention.linear_qkv.weight",
        "decoder.layers.2.pre_cross_attn_layernorm.weight",
        "decoder.layers.2.cross_attention.linear_q.weight",
        "decoder.layers.2.cross_attention.linear_kv.bias",
        "decoder.layers.2.cross_attention.linear_proj.weight",
        "decoder.final_layernorm.bias",
        "lm_head.output_layer.bias",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} not in {names:?}");
    }
    assert!(!names
        .iter()
        .any(|n| n.starts_with("encoder.layers.2") || n.starts_with("decoder.layers.3")));
    let metadata: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(save.join("iter_0000004/metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(metadata["model_type"], "T5");
    assert_eq!(metadata["model"]["encoder_num_layers"], 2);
    assert_eq!(metadata["model"]["decoder_num_layers"], 3);
    assert_eq!(metadata["model"]["hidden_size"], 32);

    // Untied: the LM head has its own weight and no bias.
    let untied = dir.path().join("untied");
    run_ok(
        pretrain(&[
            "--train-iters",
            "2",
            "--untie-embeddings-and-output-weights",
        ])
        .arg("--save")
        .arg(&untied),
    );
    let names = tensor_names(&untied.join("iter_0000002/mp_rank_00/model.safetensors"));
    assert!(
        names.iter().any(|n| n == "lm_head.output_layer.weight"),
        "{names:?}"
    );
    assert!(
        !names.iter().any(|n| n == "lm_head.output_layer.bias"),
        "{names:?}"
    );
}

#[test]
fn pipeline_parallelism_is_refused_by_name() {
    let out = pretrain(&["--train-iters", "2", "--pipeline-model-parallel-size", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--pipeline-model-parallel-size"),
        "{stderr}"
    );
}

#[test]
fn help_names_the_t5_flags() {
    let out = run_ok(bin("pretrain_t5").arg("--help"));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--encoder-num-layers",
        "--decoder-num-layers",
        "--encoder-seq-length",
        "--decoder-seq-length",
        "--vocab-extra-ids",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    assert!(help.contains("BertWordPieceLowerCase"), "{help}");
}
