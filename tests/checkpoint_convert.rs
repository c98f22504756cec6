//! `checkpoint_convert` as a user runs it: Megatron's convert.py flags on Megatron's own
//! checkpoints (../shared/golden/megatron_checkpoints), `inspect`, `pretrain_gpt --load`
//! continuing Megatron's run with its optimizer, and bad inputs that name the file and the
//! tensor and leave no output directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{bin, run_ok, shared_dir};

fn golden(name: &str) -> PathBuf {
    shared_dir().join("golden/megatron_checkpoints").join(name)
}

fn convert(load: &Path, save: &Path, extra: &[&str]) -> Command {
    let mut command = bin("checkpoint_convert");
    command
        .args(["--model-type", "GPT", "--loader", "core", "--saver", "megatron-rs"])
        .arg("--load-dir")
        .arg(load)
        .arg("--save-dir")
        .arg(save)
        .args(["--megatron-path", "/nonexistent/Megatron-LM", "--max-queue-size", "50"])
        .args(extra);
    command
}

fn stderr_of(command: &mut Command) -> String {
    let out = command.output().unwrap();
    assert!(!out.status.success(), "{command:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Leaves `dir` holding no converted output and no temporary directory.
fn assert_nothing_left(parent: &Path) {
    let left: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("out"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn inspect_lists_every_golden() {
    for (name, format, tensor) in [
        ("gpt_torch", "Megatron torch", "model/decoder.layers.1.mlp.linear_fc2.weight  bfloat16  [64, 256]"),
        ("llama_torch", "Megatron torch", "model/output_layer.weight  bfloat16  [8320, 64]"),
        ("gpt_torch_dist", "Megatron torch_dist", "decoder.layers.mlp.linear_fc1.weight  bfloat16  [2, 256, 64]"),
    ] {
        let out = run_ok(bin("checkpoint_convert").arg("inspect").arg(golden(name)));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("format: {format}")), "{name}:\n{text}");
        assert!(text.contains(tensor), "{name}: no {tensor}:\n{text}");
        assert!(text.contains("checkpoint_version: 3.0"), "{name}:\n{text}");
        assert!(text.contains("\"num_layers\":2"), "{name}: args:\n{text}");
    }
}

/// Megatron's pretrain_gpt.py flags of the golden run (its README), on our CPU.
fn golden_run_flags() -> Vec<&'static str> {
    vec![
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "8192", "--bf16", "--no-bias-gelu-fusion", "--eval-iters", "0",
        "--log-interval", "1", "--seed", "1234", "--device", "cpu",
    ]
}

#[test]
fn pretrain_gpt_continues_megatrons_run_with_its_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours");
    let out = run_ok(&mut convert(&golden("gpt_torch"), &ours, &["--verify"]));
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("28 tensors with optimizer state"), "{summary}");
    assert!(summary.contains("verify: max |Δ logits| = 0e0"), "{summary}");
    let metrics = dir.path().join("metrics.jsonl");
    let out = run_ok(
        bin("pretrain_gpt")
            .args(golden_run_flags())
            .args(["--train-iters", "5", "--override-opt_param-scheduler"])
            .arg("--load")
            .arg(&ours)
            .arg("--metrics-file")
            .arg(&metrics),
    );
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(log.contains("5 iterations") || log.contains("iteration        5/"), "{log}");
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r.get("lm loss").is_some())
        .collect();
    let iterations: Vec<u64> = records.iter().map(|r| r["iteration"].as_u64().unwrap()).collect();
    assert_eq!(iterations, vec![4, 5], "training resumed after Megatron's iteration 3");
    for record in &records {
        let loss = record["lm loss"].as_f64().unwrap();
        // Megatron logged 9.03 at iteration 3 (ln 8193 = 9.01 is a uniform guess).
        assert!((8.5..9.5).contains(&loss), "{record}");
    }
}

#[test]
fn llama_and_torch_dist_goldens_convert_to_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    for (name, layout) in [("llama_torch", ["--target-tensor-parallel-size", "2"]), ("gpt_torch_dist", ["--target-pipeline-parallel-size", "2"])] {
        let ours = dir.path().join(name);
        let out = run_ok(&mut convert(&golden(name), &ours, &[layout[0], layout[1], "--verify"]));
        let summary = String::from_utf8_lossy(&out.stdout);
        assert!(summary.contains("verify: max |Δ logits| = 0e0"), "{name}: {summary}");
        let inspected = run_ok(bin("checkpoint_convert").arg("inspect").arg(&ours));
        let text = String::from_utf8_lossy(&inspected.stdout);
        assert!(text.contains("format: megatron-rs"), "{text}");
    }
}

#[test]
fn bad_inputs_name_the_file_and_leave_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A truncated rank file.
    let broken = dir.path().join("truncated/iter_0000003/mp_rank_00");
    std::fs::create_dir_all(&broken).unwrap();
    let bytes = std::fs::read(golden("gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt")).unwrap();
    std::fs::write(broken.join("model_optim_rng.pt"), &bytes[..bytes.len() * 2 / 3]).unwrap();
    std::fs::write(dir.path().join("truncated/latest_checkpointed_iteration.txt"), "3").unwrap();
    let error = stderr_of(&mut convert(&dir.path().join("truncated"), &out, &[]));
    assert!(error.contains("mp_rank_00/model_optim_rng.pt"), "{error}");
    assert_nothing_left(dir.path());
    // A missing shard of a TP=2 PP=2 layout.
    let sharded = dir.path().join("sharded/iter_0000003");
    for rank in ["mp_rank_00_000", "mp_rank_01_001"] {
        std::fs::create_dir_all(sharded.join(rank)).unwrap();
        std::fs::write(sharded.join(rank).join("model_optim_rng.pt"), &bytes).unwrap();
    }
    std::fs::write(dir.path().join("sharded/latest_checkpointed_iteration.txt"), "3").unwrap();
    let error = stderr_of(&mut convert(&dir.path().join("sharded"), &out, &[]));
    assert!(error.contains("missing shard mp_rank_00_001"), "{error}");
    assert_nothing_left(dir.path());
    // A vocabulary that disagrees with --true-vocab-size.
    let vocab = dir.path().join("vocab.json");
    std::fs::write(&vocab, r#"{"a": 0, "b": 1}"#).unwrap();
    let error = stderr_of(&mut convert(&golden("gpt_torch"), &out, &["--true-vocab-size", "8193", "--vocab-file", vocab.to_str().unwrap()]));
    assert!(error.contains("--true-vocab-size 8193 disagrees with --vocab-file"), "{error}");
    let error = stderr_of(&mut convert(&golden("gpt_torch"), &out, &["--true-vocab-size", "9000"]));
    assert!(error.contains("9000") && error.contains("8320"), "{error}");
    assert_nothing_left(dir.path());
    // An unknown HuggingFace architecture.
    let hf = dir.path().join("falcon");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), r#"{"architectures": ["FalconForCausalLM"]}"#).unwrap();
    let error = stderr_of(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "hf", "--saver", "megatron-rs", "--load-dir"])
            .arg(&hf)
            .arg("--save-dir")
            .arg(&out),
    );
    assert!(error.contains("FalconForCausalLM") && error.contains("config.json"), "{error}");
    assert_nothing_left(dir.path());
}
