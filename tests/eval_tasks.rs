//! `eval_tasks` as a user runs it, on a tiny GPT that `pretrain_gpt` trained in the test on
//! LAMBADA passages: WikiText loss/ppl/adjusted ppl and LAMBADA counts equal an independent
//! Python reference (HuggingFace GPT2LMHeadModel on the same weights,
//! scripts/reference/eval_tasks_reference.py); two tensor-parallel processes give the
//! one-process numbers; Megatron's flags are accepted and checked; bad input gets clear errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use megatron_e2e::{bin, run_job, run_ok, shared_dir, test_python, workspace_root};
use serde_json::{json, Value};

const PASSAGES: usize = 24;

fn tokenizer_flags() -> Vec<String> {
    let data = shared_dir().join("data");
    vec![
        "--tokenizer-type".into(),
        "GPT2BPETokenizer".into(),
        "--vocab-file".into(),
        data.join("gpt2-vocab.json").display().to_string(),
        "--merge-file".into(),
        data.join("gpt2-merges.txt").display().to_string(),
    ]
}

struct Fixture {
    _dir: tempfile::TempDir,
    checkpoint: PathBuf,
    lambada: PathBuf,
    wiki: PathBuf,
}

/// The first passages of LAMBADA and lines of WikiText-2, and a 2-layer GPT trained for 30
/// steps on those passages (so that it gets some LAMBADA targets right), built once.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let shared = shared_dir().join("data");
        let lambada = dir.path().join("lambada_head.jsonl");
        let text = std::fs::read_to_string(shared.join("lambada_test.jsonl")).unwrap();
        std::fs::write(
            &lambada,
            text.split_inclusive('\n')
                .take(PASSAGES)
                .collect::<String>(),
        )
        .unwrap();
        let wiki = dir.path().join("wiki.head.tokens");
        let text = std::fs::read_to_string(shared.join("wikitext2_test.tokens")).unwrap();
        std::fs::write(
            &wiki,
            text.split_inclusive('\n').take(30).collect::<String>(),
        )
        .unwrap();
        let prefix = dir.path().join("lambada");
        run_ok(
            bin("preprocess_data")
                .arg("--input")
                .arg(&lambada)
                .arg("--output-prefix")
                .arg(&prefix)
                .args(["--append-eod", "--workers", "1"])
                .args(tokenizer_flags()),
        );
        let checkpoint = dir.path().join("ckpt");
        run_ok(
            bin("pretrain_gpt")
                .args([
                    "--num-layers",
                    "2",
                    "--hidden-size",
                    "64",
                    "--num-attention-heads",
                    "4",
                    "--seq-length",
                    "64",
                    "--max-position-embeddings",
                    "128",
                    "--micro-batch-size",
                    "4",
                    "--global-batch-size",
                    "4",
                    "--train-iters",
                    "30",
                    "--lr",
                    "5e-3",
                    "--split",
                    "100,0,0",
                    "--eval-iters",
                    "0",
                    "--hidden-dropout",
                    "0",
                    "--attention-dropout",
                    "0",
                    "--device",
                    "cpu",
                    "--log-interval",
                    "10",
                    "--data-path",
                ])
                .arg(format!("{}_text_document", prefix.display()))
                .arg("--save")
                .arg(&checkpoint)
                .args(tokenizer_flags()),
        );
        Fixture {
            _dir: dir,
            checkpoint,
            lambada,
            wiki,
        }
    })
}

fn eval_tasks(fixture: &Fixture, args: &[&str]) -> Command {
    let mut command = bin("eval_tasks");
    command
        .arg("--load")
        .arg(&fixture.checkpoint)
        .args(tokenizer_flags())
        .args(["--device", "cpu", "--seq-length", "128"])
        .args(args);
    command
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn reference(fixture: &Fixture, task: &str, data: &Path, strict: bool) -> Value {
    reference_of(&fixture.checkpoint, "128", task, data, strict)
}

/// The Python reference's numbers for `checkpoint` (ours, or a HuggingFace directory).
fn reference_of(
    checkpoint: &Path,
    seq_length: &str,
    task: &str,
    data: &Path,
    strict: bool,
) -> Value {
    let python = test_python(&["torch", "transformers", "safetensors", "tokenizers"]);
    let out = run_ok(
        Command::new(python)
            .arg(workspace_root().join("scripts/reference/eval_tasks_reference.py"))
            .arg(checkpoint)
            .arg(shared_dir().join("data/gpt2-tokenizer.json"))
            .arg(task)
            .arg(data)
            .args([seq_length, "32", if strict { "1" } else { "0" }]),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn assert_close(ours: &Value, reference: &Value, key: &str) {
    let (a, b) = (
        ours[key].as_f64().unwrap(),
        reference[key].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-5 * b.abs().max(1e-12),
        "{key}: eval_tasks {a}, reference {b}"
    );
}

fn wikitext(fixture: &Fixture, extra: &[&str], json: &Path) -> Output {
    let mut command = eval_tasks(
        fixture,
        &[
            "--task",
            "WIKITEXT103",
            "--overlapping-eval",
            "32",
            "--eval-micro-batch-size",
            "3",
        ],
    );
    command
        .arg("--valid-data")
        .arg(&fixture.wiki)
        .arg("--results-json")
        .arg(json)
        .args(extra);
    run_ok(&mut command)
}

#[test]
fn wikitext_equals_the_hf_reference() {
    let fixture = fixture();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("results.json");
    let out = wikitext(fixture, &[], &json);
    let ours = read_json(&json);
    let expected = reference(fixture, "WIKITEXT103", &fixture.wiki, false);
    for key in ["num_tokenized_tokens", "num_original_tokens", "num_windows"] {
        assert_eq!(ours[key], expected[key], "{key}");
    }
    for key in ["loss_sum", "avg_loss", "ppl", "adjusted_ppl", "token_ratio"] {
        assert_close(&ours, &expected, key);
    }
    let stdout = String::from_utf8(out.stdout).unwrap();
    let line = stdout
        .lines()
        .find(|l| l.starts_with(" validation results on WIKITEXT103 | avg loss: "))
        .unwrap_or_else(|| panic!("no result line in\n{stdout}"));
    assert!(
        line.ends_with(&format!("| token ratio: {} |", expected["token_ratio"])),
        "{line}"
    );
    let rule = "-".repeat(line.len() + 1);
    assert!(
        stdout.contains(&format!("{rule}\n{line}\n{rule}\n")),
        "{stdout}"
    );
    assert!(stdout.contains(&format!(
        " > number of original tokens: {}, number of detokenized tokens: {}",
        expected["num_original_tokens"], expected["num_tokenized_tokens"]
    )));
    assert!(stdout.trim_end().ends_with("done :-)"));
}

#[test]
fn lambada_counts_equal_the_hf_reference() {
    let fixture = fixture();
    for strict in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("results.json");
        let mut command = eval_tasks(
            fixture,
            &[
                "--task",
                "LAMBADA",
                "--report",
                "both",
                "--eval-micro-batch-size",
                "5",
            ],
        );
        command
            .arg("--valid-data")
            .arg(&fixture.lambada)
            .arg("--results-json")
            .arg(&json);
        if strict {
            command.arg("--strict-lambada");
        }
        let out = run_ok(&mut command);
        let ours = read_json(&json);
        let expected = reference(fixture, "LAMBADA", &fixture.lambada, strict);
        let megatron = &ours[if strict {
            "megatron_strict"
        } else {
            "megatron_non_strict"
        }];
        assert_eq!(
            megatron["correct"], expected["megatron"]["correct"],
            "strict {strict}"
        );
        assert_eq!(megatron["total"].as_u64(), Some(PASSAGES as u64));
        assert_close(megatron, &expected["megatron"], "target_logprob_sum");
        assert_eq!(ours["lm_eval"]["correct"], expected["lm_eval"]["correct"]);
        assert_close(&ours["lm_eval"], &expected["lm_eval"], "target_logprob_sum");
        let stdout = String::from_utf8(out.stdout).unwrap();
        let correct = megatron["correct"].as_f64().unwrap();
        // Python's '{:.4E}' of a count below 100.
        let count = format!("{correct:.4E}").replace('E', "E+0");
        assert!(
            stdout.contains(&format!(
                " validation results on LAMBADA | number correct: {count} | total examples: 2.4000E+01 |"
            )),
            "{stdout}"
        );
        assert!(stdout.contains(
            " lm-evaluation-harness lambada_openai formulation (not Megatron's) | acc: "
        ));
    }
}

/// `--load-hf` evaluates a HuggingFace checkpoint through checkpoint_convert's loader: the
/// fixture exported to HF and evaluated with `--load-hf` gives exactly what the same export
/// imported by `checkpoint_convert` and evaluated with `--load` gives.
#[test]
fn a_huggingface_checkpoint_evaluates_like_its_import() {
    let fixture = fixture();
    let dir = tempfile::tempdir().unwrap();
    let (hf, imported) = (dir.path().join("hf"), dir.path().join("imported"));
    let convert = |loader: &str, saver: &str, from: &Path, to: &Path| {
        run_ok(
            bin("checkpoint_convert")
                .args(["--model-type", "GPT", "--loader", loader, "--saver", saver])
                .arg("--load-dir")
                .arg(from)
                .arg("--save-dir")
                .arg(to)
                .args(&tokenizer_flags()[2..]),
        );
    };
    convert("megatron-rs", "hf", &fixture.checkpoint, &hf);
    convert("hf", "megatron-rs", &hf, &imported);
    let run = |source: &[&str], json: &Path| {
        run_ok(
            bin("eval_tasks")
                .args(source)
                .args(tokenizer_flags())
                .args(["--device", "cpu", "--seq-length", "128"])
                .args(["--task", "WIKITEXT103", "--overlapping-eval", "32"])
                .arg("--valid-data")
                .arg(&fixture.wiki)
                .arg("--results-json")
                .arg(json),
        );
        read_json(json)
    };
    let from_hf = run(
        &["--load-hf", hf.to_str().unwrap()],
        &dir.path().join("hf.json"),
    );
    let from_import = run(
        &["--load", imported.to_str().unwrap()],
        &dir.path().join("imported.json"),
    );
    assert!(from_hf["avg_loss"].as_f64().unwrap() > 0.0);
    for key in [
        "num_tokenized_tokens",
        "num_original_tokens",
        "num_windows",
        "loss_sum",
        "avg_loss",
        "ppl",
        "adjusted_ppl",
    ] {
        assert_eq!(from_hf[key], from_import[key], "{key}");
    }
}

/// A Llama-shaped GPT trained by `pretrain_gpt` with RoPE scaling `scaling` (Megatron's flags)
/// on the fixture's passages, 64 positions: `eval_tasks` on the saved checkpoint (which
/// carries the scaling, tagged `rope_type`) gives transformers' WikiText numbers on its HF
/// export (`checkpoint_convert --saver hf`).
fn scaled_rope_model_evaluates_as_transformers(scaling: &[&str], rope_type: &str) {
    let (metadata, _) = llama_model_evaluates_as_transformers(scaling);
    assert_eq!(
        metadata["model"]["rope_scaling"]["rope_type"], rope_type,
        "{metadata}"
    );
}

/// A Llama-shaped GPT with the extra pretraining flags `flags`, trained by `pretrain_gpt` on
/// the fixture's passages, 64 positions: `eval_tasks` on the saved checkpoint gives
/// transformers' WikiText numbers on its HF export (`checkpoint_convert --saver hf`). Returns
/// the checkpoint's metadata and the export's `config.json`.
fn llama_model_evaluates_as_transformers(flags: &[&str]) -> (Value, Value) {
    let fixture = fixture();
    let dir = tempfile::tempdir().unwrap();
    let (checkpoint, hf) = (dir.path().join("ckpt"), dir.path().join("hf"));
    let data = fixture.lambada.with_file_name("lambada_text_document");
    run_ok(
        bin("pretrain_gpt")
            .args([
                "--num-layers",
                "2",
                "--hidden-size",
                "64",
                "--num-attention-heads",
                "4",
                "--group-query-attention",
                "--num-query-groups",
                "2",
                "--ffn-hidden-size",
                "128",
                "--seq-length",
                "64",
                "--max-position-embeddings",
                "64",
                "--normalization",
                "RMSNorm",
                "--swiglu",
                "--disable-bias-linear",
                "--untie-embeddings-and-output-weights",
                "--rotary-base",
                "10000",
                "--micro-batch-size",
                "4",
                "--global-batch-size",
                "4",
                "--train-iters",
                "10",
                "--lr",
                "5e-3",
                "--split",
                "100,0,0",
                "--eval-iters",
                "0",
                "--hidden-dropout",
                "0",
                "--attention-dropout",
                "0",
                "--device",
                "cpu",
                "--log-interval",
                "10",
                // No padding rows: Megatron's loss normalizes over them, the HF export drops them.
                "--make-vocab-size-divisible-by",
                "1",
            ])
            .args(flags)
            .arg("--data-path")
            .arg(&data)
            .arg("--save")
            .arg(&checkpoint)
            .args(tokenizer_flags()),
    );
    let metadata = read_json(&checkpoint.join("iter_0000010/metadata.json"));
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "megatron-rs",
                "--saver",
                "hf",
            ])
            .arg("--load-dir")
            .arg(&checkpoint)
            .arg("--save-dir")
            .arg(&hf)
            .args(&tokenizer_flags()[2..]),
    );
    let json = dir.path().join("results.json");
    run_ok(
        bin("eval_tasks")
            .arg("--load")
            .arg(&checkpoint)
            .args(tokenizer_flags())
            .args(["--device", "cpu", "--seq-length", "64"])
            .args(["--task", "WIKITEXT103", "--overlapping-eval", "32"])
            .arg("--valid-data")
            .arg(&fixture.wiki)
            .arg("--results-json")
            .arg(&json),
    );
    let ours = read_json(&json);
    let expected = reference_of(&hf, "64", "WIKITEXT103", &fixture.wiki, false);
    assert_eq!(ours["num_windows"], expected["num_windows"]);
    for key in ["loss_sum", "avg_loss", "ppl"] {
        assert_close(&ours, &expected, key);
    }
    (metadata, read_json(&hf.join("config.json")))
}

/// Qwen2-MoE-shaped: MoE layers (4 experts, top-2 of the softmax over all, not renormalised,
/// with a load-balancing loss) around a dense one, a shared expert with its sigmoid gate, QKV
/// biases: trained, evaluated and exported as `Qwen2MoeForCausalLM`.
#[test]
fn a_qwen2_moe_model_from_pretrain_gpt_evaluates_as_transformers() {
    let (metadata, exported) = llama_model_evaluates_as_transformers(&[
        "--position-embedding-type",
        "rope",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "48",
        "--moe-layer-freq",
        "[1,0]",
        "--moe-shared-expert-intermediate-size",
        "80",
        "--moe-shared-expert-gate",
        "--moe-router-pre-softmax",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--add-qkv-bias",
    ]);
    assert_eq!(exported["architectures"], json!(["Qwen2MoeForCausalLM"]));
    assert_eq!(exported["mlp_only_layers"], json!([1]));
    let moe = &metadata["model"]["moe"];
    assert_eq!(moe["shared_expert_gate"], true, "{metadata}");
    assert_eq!(moe["layer_pattern"], json!([true, false]), "{metadata}");
}

/// Qwen3-MoE-shaped: per-head query and key norms (`--qk-layernorm`), every layer an MoE of
/// 4 experts, top-2: trained, evaluated and exported as `Qwen3MoeForCausalLM`.
#[test]
fn a_qwen3_moe_model_from_pretrain_gpt_evaluates_as_transformers() {
    let (metadata, exported) = llama_model_evaluates_as_transformers(&[
        "--position-embedding-type",
        "rope",
        "--qk-layernorm",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "48",
    ]);
    assert_eq!(exported["architectures"], json!(["Qwen3MoeForCausalLM"]));
    assert_eq!(metadata["model"]["qk_layernorm"], true, "{metadata}");
}

#[test]
fn a_yarn_model_from_pretrain_gpt_evaluates_as_transformers() {
    scaled_rope_model_evaluates_as_transformers(
        &[
            "--position-embedding-type",
            "yarn",
            "--rotary-scaling-factor",
            "4",
            "--yarn-original-max-position-embeddings",
            "16",
        ],
        "yarn",
    );
}

#[test]
fn a_llama3_scaled_model_from_pretrain_gpt_evaluates_as_transformers() {
    scaled_rope_model_evaluates_as_transformers(
        &[
            "--position-embedding-type",
            "rope",
            "--use-rope-scaling",
            "--rope-scaling-factor",
            "4",
        ],
        "llama3",
    );
}

#[test]
fn a_linearly_interpolated_model_from_pretrain_gpt_evaluates_as_transformers() {
    scaled_rope_model_evaluates_as_transformers(
        &[
            "--position-embedding-type",
            "rope",
            "--rotary-seq-len-interpolation-factor",
            "2",
        ],
        "linear",
    );
}

/// Runs eval_tasks with `args` as two tensor-parallel processes; returns the results JSON.
fn two_ranks(fixture: &Fixture, args: &[&str], json: &Path) -> Value {
    run_job(2, "", |_| {
        let mut command = eval_tasks(fixture, args);
        command
            .args(["--tensor-model-parallel-size", "2", "--results-json"])
            .arg(json);
        command
    });
    read_json(json)
}

#[test]
fn two_tensor_parallel_processes_equal_one() {
    let fixture = fixture();
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("tp1.json");
    wikitext(fixture, &[], &single);
    let wiki = fixture.wiki.to_str().unwrap();
    let two = two_ranks(
        fixture,
        &[
            "--task",
            "WIKITEXT103",
            "--overlapping-eval",
            "32",
            "--eval-micro-batch-size",
            "3",
            "--valid-data",
            wiki,
        ],
        &dir.path().join("tp2.json"),
    );
    let one = read_json(&single);
    for key in ["loss_sum", "avg_loss", "ppl", "adjusted_ppl"] {
        assert_close(&two, &one, key);
    }

    let lambada = [
        "--task",
        "LAMBADA",
        "--strict-lambada",
        "--report",
        "both",
        "--eval-micro-batch-size",
        "5",
        "--valid-data",
        fixture.lambada.to_str().unwrap(),
    ];
    let single = dir.path().join("lambada1.json");
    run_ok(
        eval_tasks(fixture, &lambada)
            .arg("--results-json")
            .arg(&single),
    );
    let one = read_json(&single);
    let two = two_ranks(fixture, &lambada, &dir.path().join("lambada2.json"));
    for formulation in ["megatron_strict", "lm_eval"] {
        assert_eq!(two[formulation]["correct"], one[formulation]["correct"]);
        assert_eq!(two[formulation]["total"], one[formulation]["total"]);
        assert_close(&two[formulation], &one[formulation], "target_logprob_sum");
    }
}

fn fails_with(command: &mut Command, message: &str) {
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(message),
        "expected {message:?} in\n{stderr}"
    );
}

#[test]
fn megatron_model_flags_are_checked_and_bad_input_is_named() {
    let fixture = fixture();
    let dir = tempfile::tempdir().unwrap();
    let wiki = fixture.wiki.display().to_string();
    let task = ["--task", "WIKITEXT103", "--valid-data", wiki.as_str()];
    // Megatron's evaluation flags, architecture matching the checkpoint: accepted.
    let mut command = eval_tasks(fixture, &task);
    command.args([
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--max-position-embeddings",
        "128",
        "--micro-batch-size",
        "8",
        "--log-interval",
        "1",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
        "--use-flash-attn",
        "--no-load-optim",
    ]);
    let out = run_ok(&mut command);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("note: --use-flash-attn does not apply to eval_tasks; ignored"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("> working on iteration: 1"));
    fails_with(
        eval_tasks(fixture, &task).args(["--num-layers", "24"]),
        "--num-layers 24 does not match the checkpoint",
    );
    fails_with(
        eval_tasks(fixture, &task).args(["--hidden-size", "1024"]),
        "(64)",
    );
    let missing = dir.path().join("wiki.missing.tokens");
    fails_with(
        eval_tasks(fixture, &["--task", "WIKITEXT103"])
            .arg("--valid-data")
            .arg(&missing),
        "wiki.missing.tokens: No such file or directory",
    );
    fails_with(
        eval_tasks(fixture, &["--task", "LAMBADA"])
            .arg("--valid-data")
            .arg(dir.path()),
        "is a directory, not a data file",
    );
    let empty = dir.path().join("wiki.empty.tokens");
    std::fs::write(&empty, "").unwrap();
    fails_with(
        eval_tasks(fixture, &["--task", "WIKITEXT103"])
            .arg("--valid-data")
            .arg(&empty),
        "wiki.empty.tokens: the file is empty",
    );
    let out = eval_tasks(fixture, &["--task", "LAMBADA"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
    assert!(
        stderr.contains("give the data file with --valid-data"),
        "{stderr}"
    );
    fails_with(
        bin("eval_tasks")
            .args(["--task", "WIKITEXT103", "--valid-data", wiki.as_str()])
            .arg("--load")
            .arg(dir.path().join("nope"))
            .args(tokenizer_flags()),
        "no such checkpoint directory",
    );
}

/// lm-evaluation-harness (`lm_eval`, from PyPI) runs a local LAMBADA task (the lambada_openai
/// formulation over the fixture's passages, `dataset_path: json`, offline) against
/// `text_generation_server` through `local-completions`; its accuracy equals what eval_tasks
/// computes for the same formulation (`--report lm-eval`).
#[test]
fn lm_eval_through_the_server_equals_eval_tasks() {
    let fixture = fixture();
    let python = test_python(&["lm_eval", "transformers", "datasets", "tenacity", "aiohttp"]);
    let dir = tempfile::tempdir().unwrap();

    let json = dir.path().join("ours.json");
    let mut ours = eval_tasks(fixture, &["--task", "LAMBADA", "--report", "lm-eval"]);
    ours.arg("--valid-data")
        .arg(&fixture.lambada)
        .arg("--results-json")
        .arg(&json);
    run_ok(&mut ours);
    let ours = read_json(&json)["lm_eval"].clone();

    let tokenizer = dir.path().join("tokenizer");
    std::fs::create_dir(&tokenizer).unwrap();
    std::fs::copy(
        shared_dir().join("data/gpt2-tokenizer.json"),
        tokenizer.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        tokenizer.join("tokenizer_config.json"),
        r#"{"tokenizer_class": "GPT2TokenizerFast", "model_max_length": 128, "bos_token": "<|endoftext|>",
            "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}"#,
    )
    .unwrap();
    let tasks = dir.path().join("tasks");
    std::fs::create_dir(&tasks).unwrap();
    std::fs::write(
        tasks.join("lambada_local.yaml"),
        format!(
            "task: lambada_local\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\n\
             test_split: test\noutput_type: loglikelihood\n\
             doc_to_text: \"{{{{text.split(' ')[:-1]|join(' ')}}}}\"\n\
             doc_to_target: \"{{{{' '+text.split(' ')[-1]}}}}\"\n\
             metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n\
             \x20 - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n",
            fixture.lambada.display()
        ),
    )
    .unwrap();

    let mut server = bin("text_generation_server");
    server
        .arg("--load")
        .arg(&fixture.checkpoint)
        .args(tokenizer_flags())
        .args([
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-tokens-to-oom",
            "100000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut server = server.spawn().unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(server.stdout.take().unwrap()));
    let address = loop {
        let line = lines
            .next()
            .expect("the server exited before serving")
            .unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let output = dir.path().join("lm_eval_out");
    let run = Command::new(python)
        .args([
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
        ])
        .arg(format!(
            "base_url=http://{address}/v1/completions,tokenizer_backend=huggingface,tokenizer={},\
             model=megatron-rs,max_length=127,num_concurrent=1,max_retries=1",
            tokenizer.display()
        ))
        .args(["--tasks", "lambada_local", "--include_path"])
        .arg(&tasks)
        .arg("--output_path")
        .arg(&output)
        .env("HF_DATASETS_OFFLINE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HOME", dir.path().join("hf_home"))
        .output()
        .unwrap();
    unsafe { libc::kill(server.id() as i32, libc::SIGTERM) };
    let _ = server.wait();
    assert!(
        run.status.success(),
        "lm_eval failed\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let results = find_results(&output).expect("lm_eval wrote no results_*.json");
    let acc = read_json(&results)["results"]["lambada_local"]["acc,none"]
        .as_f64()
        .unwrap();
    let expected = ours["correct"].as_f64().unwrap() / ours["total"].as_f64().unwrap();
    assert!(
        (acc - expected).abs() < 1e-9,
        "lm_eval acc {acc}, eval_tasks {expected}"
    );
    // The log-likelihoods came through the server's echoed log-probabilities. The server
    // normalises over the true vocabulary (padding rows are never sampled), eval_tasks over
    // the padded one as Megatron does; the 47 padding rows move the perplexity by ~2e-4.
    let ppl = read_json(&results)["results"]["lambada_local"]["perplexity,none"]
        .as_f64()
        .unwrap();
    let expected = ours["perplexity"].as_f64().unwrap();
    assert!(
        (ppl - expected).abs() <= 1e-3 * expected,
        "lm_eval perplexity {ppl}, eval_tasks {expected}"
    );
}

fn find_results(dir: &Path) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_results(&path) {
                return Some(found);
            }
        } else if path.file_name()?.to_string_lossy().starts_with("results") {
            return Some(path);
        }
    }
    None
}
