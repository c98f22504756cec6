//! `generate_samples_t5` end to end on the CPU: a tiny T5 trained by `pretrain_t5` on the shared
//! corpus is scored on its validation samples, and the total equals the validation loss the
//! training run reported for the same weights and samples (two tensor-parallel processes give
//! the same); its spans are decoded from data samples and from `--input` texts; bad input is a
//! clear error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use megatron_e2e::{bin, run_job, run_ok, shared_dir};

fn vocab() -> PathBuf {
    shared_dir().join("data/bert-large-uncased-vocab.txt")
}

struct Fixture {
    _dir: tempfile::TempDir,
    data: PathBuf,
    checkpoint: PathBuf,
    /// The `lm loss value` of the run's final validation.
    validation_loss: f64,
}

/// The shared small corpus split into sentences, and a tiny T5 trained on it for 4 steps,
/// evaluated on 8 validation samples (one global batch) at the end.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_ok(
            bin("preprocess_data")
                .arg("--input")
                .arg(shared_dir().join("golden/preprocess/small_corpus.jsonl"))
                .arg("--output-prefix")
                .arg(dir.path().join("corpus"))
                .args([
                    "--tokenizer-type",
                    "BertWordPieceLowerCase",
                    "--workers",
                    "1",
                    "--split-sentences",
                ])
                .arg("--vocab-file")
                .arg(vocab())
                .arg("--punkt-dir")
                .arg(shared_dir().join("data/punkt_tab_english")),
        );
        let data = dir.path().join("corpus_text_sentence");
        let checkpoint = dir.path().join("ckpt");
        let out = run_ok(
            bin("pretrain_t5")
                .args(["--encoder-num-layers", "2", "--decoder-num-layers", "1"])
                .args(["--hidden-size", "32", "--num-attention-heads", "4"])
                .args(["--encoder-seq-length", "48", "--decoder-seq-length", "24"])
                .args([
                    "--max-position-embeddings",
                    "48",
                    "--vocab-extra-ids",
                    "100",
                ])
                .args(["--micro-batch-size", "4", "--global-batch-size", "8"])
                .args(["--lr", "5e-3", "--train-iters", "4", "--eval-iters", "1"])
                .args(["--eval-interval", "1000", "--device", "cpu"])
                .args(["--split", "949,50,1", "--seed", "1234"])
                .arg("--vocab-file")
                .arg(vocab())
                .arg("--data-path")
                .arg(&data)
                .arg("--save")
                .arg(&checkpoint),
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find(|l| l.contains("on validation set | lm loss value: "))
            .unwrap_or_else(|| panic!("no validation line in {stdout}"));
        let value = line.split("lm loss value: ").nth(1).unwrap();
        let validation_loss = value[..value.find(' ').unwrap()].parse().unwrap();
        Fixture {
            _dir: dir,
            data,
            checkpoint,
            validation_loss,
        }
    })
}

/// `generate_samples_t5 <subcommand>` on the fixture's checkpoint with the training data flags.
fn tool(subcommand: &str, fixture: &Fixture) -> Command {
    let mut command = bin("generate_samples_t5");
    command
        .arg(subcommand)
        .arg("--load")
        .arg(&fixture.checkpoint)
        .args(["--device", "cpu", "--vocab-extra-ids", "100"])
        .arg("--vocab-file")
        .arg(vocab())
        .arg("--data-path")
        .arg(&fixture.data)
        .args(["--split", "949,50,1", "--encoder-seq-length", "48"])
        .args(["--decoder-seq-length", "24"]);
    command
}

/// The number after `key ` in the summary line of `stdout`.
fn summary_value(stdout: &str, key: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("generate_samples_t5: "))
        .unwrap_or_else(|| panic!("no summary in {stdout}"));
    let rest = line.split(key).nth(1).unwrap_or_else(|| panic!("{line}"));
    rest.trim_start()
        .split([',', ' '])
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn scores_equal_the_validation_loss_training_reported() {
    let fixture = fixture();
    let out = run_ok(tool("score", fixture).args(["--num-samples", "8"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let scored = summary_value(&stdout, "lm loss");
    eprintln!(
        "scored {scored}, training's validation {}",
        fixture.validation_loss
    );
    assert!(
        (scored - fixture.validation_loss).abs() < 2e-6 * fixture.validation_loss,
        "{stdout}"
    );
    assert!(stdout.contains("8 valid samples"), "{stdout}");
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.trim_start().starts_with(char::is_numeric))
            .count(),
        8,
        "{stdout}"
    );

    // JSON lines: one per sample, whose targets and losses make up the total.
    let out = run_ok(
        tool("score", fixture)
            .args(["--num-samples", "8", "--jsonl"])
            .args(["--micro-batch-size", "3"]),
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8);
    let tokens: f64 = rows.iter().map(|r| r["tokens"].as_f64().unwrap()).sum();
    let loss_sum: f64 = rows.iter().map(|r| r["loss_sum"].as_f64().unwrap()).sum();
    assert!((loss_sum / tokens - fixture.validation_loss).abs() < 2e-6 * scored);
    assert!(rows
        .iter()
        .all(|r| (0.0..=1.0).contains(&r["accuracy"].as_f64().unwrap())));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("generate_samples_t5: 8 valid samples"),
        "{stderr}"
    );
}

#[test]
fn two_tensor_parallel_processes_score_as_one() {
    let fixture = fixture();
    let outputs = run_job(2, "", |_| {
        let mut command = tool("score", fixture);
        command
            .args(["--num-samples", "8", "--tensor-model-parallel-size", "2"])
            .args(["--distributed-timeout-minutes", "2"]);
        command
    });
    // The last rank prints, as Megatron's tools do.
    let stdout = String::from_utf8_lossy(&outputs[1].stdout);
    let scored = summary_value(&stdout, "lm loss");
    assert!(
        (scored - fixture.validation_loss).abs() < 2e-6 * fixture.validation_loss,
        "{stdout}"
    );
}

#[test]
fn decoding_fills_the_spans_of_samples_and_inputs() {
    let fixture = fixture();
    let out = run_ok(tool("decode", fixture).args(["--num-samples", "3"]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.matches("input:  ").count(), 3, "{stdout}");
    assert_eq!(
        stdout.matches("target: <extra_id_0>").count(),
        3,
        "{stdout}"
    );
    assert!(
        stdout.contains("generate_samples_t5: decoded 3 inputs"),
        "{stdout}"
    );

    let out = run_ok(
        tool("decode", fixture)
            .args([
                "--input",
                "The <extra_id_0> of rome <extra_id_1>.",
                "--jsonl",
            ])
            .args(["--max-decode-length", "5"]),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let decoding: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(decoding["input"], "the <extra_id_0> of rome <extra_id_1> .");
    let decoded = decoding["decoded_ids"].as_array().unwrap();
    assert!(!decoded.is_empty() && decoded.len() <= 5, "{decoding}");
    assert!(decoding.get("target").is_none());
}

fn fails_with(command: &mut Command, message: &str) {
    exits_with(command, 1, message);
}

/// A usage error: exit 2 and `message`.
fn refused_as_usage(command: &mut Command, message: &str) {
    exits_with(command, 2, message);
}

fn exits_with(command: &mut Command, code: i32, message: &str) {
    let out = command.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(message), "expected {message:?} in {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let fixture = fixture();
    fails_with(
        tool("decode", fixture).args(["--input", "no spans here"]),
        "has no sentinel",
    );
    fails_with(
        tool("decode", fixture).args(["--input", "a <extra_id_100> b"]),
        "the tokenizer has 100 sentinels",
    );
    refused_as_usage(
        bin("generate_samples_t5")
            .arg("decode")
            .arg("--load")
            .arg(&fixture.checkpoint)
            .args(["--device", "cpu", "--vocab-extra-ids", "100"])
            .arg("--vocab-file")
            .arg(vocab()),
        "give texts to fill with --input, or data samples with --data-path",
    );
    let mut wrong_sentinels = tool("score", fixture);
    wrong_sentinels.args(["--vocab-extra-ids", "50"]);
    fails_with(
        &mut wrong_sentinels,
        "but the checkpoint was trained with 30624",
    );
    fails_with(
        tool("score", fixture).args(["--decoder-num-layers", "3"]),
        "--decoder-num-layers 3 does not match the checkpoint (1)",
    );
    fails_with(
        tool("score", fixture).args(["--encoder-num-layers", "3"]),
        "--num-layers 3 does not match the checkpoint",
    );
    fails_with(
        tool("decode", fixture).args(["--max-decode-length", "100", "--num-samples", "1"]),
        "--max-position-embeddings",
    );
    fails_with(
        tool("score", fixture).args(["--decoder-seq-length", "64"]),
        "--decoder-seq-length 64 exceeds",
    );
    refused_as_usage(
        tool("score", fixture).args(["--num-samples", "0"]),
        "--num-samples must be at least 1",
    );
    fails_with(
        tool("decode", fixture).args(["--input", "a <extra_id_0>", "--bos", "99999"]),
        "start token 99999 is outside the vocabulary",
    );
    let missing = Path::new("/nonexistent/ckpt");
    fails_with(
        bin("generate_samples_t5")
            .arg("score")
            .arg("--load")
            .arg(missing)
            .args(["--device", "cpu", "--vocab-extra-ids", "100"]),
        "no such checkpoint directory",
    );
}

#[test]
fn help_explains_both_subcommands() {
    let out = run_ok(bin("generate_samples_t5").arg("--help"));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("score") && help.contains("decode"), "{help}");
    let out = run_ok(bin("generate_samples_t5").args(["decode", "--help"]));
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--input",
        "--max-decode-length",
        "--eos",
        "--encoder-seq-length",
        "--decoder-seq-length",
        "--vocab-extra-ids",
        "--tensor-model-parallel-size",
    ] {
        assert!(help.contains(flag), "{flag} missing from decode --help");
    }
}
