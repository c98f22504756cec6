//! `pretrain_gpt` end to end on the CPU: it learns the bundled corpus, a resumed run is
//! bitwise identical to an uninterrupted one, and a run killed while saving leaves a loadable
//! checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use megatron_e2e::{bin, run_ok, workspace_root};

struct Corpus {
    _dir: tempfile::TempDir,
    prefix: PathBuf,
    vocab: PathBuf,
    merges: PathBuf,
}

/// The bundled corpus tokenized with the bundled tokenizer, as the quickstart does.
fn bundled_corpus() -> Corpus {
    let data = workspace_root().join("data");
    let dir = tempfile::tempdir().unwrap();
    let vocab = data.join("quickstart-vocab.json");
    let merges = data.join("quickstart-merges.txt");
    run_ok(
        bin("preprocess_data")
            .args(["--input"])
            .arg(data.join("corpus.jsonl"))
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

/// `lm loss` of every iteration from a metrics file, as exact JSON text.
fn losses(metrics: &Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            if record.get("split").is_some() {
                return None;
            }
            Some((
                record["iteration"].as_u64().unwrap(),
                record.get("lm loss")?.to_string(),
            ))
        })
        .collect()
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
    let values: Vec<f64> = losses(&metrics)
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

    assert_eq!(losses(&straight_metrics), losses(&resumed_metrics));
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
