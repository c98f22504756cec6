//! The inference tools `--load` Megatron's own checkpoints (`torch` and `torch_dist`, the goldens
//! of ../shared/golden/megatron_checkpoints) directly, and give what they give on the same
//! checkpoint converted offline by `checkpoint_convert`.

use std::path::{Path, PathBuf};

use megatron_e2e::{bin, run_ok, shared_dir};

fn golden(name: &str) -> PathBuf {
    shared_dir().join("golden/megatron_checkpoints").join(name)
}

/// The goldens' tokenizer: Megatron's mock ids, NullTokenizer over 8192.
const TOKENIZER: &[&str] = &["--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"];

/// `golden` converted offline into our format under `dir`.
fn converted(golden: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(golden.file_name().unwrap());
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "core"])
            .args(["--saver", "megatron-rs", "--no-optimizer"])
            .arg("--load-dir")
            .arg(golden)
            .arg("--save-dir")
            .arg(&out),
    );
    out
}

/// `eval_tasks --task WIKITEXT103` of `checkpoint` over `data`: its results.
fn wikitext(checkpoint: &Path, data: &Path, json: &Path) -> serde_json::Value {
    run_ok(
        bin("eval_tasks")
            .arg("--load")
            .arg(checkpoint)
            .args(TOKENIZER)
            .args(["--device", "cpu", "--seq-length", "64"])
            .args(["--task", "WIKITEXT103", "--overlapping-eval", "16"])
            .arg("--valid-data")
            .arg(data)
            .arg("--results-json")
            .arg(json),
    );
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

/// `eval_tasks --load` of Megatron's torch and torch_dist checkpoints scores a text of token
/// ids exactly as the same checkpoints converted by `checkpoint_convert`.
#[test]
fn eval_tasks_loads_megatron_checkpoints_as_their_conversions() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("wiki.txt");
    let ids: Vec<String> = (0..300)
        .map(|i| ((i * 37 + 11) % 4000).to_string())
        .collect();
    std::fs::write(&data, ids.join(" ")).unwrap();
    for name in ["gpt_torch", "gpt_torch_dist"] {
        let direct = wikitext(&golden(name), &data, &dir.path().join("direct.json"));
        let offline = wikitext(
            &converted(&golden(name), dir.path()),
            &data,
            &dir.path().join("offline.json"),
        );
        assert!(direct["avg_loss"].as_f64().unwrap() > 0.0, "{direct}");
        assert_eq!(direct["num_tokenized_tokens"], 300, "{direct}");
        for key in ["num_windows", "loss_sum", "avg_loss", "ppl"] {
            assert_eq!(direct[key], offline[key], "{name}: {key}");
        }
    }
}

/// `generate_samples_gpt --load` of Megatron's torch and torch_dist checkpoints continues a
/// prompt greedily as the same checkpoints converted by `checkpoint_convert` do.
#[test]
fn generate_samples_gpt_loads_megatron_checkpoints_as_their_conversions() {
    let dir = tempfile::tempdir().unwrap();
    let generate = |checkpoint: &Path| {
        let out = run_ok(
            bin("generate_samples_gpt")
                .arg("--load")
                .arg(checkpoint)
                .args(TOKENIZER)
                .args(["--prompt", "17 301 2048 5"])
                .args(["--out-seq-length", "8", "--greedy", "--device", "cpu"]),
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for name in ["gpt_torch", "gpt_torch_dist"] {
        let direct = generate(&golden(name));
        let offline = generate(&converted(&golden(name), dir.path()));
        assert!(direct.contains("17 301 2048 5"), "{direct}");
        assert_eq!(direct, offline, "{name}");
    }
}
