//! `pretrain_gpt` end to end on the CPU: it learns the bundled corpus, a resumed run is
//! bitwise identical to an uninterrupted one, and a run killed while saving leaves a loadable
//! checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use megatron_e2e::{bin, metrics_losses, run_ok, workspace_root};

struct Corpus {
    _dir: tempfile::TempDir,
    prefix: PathBuf,
    vocab: PathBuf,
    merges: PathBuf,
}

/// The bundled corpus tokenized with the bundled tokenizer, as the quickstart does.
fn bundled_corpus() -> Corpus {
    corpus_of(
        &workspace_root().join("data").join("corpus.jsonl"),
        tempfile::tempdir().unwrap(),
    )
}

/// The bundled corpus `times` over, for splits as thin as Megatron's scripts' `949,50,1`.
fn repeated_corpus(times: usize) -> Corpus {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(workspace_root().join("data").join("corpus.jsonl")).unwrap();
    let input = dir.path().join("repeated.jsonl");
    std::fs::write(&input, text.repeat(times)).unwrap();
    corpus_of(&input, dir)
}

/// `input` tokenized with the bundled tokenizer into `dir`.
fn corpus_of(input: &Path, dir: tempfile::TempDir) -> Corpus {
    let data = workspace_root().join("data");
    let vocab = data.join("quickstart-vocab.json");
    let merges = data.join("quickstart-merges.txt");
    run_ok(
        bin("preprocess_data")
            .args(["--input"])
            .arg(input)
            .arg("--output-prefix")
            .arg(dir.path().join("corpus"))
            .args([
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--append-eod",
                "--workers",
                "1",
                "--vocab-file",
            ])
            .arg(&vocab)
            .arg("--merge-file")
            .arg(&merges),
    );
    let prefix = dir.path().join("corpus_text_document");
    Corpus {
        _dir: dir,
        prefix,
        vocab,
        merges,
    }
}

/// A tiny GPT on the corpus; `extra` adds or overrides flags.
fn pretrain(corpus: &Corpus, extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args([
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
        ])
        .args([
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "8",
            "--lr",
            "3e-3",
            "--min-lr",
            "3e-4",
        ])
        .args([
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-iters",
            "2",
            "--split",
            "98,2,0",
            "--log-interval",
            "5",
        ])
        .args([
            "--eval-interval",
            "1000",
            "--eval-iters",
            "1",
            "--device",
            "cpu",
            "--deterministic-mode",
        ])
        .arg("--data-path")
        .arg(&corpus.prefix)
        .arg("--vocab-file")
        .arg(&corpus.vocab)
        .arg("--merge-file")
        .arg(&corpus.merges)
        .args(extra);
    command
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn a_tiny_gpt_learns_the_bundled_corpus() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let flags = [
        "--hidden-size",
        "64",
        "--seq-length",
        "64",
        "--lr",
        "1e-2",
        "--min-lr",
        "1e-3",
        "--train-iters",
        "100",
    ];
    let out = run_ok(pretrain(&corpus, &flags).args(["--metrics-file", path_str(&metrics)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("iteration      100/     100 | consumed samples:          800 |"),
        "{stdout}"
    );
    let values: Vec<f64> = metrics_losses(&metrics)
        .iter()
        .map(|(_, v)| v.parse().unwrap())
        .collect();
    assert_eq!(values.len(), 100);
    let first: f64 = values[..3].iter().sum::<f64>() / 3.0;
    let last: f64 = values[95..].iter().sum::<f64>() / 5.0;
    // A uniform guess over the 4096-token vocabulary costs ln(4096) = 8.3 nats; 100 steps of
    // this model reach about 6.2.
    assert!((first - 4096f64.ln()).abs() < 0.5, "initial loss {first}");
    assert!(last < first - 1.5, "loss went from {first} to {last}");
}

#[test]
fn resuming_is_bitwise_identical_to_an_uninterrupted_run() {
    assert_bitwise_resume(&[]);
}

#[test]
fn resuming_with_the_fused_cross_entropy_is_bitwise_identical() {
    assert_bitwise_resume(&["--cross-entropy-loss-fusion"]);
}

/// Six steps straight and three + three through a checkpoint give the same losses and the same
/// bytes of weights, optimizer state and random generators.
fn assert_bitwise_resume(flags: &[&str]) {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let (straight, resumed) = (dir.path().join("straight"), dir.path().join("resumed"));
    let mut common = vec!["--train-iters", "6", "--save-interval", "3"];
    common.extend(flags);

    let straight_metrics = dir.path().join("straight.jsonl");
    run_ok(pretrain(&corpus, &common).args([
        "--save",
        path_str(&straight),
        "--metrics-file",
        path_str(&straight_metrics),
    ]));

    let resumed_metrics = dir.path().join("resumed.jsonl");
    let first = run_ok(pretrain(&corpus, &common).args([
        "--save",
        path_str(&resumed),
        "--exit-interval",
        "3",
        "--metrics-file",
        path_str(&resumed_metrics),
    ]));
    assert!(String::from_utf8_lossy(&first.stdout).contains("exit-interval"));
    let second = run_ok(pretrain(&corpus, &common).args([
        "--save",
        path_str(&resumed),
        "--load",
        path_str(&resumed),
        "--metrics-file",
        path_str(&resumed_metrics),
    ]));
    let resumed_line = format!(
        "  successfully loaded checkpoint from {} [ t 1/1, p 1/1 ] at iteration 3",
        path_str(&resumed)
    );
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(stdout.lines().any(|line| line == resumed_line), "{stdout}");

    assert_eq!(
        metrics_losses(&straight_metrics),
        metrics_losses(&resumed_metrics)
    );
    for file in [
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
    ] {
        let read =
            |root: &Path| std::fs::read(root.join("iter_0000006/mp_rank_00").join(file)).unwrap();
        assert!(
            read(&straight) == read(&resumed),
            "{file} differs between the straight and the resumed run"
        );
    }
}

#[test]
fn a_run_killed_while_saving_resumes_from_the_previous_checkpoint() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    // A wider model makes every save long enough to be caught in the middle.
    let schedule = [
        "--hidden-size",
        "256",
        "--train-iters",
        "1000",
        "--save-interval",
        "1",
    ];
    let mut child = pretrain(&corpus, &schedule)
        .args(["--save", path_str(&save)])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut caught = false;
    while Instant::now() < deadline && !caught {
        let staging = std::fs::read_dir(&save)
            .ok()
            .into_iter()
            .flatten()
            .flatten()
            .any(|entry| {
                let name = entry.file_name().to_string_lossy().into_owned();
                name.starts_with(".iter_")
                    && name.ends_with(".tmp")
                    && entry.path().join("mp_rank_00").exists()
            });
        if staging && save.join("latest_checkpointed_iteration.txt").exists() {
            child.kill().unwrap();
            caught = true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = child.kill();
    child.wait().unwrap();
    assert!(caught, "never saw a save in progress");

    let tracked: u64 = std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let resumed = run_ok(pretrain(&corpus, &schedule).args([
        "--exit-interval",
        &(tracked + 1).to_string(),
        "--load",
        path_str(&save),
        "--save",
        path_str(&save),
    ]));
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        stdout.contains(&format!(
            "successfully loaded checkpoint from {} [ t 1/1, p 1/1 ] at iteration {tracked}",
            path_str(&save)
        )),
        "{stdout}"
    );
    let leftovers: Vec<String> = std::fs::read_dir(&save)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".iter_"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "staging directories left behind: {leftovers:?}"
    );
}

#[test]
fn bad_flags_and_inputs_are_named() {
    let corpus = bundled_corpus();
    let out = pretrain(
        &corpus,
        &["--train-iters", "2", "--lr-decay-style", "wiggly"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("wiggly"));
    let out = pretrain(
        &corpus,
        &["--train-iters", "2", "--num-attention-heads", "5"],
    )
    .output()
    .unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--num-attention-heads"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = bin("pretrain_gpt")
        .args([
            "--num-layers",
            "1",
            "--hidden-size",
            "8",
            "--num-attention-heads",
            "2",
            "--seq-length",
            "8",
        ])
        .args([
            "--micro-batch-size",
            "1",
            "--lr",
            "1e-3",
            "--train-iters",
            "1",
            "--data-path",
            "/nonexistent/corpus",
        ])
        .arg("--vocab-file")
        .arg(&corpus.vocab)
        .arg("--merge-file")
        .arg(&corpus.merges)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/corpus"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn sigterm_saves_and_exits_cleanly() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    let mut child = pretrain(&corpus, &["--train-iters", "100000", "--log-interval", "1"])
        .args(["--save", path_str(&save), "--save-interval", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("iteration        3/") {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut stdout, &mut line).unwrap() > 0,
            "training stopped early"
        );
    }
    // SAFETY: plain kill(2) of our own child.
    assert_eq!(
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) },
        0
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}: {rest}");
    let stopped: u64 = rest
        .lines()
        .find_map(|l| {
            l.strip_prefix("exiting at iteration ")?
                .strip_suffix(" (signal)")?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no exit line in {rest}"));
    let tracked = std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt")).unwrap();
    assert_eq!(tracked.trim(), stopped.to_string());
    assert!(save
        .join(format!("iter_{stopped:07}/mp_rank_00/model.safetensors"))
        .exists());
}

#[test]
fn the_pytorch_profiler_traces_the_chosen_iterations() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let board = dir.path().join("board");
    let out = run_ok(&mut pretrain(
        &corpus,
        &[
            "--train-iters",
            "5",
            "--profile",
            "--use-pytorch-profiler",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "3",
            "--tensorboard-dir",
            path_str(&board),
        ],
    ));
    let trace_path = board.join("trace_rank0_iter1-3.json");
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains(&format!("profiler trace saved to {}", trace_path.display())),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let trace: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace_path).unwrap()).unwrap();
    let names: Vec<&str> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["name"].as_str())
        .collect();
    let count = |name: &str| names.iter().filter(|n| **n == name).count();
    // Each step runs fused AdamW once per parameter group (with and without weight decay): the
    // window holds exactly iterations 2 and 3.
    assert_eq!(count("aten::_fused_adamw_"), 2 * 2);
    // Backward runs on autograd's threads, which the trace follows too.
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("autograd::engine::evaluate_function")),
        "no backward operators in the trace"
    );
    assert!(count("aten::mm") + count("aten::addmm") > 0);
}

#[test]
fn profiler_flags_that_cannot_work_are_refused() {
    let corpus = bundled_corpus();
    let out = pretrain(&corpus, &["--train-iters", "3", "--profile"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("add --use-pytorch-profiler"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = pretrain(
        &corpus,
        &["--train-iters", "3", "--profile", "--use-pytorch-profiler"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--tensorboard-dir"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The logging flags of Megatron's scripts: zeros in the gradient and the parameter norm in the
/// log line and metrics, the test set's result in the metrics, and the flags that change
/// nothing here each noted once.
#[test]
fn logging_flags_of_megatron_scripts_are_honoured_or_noted() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    let flags = [
        "--train-iters",
        "2",
        "--lr-warmup-iters",
        "0",
        "--log-interval",
        "1",
        "--split",
        "90,5,5",
        "--untie-embeddings-and-output-weights",
        "--log-num-zeros-in-grad",
        "--log-params-norm",
        "--log-validation-ppl-to-tensorboard",
        "--log-world-size-to-tensorboard",
        "--manual-gc",
        "--manual-gc-interval",
        "100",
        "--no-mmap-bin-files",
        "--context-parallel-size",
        "1",
        "--use-rotary-position-embeddings",
    ];
    let out = run_ok(pretrain(&corpus, &flags).args(["--metrics-file", path_str(&metrics)]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for flag in [
        "--manual-gc ",
        "--manual-gc-interval",
        "--no-mmap-bin-files",
    ] {
        let note = format!("note: {flag}");
        assert_eq!(stderr.matches(&note).count(), 1, "{flag}: {stderr}");
    }
    assert_eq!(stderr.matches("note: ").count(), 5, "{stderr}");
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    // Each step sees at most 8 x 32 distinct tokens, so every other row of the untied 4096 x 32
    // input embedding has a zero gradient.
    let floor = ((4096 - 8 * 32) * 32) as f64;
    for iteration in [1, 2] {
        let record = records
            .iter()
            .find(|r| r["iteration"] == iteration && r.get("split").is_none())
            .unwrap_or_else(|| panic!("no record of iteration {iteration}: {records:?}"));
        let zeros = record["num-zeros"].as_f64().unwrap();
        assert!(zeros >= floor, "num-zeros {zeros} below {floor}");
        assert!(record["params-norm"].as_f64().unwrap() > 0.0, "{record}");
        let line = format!("iteration        {iteration}/       2 |");
        let logged = stdout.lines().find(|l| l.contains(&line)).unwrap();
        assert!(
            logged.contains(&format!("num zeros: {zeros} |")),
            "{logged}"
        );
    }
    let test = records
        .iter()
        .find(|r| r["split"] == "test")
        .unwrap_or_else(|| panic!("no test-set record: {records:?}"));
    let logged_test = stdout.lines().find(|l| l.contains("on test set")).unwrap();
    let printed: f64 = logged_test
        .split("lm loss value: ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no test loss in {logged_test:?}"));
    let recorded = test["lm loss"].as_f64().unwrap();
    assert!(
        (printed - recorded).abs() <= 1e-6 * recorded,
        "{printed} vs {recorded}"
    );
}

/// Megatron core_v0.14.0's `examples/gpt3/train_gpt3_175b_distributed.sh` at tiny CPU scale:
/// every flag it passes, in its order, with the sizes shrunk (96 layers → 2, 1536 samples per
/// batch → 8) and the intervals scaled so that a save and an evaluation happen. `schedule`
/// replaces the script's `--rampup-batch-size 16 16 5859375 --train-iters 500000` and
/// `--lr-decay-iters 430000`.
fn gpt3_175b_script(
    corpus: &Corpus,
    checkpoint: &Path,
    tensorboard: &Path,
    schedule: [&[&str]; 2],
) -> Command {
    let [training, decay] = schedule;
    let mut command = bin("pretrain_gpt");
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
        .args(["--attention-backend", "auto"])
        .args(["--micro-batch-size", "1", "--global-batch-size", "8"])
        .args(training)
        .args([
            "--weight-decay",
            "0.1",
            "--adam-beta1",
            "0.9",
            "--adam-beta2",
            "0.95",
        ])
        .args(["--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16"])
        .args([
            "--lr",
            "6.0e-5",
            "--lr-decay-style",
            "cosine",
            "--min-lr",
            "6.0e-6",
        ])
        .args(["--lr-warmup-fraction", ".001"])
        .args(decay)
        .args([
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "1",
        ])
        .arg("--data-path")
        .arg(&corpus.prefix)
        .arg("--vocab-file")
        .arg(&corpus.vocab)
        .arg("--merge-file")
        .arg(&corpus.merges)
        .args(["--split", "949,50,1"])
        .args([
            "--log-interval",
            "1",
            "--save-interval",
            "2",
            "--eval-interval",
            "2",
        ])
        .arg("--save")
        .arg(checkpoint)
        .arg("--load")
        .arg(checkpoint)
        .args(["--eval-iters", "1"])
        .arg("--tensorboard-dir")
        .arg(tensorboard)
        // Not in the script: the run is pinned to the CPU whatever the machine has.
        .args(["--device", "cpu"]);
    command
}

/// Megatron core_v0.14.0's `examples/llama/train_llama3_8b_h100_fp8.sh` at tiny CPU scale, on
/// its default branch (mock data, NullTokenizer): every flag it passes, in its order, with the
/// sizes shrunk (32 layers → 2, 8192 tokens → 64, 128 samples per batch → 8, 128256 tokens of
/// vocabulary → 1024) and the intervals scaled to a 3-iteration run.
fn llama3_8b_fp8_script(cache: &Path, checkpoint: &Path, tensorboard: &Path) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args([
            "--use-mcore-models",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
        ])
        .args(["--ffn-hidden-size", "128", "--num-attention-heads", "4"])
        .args([
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--kv-channels",
            "16",
        ])
        .args(["--seq-length", "64", "--max-position-embeddings", "64"])
        .args([
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "1000000",
        ])
        .args([
            "--rotary-percent",
            "1.0",
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0.0",
        ])
        .args([
            "--swiglu",
            "--init-method-std",
            "0.0134",
            "--attention-backend",
            "fused",
        ])
        .args([
            "--apply-layernorm-1p",
            "--untie-embeddings-and-output-weights",
        ])
        .args(["--disable-bias-linear"])
        .args([
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "8",
            "--train-samples",
            "24",
        ])
        .args([
            "--lr-decay-samples",
            "20",
            "--lr-warmup-samples",
            "4",
            "--lr",
            "0.00015",
        ])
        .args([
            "--min-lr",
            "0.00001",
            "--decoupled-lr",
            "5.0e-4",
            "--decoupled-min-lr",
            "4.5e-5",
        ])
        .args([
            "--lr-decay-style",
            "cosine",
            "--clip-grad",
            "1.0",
            "--weight-decay",
            "0.1",
        ])
        .args([
            "--adam-beta1",
            "0.9",
            "--adam-beta2",
            "0.95",
            "--bf16",
            "--grad-reduce-in-bf16",
        ])
        .args([
            "--cross-entropy-loss-fusion",
            "--calculate-per-token-loss",
            "--manual-gc",
        ])
        .args([
            "--empty-unused-memory-level",
            "1",
            "--exit-duration-in-mins",
            "235",
        ])
        .args([
            "--use-distributed-optimizer",
            "--overlap-grad-reduce",
            "--overlap-param-gather",
        ])
        .args(["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"])
        .args(["--fp8-amax-compute-algo", "max", "--fp8-param-gather"])
        .args([
            "--tensor-model-parallel-size",
            "1",
            "--context-parallel-size",
            "1",
        ])
        .args(["--sequence-parallel"])
        .args([
            "--mock-data",
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "1024",
        ])
        .arg("--data-cache-path")
        .arg(cache)
        // The script's array expansion passes the quotes through: the value is `'99,1,0'`.
        .args(["--tiktoken-pattern", "v2", "--split", "'99,1,0'"])
        .args([
            "--no-create-attention-mask-in-dataloader",
            "--no-mmap-bin-files",
        ])
        .args(["--num-workers", "1"])
        .args([
            "--log-interval",
            "1",
            "--eval-iters",
            "1",
            "--eval-interval",
            "2",
        ])
        .args(["--save-interval", "2", "--log-throughput"])
        .args([
            "--profile",
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "2",
        ])
        // Not in the script: Megatron's --profile is nsys's capture range on a GPU; on the CPU
        // the trace comes from libtorch's profiler.
        .arg("--use-pytorch-profiler")
        .args([
            "--ckpt-format",
            "torch_dist",
            "--distributed-timeout-minutes",
            "60",
        ])
        .arg("--save")
        .arg(checkpoint)
        .arg("--load")
        .arg(checkpoint)
        .arg("--tensorboard-dir")
        .arg(tensorboard)
        .args(["--device", "cpu"]);
    command
}

/// Runs a script's flag set twice as the script would be run twice with the same checkpoint
/// directory: the first run stops after iteration 2 (`--exit-interval 2`, saving), the second
/// resumes there and trains to `last_iteration`, saving at the end.
fn assert_starts_saves_and_resumes(
    mut script: impl FnMut() -> Command,
    checkpoint: &Path,
    last_iteration: u64,
    what: &str,
) {
    let first = run_ok(script().args(["--exit-interval", "2"]));
    let stdout = String::from_utf8_lossy(&first.stdout);
    assert!(
        stdout.contains("iteration        2/"),
        "{what}, first run: {stdout}"
    );
    let tracker = checkpoint.join("latest_checkpointed_iteration.txt");
    assert_eq!(
        std::fs::read_to_string(&tracker).unwrap().trim(),
        "2",
        "{what}"
    );
    let second = run_ok(&mut script());
    let stdout = String::from_utf8_lossy(&second.stdout);
    let loaded = format!(
        "successfully loaded checkpoint from {} [ t 1/1, p 1/1 ] at iteration 2",
        checkpoint.display()
    );
    assert!(stdout.contains(&loaded), "{what}, second run: {stdout}");
    assert!(
        !stdout.contains("iteration        1/"),
        "{what} trained iteration 1 again: {stdout}"
    );
    let last = format!("iteration        {last_iteration}/       {last_iteration} |");
    assert!(stdout.contains(&last), "{what}, second run: {stdout}");
    assert_eq!(
        std::fs::read_to_string(&tracker).unwrap().trim(),
        last_iteration.to_string(),
        "{what}"
    );
}

#[test]
fn the_gpt3_175b_script_flag_set_trains_saves_and_resumes() {
    // Enough documents that the script's 1/1000 test split holds one.
    let corpus = repeated_corpus(8);
    // As Megatron (validate_args), the script's literal rampup with --train-iters is refused.
    let dir = tempfile::tempdir().unwrap();
    let literal = gpt3_175b_script(
        &corpus,
        &dir.path().join("checkpoint"),
        &dir.path().join("tensorboard"),
        [
            &["--rampup-batch-size", "4", "4", "8", "--train-iters", "3"],
            &["--lr-decay-iters", "3"],
        ],
    )
    .output()
    .unwrap();
    assert_eq!(literal.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&literal.stderr)
            .contains("--rampup-batch-size needs sample-based training"),
        "{}",
        String::from_utf8_lossy(&literal.stderr)
    );
    // Sample-based with the ramp (batches of 4, 4, 8, 8: four iterations), and iteration-based
    // without it.
    let variants: [(&str, [&[&str]; 2], u64); 2] = [
        (
            "samples with rampup",
            [
                &[
                    "--rampup-batch-size",
                    "4",
                    "4",
                    "8",
                    "--train-samples",
                    "24",
                ],
                &["--lr-decay-samples", "24"],
            ],
            4,
        ),
        (
            "iterations",
            [&["--train-iters", "3"], &["--lr-decay-iters", "3"]],
            3,
        ),
    ];
    for (what, schedule, last_iteration) in variants {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("checkpoint");
        let tensorboard = dir.path().join("tensorboard");
        assert_starts_saves_and_resumes(
            || gpt3_175b_script(&corpus, &checkpoint, &tensorboard, schedule),
            &checkpoint,
            last_iteration,
            what,
        );
    }
}

#[test]
fn the_llama3_8b_fp8_script_flag_set_trains_saves_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let checkpoint = dir.path().join("checkpoint");
    let tensorboard = dir.path().join("tensorboard");
    assert_starts_saves_and_resumes(
        || llama3_8b_fp8_script(&cache, &checkpoint, &tensorboard),
        &checkpoint,
        3,
        "llama3 8b fp8",
    );
    // The rate logged after iteration k is the one for the next step, at 8k samples: warm-up
    // ends at 4 samples, then cosine from the decoupled peak to its floor over 16 more.
    let cosine = |samples: f64| {
        let ratio = ((samples - 4.0) / 16.0_f64).min(1.0);
        4.5e-5 + 0.5 * ((std::f64::consts::PI * ratio).cos() + 1.0) * (5.0e-4 - 4.5e-5)
    };
    let metrics = std::fs::read_to_string(tensorboard.join("metrics.jsonl")).unwrap();
    let mut logged = 0;
    for record in metrics
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|record| record.get("split").is_none())
    {
        let iteration = record["iteration"].as_u64().unwrap();
        let rate = record["decoupled-learning-rate"]
            .as_f64()
            .unwrap_or_else(|| panic!("{record}"));
        let expected = cosine(8.0 * iteration as f64);
        assert!(
            (rate - expected).abs() <= 1e-15,
            "iteration {iteration}: {rate} vs {expected}"
        );
        logged += 1;
    }
    assert!(logged >= 1, "{metrics}");
}

/// `--log-memory-to-tensorboard`: on a CPU a note and no memory scalars; on a GPU (when there
/// is one) the caching allocator's four statistics under Megatron's tags, every iteration.
#[test]
fn memory_statistics_are_logged_on_a_gpu_and_noted_on_the_cpu() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let tags = [
        "mem-reserved-bytes",
        "mem-allocated-bytes",
        "mem-max-allocated-bytes",
        "mem-allocated-count",
    ];
    let records = |metrics: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(metrics)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .filter(|record: &serde_json::Value| record.get("split").is_none())
            .collect()
    };
    let flags = [
        "--train-iters",
        "2",
        "--lr-warmup-iters",
        "0",
        "--log-memory-to-tensorboard",
    ];
    let cpu = dir.path().join("cpu.jsonl");
    let out = run_ok(pretrain(&corpus, &flags).args(["--metrics-file", path_str(&cpu)]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr
            .matches("note: --log-memory-to-tensorboard writes nothing on the CPU")
            .count(),
        1,
        "{stderr}"
    );
    let cpu_records = records(&cpu);
    assert_eq!(cpu_records.len(), 2);
    for record in &cpu_records {
        assert!(
            tags.iter().all(|tag| record.get(*tag).is_none()),
            "{record}"
        );
    }
    if megatron_e2e::visible_gpus() == 0 {
        return;
    }
    let gpu = dir.path().join("gpu.jsonl");
    run_ok(pretrain(&corpus, &flags).args(["--device", "cuda", "--metrics-file", path_str(&gpu)]));
    let gpu_records = records(&gpu);
    assert_eq!(gpu_records.len(), 2);
    for record in &gpu_records {
        let value = |tag: &str| {
            record[tag]
                .as_f64()
                .unwrap_or_else(|| panic!("{tag}: {record}"))
        };
        for tag in tags {
            assert!(value(tag) > 0.0, "{tag}: {record}");
        }
        assert!(
            value("mem-max-allocated-bytes") >= value("mem-allocated-bytes"),
            "{record}"
        );
        assert!(
            value("mem-reserved-bytes") >= value("mem-allocated-bytes"),
            "{record}"
        );
    }
}

/// `--use-checkpoint-args`: the architecture flags recorded in the checkpoint replace the
/// command line's, so a resume that leaves them out loads the checkpoint; without the flag the
/// same command line is refused for building another architecture.
#[test]
fn checkpoint_args_replace_the_architecture_flags() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("checkpoint");
    let save = [
        "--save",
        path_str(&checkpoint),
        "--load",
        path_str(&checkpoint),
        "--lr-warmup-iters",
        "0",
    ];
    let architecture = [
        "--swiglu",
        "--normalization",
        "RMSNorm",
        "--untie-embeddings-and-output-weights",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--ffn-hidden-size",
        "48",
        "--position-embedding-type",
        "yarn",
        "--rotary-scaling-factor",
        "4",
        "--yarn-beta-fast",
        "8",
    ];
    run_ok(&mut pretrain(
        &corpus,
        &[
            &save[..],
            &architecture,
            &["--train-iters", "3", "--exit-interval", "2"],
        ]
        .concat(),
    ));
    let plain = [&save[..], &["--train-iters", "3", "--log-interval", "1"]].concat();
    let refused = pretrain(&corpus, &plain).output().unwrap();
    assert!(!refused.status.success(), "loaded another architecture");
    let out = run_ok(&mut pretrain(
        &corpus,
        &[&plain[..], &["--use-checkpoint-args"]].concat(),
    ));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in [
        "Setting swiglu to True from checkpoint",
        "Setting normalization to RMSNorm from checkpoint",
        "Setting untie_embeddings_and_output_weights to True from checkpoint",
        "Setting num_query_groups to 2 from checkpoint",
        "Setting ffn_hidden_size to 48 from checkpoint",
        "Setting position_embedding_type to yarn from checkpoint",
        "Setting rotary_scaling_factor to 4.0 from checkpoint",
        "Setting yarn_beta_fast to 8.0 from checkpoint",
    ] {
        assert_eq!(stdout.matches(line).count(), 1, "{line}: {stdout}");
    }
    assert!(stdout.contains("at iteration 2"), "{stdout}");
    assert!(stdout.contains("iteration        3/       3 |"), "{stdout}");
}

/// Megatron main's `--step-batch-size-schedule`: thresholds in tokens (64 tokens of sequences
/// of 16 are 4 samples) set the global batch by the samples trained on, and the iterations of
/// `--train-samples` are counted along it; it replaces `--global-batch-size`.
#[test]
fn a_step_batch_size_schedule_sets_the_batch_by_the_tokens_trained() {
    let flags = [
        "--num-layers",
        "1",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "16",
        "--max-position-embeddings",
        "16",
        "--micro-batch-size",
        "2",
        "--train-samples",
        "20",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "64",
        "--lr",
        "1e-3",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--device",
        "cpu",
        "--step-batch-size-schedule",
        "0:4 64:8",
    ];
    let out = run_ok(bin("pretrain_gpt").args(flags));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let batches: Vec<&str> = stdout
        .lines()
        .filter_map(|line| line.split("global batch size:").nth(1))
        .map(|rest| rest.split('|').next().unwrap().trim())
        .collect();
    // 4 samples at 4, then 8 and 8: 20 samples in 3 iterations.
    assert_eq!(batches, ["4", "8", "8"], "{stdout}");
    assert!(stdout.contains("iteration        3/       3"), "{stdout}");

    let out = bin("pretrain_gpt")
        .args(flags)
        .args(["--global-batch-size", "8"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--global-batch-size"), "{stderr}");
}

#[test]
fn a_repeated_data_path_takes_its_last_list_and_checkpoints_record_the_data() {
    let corpus = bundled_corpus();
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("ckpt");
    // The helper's own --data-path comes first; the later lists replace it, as in argparse.
    let prefix = path_str(&corpus.prefix);
    run_ok(
        pretrain(&corpus, &["--train-iters", "4", "--save", path_str(&save)]).args([
            "--data-path",
            "/nonexistent/a",
            "/nonexistent/b",
            "--data-path",
            "3",
            prefix,
            "1",
            prefix,
        ]),
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&std::fs::read(save.join("iter_0000004/metadata.json")).unwrap())
            .unwrap();
    assert_eq!(
        metadata["data"],
        serde_json::json!({
            "mode": "blend",
            "data_path": [
                {"prefix": prefix, "weight": 0.75},
                {"prefix": prefix, "weight": 0.25},
            ],
            "split": "98,2,0",
            "splits": [
                {"split": "train", "begin": 0.0, "end": 0.98},
                {"split": "valid", "begin": 0.98, "end": 1.0},
            ],
        })
    );
}

#[test]
fn training_flags_outside_their_range_are_usage_errors_naming_flag_and_value() {
    let corpus = bundled_corpus();
    for (flag, value, wanted) in [
        ("--lr", "-1", "must be a finite number ≥ 0, got -1"),
        ("--lr", "inf", "must be a finite number ≥ 0, got inf"),
        ("--lr", "-inf", "must be a finite number ≥ 0, got -inf"),
        (
            "--min-lr",
            "-1e-5",
            "must be a finite number ≥ 0, got -1e-5",
        ),
        ("--clip-grad", "nan", "must be a finite number ≥ 0, got nan"),
        (
            "--weight-decay",
            "-0.1",
            "must be a finite number ≥ 0, got -0.1",
        ),
        ("--adam-beta1", "1", "must be a number in [0, 1), got 1"),
        (
            "--adam-beta2",
            "-0.5",
            "must be a number in [0, 1), got -0.5",
        ),
        ("--adam-eps", "0", "must be a finite number > 0, got 0"),
        (
            "--init-method-std",
            "-0.02",
            "must be a finite number ≥ 0, got -0.02",
        ),
        (
            "--hidden-dropout",
            "1.5",
            "must be a number in [0, 1], got 1.5",
        ),
        (
            "--attention-dropout",
            "-0.1",
            "must be a number in [0, 1], got -0.1",
        ),
        (
            "--lr-warmup-fraction",
            "2",
            "must be a number in [0, 1], got 2",
        ),
        ("--loss-scale", "0", "must be a finite number > 0, got 0"),
        (
            "--micro-batch-size",
            "0",
            "must be a whole number ≥ 1, got 0",
        ),
        (
            "--global-batch-size",
            "-8",
            "must be a whole number ≥ 1, got -8",
        ),
    ] {
        let out = pretrain(&corpus, &["--train-iters", "2", flag, value])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {value}: {stderr}");
        assert!(
            stderr.contains(&format!("invalid value '{value}' for '{flag} <"))
                && stderr.contains(wanted),
            "{flag} {value}: {stderr}"
        );
    }
}
