//! `gpt_dynamic_inference` runs the flag set of Megatron's
//! `examples/inference/gpt/gpt_dynamic_inference_357m.sh` (scaled to a tiny CPU model): the
//! simulated requests are the ones Python's `random` draws for Megatron's example with the same
//! seed, every request finishes, and the report and JSON have Megatron's shape; given prompts
//! are continued as `generate_samples_gpt` continues them.

use std::path::Path;
use std::process::Command;

use megatron_e2e::{bin, mock_gpt_checkpoint, quickstart_tokenizer_flags, run_ok, test_python};
use serde_json::Value;

/// The script's model, 2 layers of 64 channels over 64 positions, trained two steps.
fn checkpoint(dir: &Path) {
    let architecture = [
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
    ];
    mock_gpt_checkpoint(dir, &architecture, &quickstart_tokenizer_flags());
}

/// The script's flags with its tiny values, `{CHECKPOINT}` and the tokenizer filled in, up to
/// the request flags.
fn script(checkpoint: &Path, output: &Path) -> Command {
    let mut command = bin("gpt_dynamic_inference");
    command
        .args([
            "--exit-on-missing-checkpoint",
            "--transformer-impl",
            "local",
            "--load",
        ])
        .arg(checkpoint)
        .args(quickstart_tokenizer_flags())
        .args([
            "--exit-on-missing-checkpoint",
            "--max-position-embeddings",
            "64",
        ])
        .args(["--seq-length", "64", "--tensor-model-parallel-size", "1"])
        .args(["--pipeline-model-parallel-size", "1", "--num-layers", "2"])
        .args([
            "--num-attention-heads",
            "4",
            "--hidden-size",
            "64",
            "--bf16",
        ])
        .args(["--micro-batch-size", "1", "--attention-dropout", "0.0"])
        .args([
            "--hidden-dropout",
            "0.0",
            "--seed",
            "42",
            "--use-flash-attn",
        ])
        .args(["--inference-rng-tracker", "--inference-dynamic-batching"])
        .args(["--inference-dynamic-batching-buffer-size-gb", "0.01"])
        .args(["--inference-dynamic-batching-buffer-overflow-factor", "1."])
        .args([
            "--inference-dynamic-batching-buffer-guaranteed-fraction",
            "0.05",
        ])
        .args([
            "--enable-cuda-graph",
            "--inference-dynamic-batching-num-cuda-graphs",
            "16",
        ])
        .args(["--device", "cpu", "--output-path"])
        .arg(output);
    command
}

/// The prompts Megatron's `get_auto_requests` makes with `random.seed(42)`: arrivals of a
/// Poisson process at 8 per second over one second (simpy stops before an event at the end),
/// then one prompt length drawn per arrival.
fn megatron_auto_prompts() -> Vec<String> {
    let script = r#"
import json, random
random.seed(42)
times, now = [], 0.0
while True:
    now += random.expovariate(8.0)
    if now >= 1.0:
        break
    times.append(now)
times = times or [0.0]
print(json.dumps(["hi " * random.randint(4, 16) for _ in times]))
"#;
    let out = run_ok(Command::new(test_python(&["json"])).args(["-c", script]));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn results(path: &Path) -> Vec<Value> {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let map = json.as_object().unwrap();
    (0..map.len())
        .map(|i| map[&i.to_string()].clone())
        .collect()
}

#[test]
fn megatrons_dynamic_inference_script_runs_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint_dir = dir.path().join("checkpoint");
    checkpoint(&checkpoint_dir);
    let output = dir.path().join("results.json");
    let out = run_ok(
        script(&checkpoint_dir, &output)
            .args([
                "--num-tokens-to-prompt",
                "4",
                "16",
                "--num-tokens-to-generate",
                "16",
            ])
            .args([
                "--incoming-requests-duration",
                "1.",
                "--incoming-requests-per-sec",
                "8.",
            ]),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let expected = megatron_auto_prompts();
    let results = results(&output);
    let prompts: Vec<&str> = results
        .iter()
        .map(|r| r["input_prompt"].as_str().unwrap())
        .collect();
    assert_eq!(prompts, expected, "the simulated requests are Megatron's");
    for result in &results {
        let tokens = result["generated_tokens"].as_array().unwrap();
        assert!((1..=16).contains(&tokens.len()), "{result}");
        assert!(result["latency"].as_f64().unwrap() > 0.0, "{result}");
        assert!(result.get("logprobs").is_none(), "{result}");
    }
    let setup = format!(
        "| dynamic | -- | <auto prompts> (4 16), 16, 1.0e+00, 8.0e+00 | bf 0, no overflow [r 64, t "
    );
    assert!(stdout.contains(&setup), "{stdout}");
    assert!(
        stdout.contains(&format!("| reqs {}\n", expected.len())),
        "{stdout}"
    );
    let mut unique = expected.clone();
    unique.sort();
    unique.dedup();
    let listed = stdout
        .lines()
        .filter(|l| l.contains(&format!("/{} [n ", unique.len())))
        .count();
    assert_eq!(listed, unique.len(), "one line per unique prompt: {stdout}");
    assert!(
        stdout.contains(" … total time: ") && stdout.contains(" tok/s\n~~~"),
        "{stdout}"
    );
}

/// Prompts given with `--prompts` (the script's PROMPTS branch) arrive at once; one of them,
/// greedily continued, reads as `generate_samples_gpt --greedy` continues it.
#[test]
fn given_prompts_are_continued_as_generate_samples_gpt_does() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint_dir = dir.path().join("checkpoint");
    checkpoint(&checkpoint_dir);
    let output = dir.path().join("results.json");
    let out = run_ok(
        bin("gpt_dynamic_inference")
            .arg("--load")
            .arg(&checkpoint_dir)
            .args(quickstart_tokenizer_flags())
            .args([
                "--device",
                "cpu",
                "--prompts",
                "the first one",
                "the second",
            ])
            .args([
                "--num-tokens-to-generate",
                "8",
                "--return-log-probs",
                "--output-path",
            ])
            .arg(&output),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("| <user prompts, n 2> |"), "{stdout}");
    let results = results(&output);
    assert_eq!(results.len(), 2);
    for result in &results {
        let generated = result["generated_tokens"].as_array().unwrap().len();
        let logprobs = result["logprobs"].as_array().unwrap().len();
        assert!(generated >= 1 && generated <= 8, "{result}");
        assert!(
            logprobs > generated,
            "prompt and generated tokens: {result}"
        );
    }

    let samples = dir.path().join("samples.jsonl");
    run_ok(
        bin("generate_samples_gpt")
            .arg("--load")
            .arg(&checkpoint_dir)
            .args(quickstart_tokenizer_flags())
            .args(["--device", "cpu", "--greedy", "--out-seq-length", "8"])
            .args(["--prompt", "the first one", "--sample-output-file"])
            .arg(&samples),
    );
    let sample: Value =
        serde_json::from_str(std::fs::read_to_string(&samples).unwrap().trim()).unwrap();
    let ours = results[0]["generated_text"].as_str().unwrap();
    assert_eq!(
        ours.trim_end_matches("<|endoftext|>"),
        sample["text"].as_str().unwrap()
    );
}

#[test]
fn requests_from_a_prompt_file_and_bad_flags() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, "{\"text\": \"a\"}\n{\"other\": 1}\nnot json\n").unwrap();
    let missing = dir.path().join("no-checkpoint");
    let out = bin("gpt_dynamic_inference")
        .arg("--load")
        .arg(&missing)
        .args(quickstart_tokenizer_flags())
        .arg("--prompt-file")
        .arg(&prompts)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("prompts.jsonl:3: not a JSON object"),
        "{stderr}"
    );

    for (flags, names) in [
        (
            &["--num-tokens-to-prompt", "4"][..],
            "--num-tokens-to-prompt",
        ),
        (&["--top-n-logprobs", "2"][..], "--top-n-logprobs"),
        (&["--model-provider", "mamba"][..], "--model-provider mamba"),
        (
            &["--incoming-requests-per-sec", "0"][..],
            "--incoming-requests-per-sec",
        ),
    ] {
        let out = bin("gpt_dynamic_inference")
            .arg("--load")
            .arg(&missing)
            .args(quickstart_tokenizer_flags())
            .args(flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {stderr}");
        assert!(stderr.contains(names), "{flags:?}: {stderr}");
    }
}

/// On a GPU, decode steps replayed from CUDA graphs (`--enable-cuda-graph`) give the tokens of
/// eager decoding for every simulated request.
#[test]
fn cuda_graphs_decode_like_eager_steps_on_a_gpu() {
    if megatron_e2e::visible_gpus() == 0 {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let checkpoint_dir = dir.path().join("checkpoint");
    checkpoint(&checkpoint_dir);
    let run = |graphs: bool| {
        let output = dir.path().join(format!("graphs-{graphs}.json"));
        let mut command = bin("gpt_dynamic_inference");
        command
            .arg("--load")
            .arg(&checkpoint_dir)
            .args(quickstart_tokenizer_flags())
            .args(["--device", "cuda", "--num-tokens-to-prompt", "4", "12"])
            .args([
                "--num-tokens-to-generate",
                "20",
                "--incoming-requests-per-sec",
                "200",
            ])
            .args(["--incoming-requests-duration", "0.2", "--output-path"])
            .arg(&output);
        if graphs {
            command.arg("--enable-cuda-graph");
        }
        let stdout = String::from_utf8(run_ok(&mut command).stdout).unwrap();
        assert!(
            stdout.contains(if graphs { "| graphs on |" } else { "| -- |" }),
            "{stdout}"
        );
        results(&output)
            .iter()
            .map(|r| r["generated_tokens"].clone())
            .collect::<Vec<_>>()
    };
    let eager = run(false);
    assert!(eager.len() > 10, "{eager:?}");
    assert_eq!(run(true), eager);
}
