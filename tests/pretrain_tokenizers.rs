//! Every tokenizer Megatron trains with, end to end on the CPU: `preprocess_data` tokenizes a
//! corpus, `pretrain_gpt` trains on it, stops and resumes bitwise, and the dataset caches it
//! writes are named as Megatron names them (the description is what Python's `json.dumps`
//! prints for it, holds the tokenizer's identity, and its MD5 is the files' prefix);
//! `inspect_dataset samples` with the same tokenizer flags finds those caches, and `eval_tasks`
//! scores the checkpoint on WikiText with it. BERT and T5 train on sentence data of the one
//! SentencePiece flavor Megatron gives `[CLS]`, `[SEP]` and `[MASK]` (`SentencePieceTokenizer`),
//! and their samples are made of its special tokens.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use megatron_e2e::{bin, metrics_losses, run_ok, shared_dir, test_python, workspace_root};
use serde_json::Value;

/// Models trained for the test by `fixtures/tokenizer_references.py` (a SentencePiece unigram
/// model and a TikToken vocabulary), its JSONL corpus, and what it says of the TikToken one.
struct Fixtures {
    dir: tempfile::TempDir,
    tiktoken_vocab_size: String,
    tiktoken_num_special: String,
    /// The ids of Megatron's SentencePieceTokenizer special tokens for the unigram model (with
    /// T5's sentinels) by role, as the fixture computes them with the `sentencepiece` package.
    sentencepiece_roles: Value,
    t5_extra_ids: String,
}

fn fixtures() -> &'static Fixtures {
    static FIXTURES: OnceLock<Fixtures> = OnceLock::new();
    FIXTURES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        run_ok(
            Command::new(test_python(&["sentencepiece", "tiktoken"]))
                .arg(workspace_root().join("tests/fixtures/tokenizer_references.py"))
                .arg(dir.path())
                .arg(shared_dir().join("data")),
        );
        let expected: Value =
            serde_json::from_slice(&std::fs::read(dir.path().join("expected.json")).unwrap())
                .unwrap();
        Fixtures {
            tiktoken_vocab_size: expected["tiktoken_vocab_size"].to_string(),
            tiktoken_num_special: expected["tiktoken_num_special"].to_string(),
            sentencepiece_roles: expected["megatron_unigram_roles"].clone(),
            t5_extra_ids: expected["t5_extra_ids"].to_string(),
            dir,
        }
    })
}

/// The flags naming one tokenizer, whether training names caches like the legacy tokenizers
/// (`--legacy-tokenizer`, which `preprocess_data` does not take), and the class its cache
/// identity records.
struct Case {
    flags: Vec<String>,
    legacy: bool,
    class: &'static str,
}

const CURRENT: &str = "megatron.core.tokenizers.text.text_tokenizer.MegatronTokenizerText";

fn shared(name: &str) -> String {
    shared_dir().join("data").join(name).display().to_string()
}

fn fixture(name: &str) -> String {
    fixtures().dir.path().join(name).display().to_string()
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

fn sentencepiece(kind: &str) -> Vec<String> {
    let mut flags = strings(&["--tokenizer-type", kind, "--tokenizer-model"]);
    flags.push(fixture("unigram.model"));
    flags
}

/// Caches named as Megatron's current tokenizers name them.
fn current(flags: Vec<String>) -> Case {
    Case {
        flags,
        legacy: false,
        class: CURRENT,
    }
}

/// Caches named as Megatron's legacy tokenizers (`class`) name them.
fn legacy(flags: Vec<String>, class: &'static str) -> Case {
    Case {
        flags,
        legacy: true,
        class,
    }
}

/// A corpus of space-separated ids for the NullTokenizer (vocabulary 512).
fn null_corpus(dir: &Path) -> PathBuf {
    let path = dir.join("ids.jsonl");
    let documents: Vec<String> = (0..300u32)
        .map(|d| {
            let ids: Vec<String> = (0..40 + d % 50)
                .map(|i| ((d * 31 + i * 7) % 511).to_string())
                .collect();
            serde_json::json!({ "text": ids.join(" ") }).to_string()
        })
        .collect();
    std::fs::write(&path, documents.join("\n") + "\n").unwrap();
    path
}

fn pretrain(data: &Path, cache: &Path, case: &Case, extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args(["--num-layers", "1", "--hidden-size", "32"])
        .args(["--num-attention-heads", "4", "--seq-length", "32"])
        .args(["--micro-batch-size", "2", "--global-batch-size", "4"])
        .args(["--lr", "3e-3", "--train-iters", "4", "--log-interval", "1"])
        .args([
            "--split",
            "90,5,5",
            "--eval-interval",
            "1000",
            "--eval-iters",
            "1",
        ])
        .args(["--device", "cpu", "--deterministic-mode", "--data-path"])
        .arg(data)
        .arg("--data-cache-path")
        .arg(cache)
        .args(&case.flags)
        .args(extra);
    if case.legacy {
        command.arg("--legacy-tokenizer");
    }
    command
}

/// Checks each cache description Python's way: its text is `json.dumps(indent=4)` of itself,
/// its MD5 is the prefix of its file name, and its tokenizer entry names `class`. Returns the
/// number of descriptions.
fn check_descriptions(cache: &Path, class: &str) -> usize {
    let script = r#"
import hashlib, json, pathlib, sys
cache, cls = pathlib.Path(sys.argv[1]), sys.argv[2]
found = sorted(cache.rglob("*-description.txt"))
for path in found:
    text = path.read_text(encoding="utf-8")
    description = json.loads(text)
    assert json.dumps(description, indent=4) == text, f"{path}: not json.dumps(indent=4)"
    assert hashlib.md5(text.encode()).hexdigest() == path.name.split("-")[0], f"{path}: md5"
    assert description["tokenizer"]["class"] == cls, f"{path}: {description['tokenizer']}"
print(len(found))
"#;
    let out = run_ok(
        Command::new(test_python(&["hashlib"]))
            .args(["-c", script])
            .arg(cache)
            .arg(class),
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn train_stop_resume_and_inspect(name: &str, case: Case) {
    let dir = tempfile::tempdir().unwrap();
    let input = if name == "null" {
        null_corpus(dir.path())
    } else {
        PathBuf::from(fixture("input.jsonl"))
    };
    let prefix = dir.path().join(name);
    run_ok(
        bin("preprocess_data")
            .arg("--input")
            .arg(&input)
            .arg("--output-prefix")
            .arg(&prefix)
            .args(["--append-eod", "--workers", "1"])
            .args(&case.flags),
    );
    let data = dir.path().join(format!("{name}_text_document"));
    let cache = dir.path().join("cache");
    let path = |p: PathBuf| p.display().to_string();

    let straight_metrics = path(dir.path().join("straight.jsonl"));
    run_ok(&mut pretrain(
        &data,
        &cache,
        &case,
        &["--metrics-file", &straight_metrics],
    ));
    let descriptions = check_descriptions(&cache, case.class);
    assert_eq!(descriptions, 3, "{name}: one description per split");

    let save = path(dir.path().join("checkpoint"));
    let resumed_metrics = path(dir.path().join("resumed.jsonl"));
    let stop = [
        "--save",
        &save,
        "--save-interval",
        "2",
        "--exit-interval",
        "2",
    ];
    run_ok(pretrain(&data, &cache, &case, &stop).args(["--metrics-file", &resumed_metrics]));
    let resumed = run_ok(
        pretrain(&data, &cache, &case, &["--load", &save, "--save", &save])
            .args(["--metrics-file", &resumed_metrics]),
    );
    assert!(
        String::from_utf8_lossy(&resumed.stdout).contains("iteration        4/       4"),
        "{name}: {}",
        String::from_utf8_lossy(&resumed.stdout)
    );
    let straight = metrics_losses(Path::new(&straight_metrics));
    assert_eq!(straight.len(), 4, "{name}: {straight:?}");
    assert_eq!(
        straight,
        metrics_losses(Path::new(&resumed_metrics)),
        "{name}: the resumed run's losses"
    );
    assert_eq!(
        check_descriptions(&cache, case.class),
        3,
        "{name}: the stopped and resumed runs used the first run's caches"
    );

    // Training asked for 16 train samples, and 4 each for validation and test.
    let inspected = run_ok(
        bin("inspect_dataset")
            .args(["samples", "--data-path"])
            .arg(&data)
            .arg("--data-cache-path")
            .arg(&cache)
            .args([
                "--split",
                "90,5,5",
                "--seq-length",
                "32",
                "--num-samples",
                "16,4,4",
            ])
            .args(["--first", "1"])
            .args(&case.flags)
            .args(case.legacy.then_some("--legacy-tokenizer")),
    );
    let summary = String::from_utf8_lossy(&inspected.stderr);
    assert!(summary.contains("loaded from"), "{name}: {summary}");

    // The NullTokenizer reads ids, not text.
    if name != "null" {
        evaluate_wikitext(name, &case, &save, dir.path());
    }
}

/// `eval_tasks` scores the trained checkpoint on the head of WikiText-103 with the tokenizer.
fn evaluate_wikitext(name: &str, case: &Case, checkpoint: &str, dir: &Path) {
    let text = std::fs::read_to_string(shared_dir().join("data/wikitext103_test.tokens")).unwrap();
    let head: String = text
        .lines()
        .take(12)
        .map(|line| format!("{line}\n"))
        .collect();
    let data = dir.join("wiki.tokens");
    std::fs::write(&data, head).unwrap();
    let results = dir.join("wiki.json");
    run_ok(
        bin("eval_tasks")
            .args(["--task", "WIKITEXT103", "--valid-data"])
            .arg(&data)
            .args([
                "--load",
                checkpoint,
                "--device",
                "cpu",
                "--seq-length",
                "32",
            ])
            .args(["--overlapping-eval", "16", "--results-json"])
            .arg(&results)
            .args(&case.flags)
            .args(case.legacy.then_some("--legacy-tokenizer")),
    );
    let results: Value = serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    let loss = results["avg_loss"].as_f64().unwrap();
    let (words, tokens) = (
        results["num_original_tokens"].as_u64().unwrap(),
        results["num_tokenized_tokens"].as_u64().unwrap(),
    );
    // Four steps leave the model near a uniform guess over its vocabulary.
    assert!(loss.is_finite() && loss > 1.0, "{name}: {results}");
    assert!(tokens >= words / 2 && words > 100, "{name}: {results}");
}

#[test]
fn gpt2_bpe() {
    let mut flags = strings(&["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file"]);
    flags.extend([
        shared("gpt2-vocab.json"),
        "--merge-file".into(),
        shared("gpt2-merges.txt"),
    ]);
    train_stop_resume_and_inspect("gpt2", legacy(flags, "_GPT2BPETokenizer"));
}

#[test]
fn bert_wordpiece() {
    let mut flags = strings(&["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file"]);
    flags.push(shared("bert-large-uncased-vocab.txt"));
    train_stop_resume_and_inspect("bert", legacy(flags, "_BertWordPieceTokenizer"));
}

#[test]
fn huggingface() {
    let mut flags = strings(&[
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
    ]);
    flags.push(shared("gpt2-tokenizer.json"));
    train_stop_resume_and_inspect("hf", current(flags));
}

#[test]
fn huggingface_legacy() {
    let mut flags = strings(&[
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
    ]);
    flags.push(shared("gpt2-tokenizer.json"));
    train_stop_resume_and_inspect("hf_legacy", legacy(flags, "_HuggingFaceTokenizer"));
}

#[test]
fn sentencepiece_megatron() {
    train_stop_resume_and_inspect(
        "sp",
        legacy(
            sentencepiece("SentencePieceTokenizer"),
            "_SentencePieceTokenizer",
        ),
    );
}

#[test]
fn sentencepiece_gpt() {
    train_stop_resume_and_inspect("gptsp", current(sentencepiece("GPTSentencePieceTokenizer")));
}

#[test]
fn sentencepiece_llama2() {
    train_stop_resume_and_inspect(
        "llama2",
        legacy(sentencepiece("Llama2Tokenizer"), "_Llama2Tokenizer"),
    );
}

#[test]
fn tiktoken() {
    let fixtures = fixtures();
    let mut flags = strings(&["--tokenizer-type", "TikTokenizer", "--tokenizer-model"]);
    flags.extend([
        fixture("tiktoken.json"),
        "--tiktoken-pattern".into(),
        "v2".into(),
        "--tiktoken-num-special-tokens".into(),
        fixtures.tiktoken_num_special.clone(),
        "--vocab-size".into(),
        fixtures.tiktoken_vocab_size.clone(),
    ]);
    train_stop_resume_and_inspect("tiktoken", legacy(flags, "CustomTikTokenizer"));
}

#[test]
fn null() {
    let flags = strings(&["--tokenizer-type", "NullTokenizer", "--vocab-size", "511"]);
    train_stop_resume_and_inspect("null", current(flags));
}

/// Sentence-level data (`--split-sentences`) of the fixture corpus, tokenized by Megatron's
/// SentencePieceTokenizer.
fn sentencepiece_sentences(dir: &Path) -> PathBuf {
    run_ok(
        bin("preprocess_data")
            .arg("--input")
            .arg(fixture("input.jsonl"))
            .arg("--output-prefix")
            .arg(dir.join("sp"))
            .args(["--split-sentences", "--workers", "1", "--punkt-dir"])
            .arg(shared_dir().join("data/punkt_tab_english"))
            .args(sentencepiece("SentencePieceTokenizer")),
    );
    dir.join("sp_text_sentence")
}

/// A tiny BERT or T5 (`binary`) on `data` for 4 iterations, with the SentencePiece tokenizer.
fn pretrain_masked(binary: &str, data: &Path, cache: &Path, extra: &[&str]) -> Command {
    let mut command = bin(binary);
    command
        .args(["--num-layers", "1", "--hidden-size", "32"])
        .args(["--num-attention-heads", "4", "--seq-length", "32"])
        .args(["--max-position-embeddings", "32"])
        .args(["--micro-batch-size", "2", "--global-batch-size", "4"])
        .args(["--lr", "3e-3", "--train-iters", "4", "--log-interval", "1"])
        .args(["--split", "90,5,5", "--eval-interval", "1000"])
        .args([
            "--eval-iters",
            "1",
            "--device",
            "cpu",
            "--deterministic-mode",
        ])
        .arg("--data-path")
        .arg(data)
        .arg("--data-cache-path")
        .arg(cache)
        .args(sentencepiece("SentencePieceTokenizer"))
        .args(extra);
    command
}

/// Trains straight through, then stops at iteration 2 and resumes: the losses agree bitwise
/// and every cache is named for Megatron's `_SentencePieceTokenizer`.
fn straight_stop_and_resume(binary: &str, data: &Path, dir: &Path, extra: &[&str]) {
    let cache = dir.join(format!("{binary}-cache"));
    let metrics = |name: &str| dir.join(format!("{binary}-{name}.jsonl"));
    let (straight, resumed) = (metrics("straight"), metrics("resumed"));
    let with_metrics = |path: &Path| vec!["--metrics-file".to_string(), path.display().to_string()];
    run_ok(pretrain_masked(binary, data, &cache, extra).args(with_metrics(&straight)));
    let save = dir
        .join(format!("{binary}-checkpoint"))
        .display()
        .to_string();
    let stop = [
        "--save",
        &save,
        "--save-interval",
        "2",
        "--exit-interval",
        "2",
    ];
    run_ok(
        pretrain_masked(binary, data, &cache, extra)
            .args(stop)
            .args(with_metrics(&resumed)),
    );
    run_ok(
        pretrain_masked(binary, data, &cache, extra)
            .args(["--load", &save, "--save", &save])
            .args(with_metrics(&resumed)),
    );
    let losses = metrics_losses(&straight);
    assert_eq!(losses.len(), 4, "{binary}: {losses:?}");
    assert_eq!(
        losses,
        metrics_losses(&resumed),
        "{binary}: the resumed run's losses"
    );
    assert_eq!(
        check_descriptions(&cache, "_SentencePieceTokenizer"),
        3,
        "{binary}: one description per split"
    );
}

/// The first `count` training samples `inspect_dataset` prints for `model` with the flags
/// training used, one JSON object each.
fn inspect_masked(
    model: &str,
    data: &Path,
    dir: &Path,
    extra: &[&str],
    count: usize,
) -> Vec<Value> {
    let out = run_ok(
        bin("inspect_dataset")
            .args(["samples", "--model", model, "--data-path"])
            .arg(data)
            .arg("--data-cache-path")
            .arg(dir.join(format!("pretrain_{model}-cache")))
            .args([
                "--split",
                "90,5,5",
                "--num-samples",
                "16,4,4",
                "--seq-length",
                "32",
            ])
            .args(["--first", &count.to_string()])
            .args(sentencepiece("SentencePieceTokenizer"))
            .args(extra),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("loaded from"),
        "{model}: training's caches: {stderr}"
    );
    let samples: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(samples.len(), count);
    samples
}

fn ids(value: &Value) -> Vec<i64> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect()
}

#[test]
fn sentencepiece_bert_and_t5() {
    let dir = tempfile::tempdir().unwrap();
    let data = sentencepiece_sentences(dir.path());
    let roles = &fixtures().sentencepiece_roles;
    let role = |name: &str| roles[name].as_i64().unwrap();

    straight_stop_and_resume("pretrain_bert", &data, dir.path(), &[]);
    let mut masked_reading_mask = 0;
    for sample in inspect_masked("bert", &data, dir.path(), &[], 8) {
        let text = ids(&sample["text"]);
        let padding = ids(&sample["padding_mask"]);
        let real = padding.iter().filter(|&&p| p == 1).count();
        // [CLS] A [SEP] B [SEP], then padding.
        assert_eq!(text[0], role("cls"), "{sample}");
        assert_eq!(text[real - 1], role("sep"), "{sample}");
        assert_eq!(
            text[..real].iter().filter(|&&t| t == role("sep")).count(),
            2
        );
        assert!(text[real..].iter().all(|&t| t == role("pad")), "{sample}");
        // [MASK] stands only where a label is set (80% of those; the rest hold a random or
        // their own token).
        let labels = ids(&sample["labels"]);
        assert!(
            (0..real).all(|i| labels[i] != -1 || text[i] != role("mask")),
            "{sample}"
        );
        masked_reading_mask += (0..real)
            .filter(|&i| labels[i] != -1 && text[i] == role("mask"))
            .count();
    }
    assert!(masked_reading_mask > 0, "no sample has a [MASK]");

    let extra_ids = fixtures().t5_extra_ids.clone();
    let t5 = [
        "--vocab-extra-ids",
        extra_ids.as_str(),
        "--decoder-seq-length",
        "16",
    ];
    straight_stop_and_resume("pretrain_t5", &data, dir.path(), &t5);
    let sentinels = ids(&roles["sentinels"]);
    for sample in inspect_masked("t5", &data, dir.path(), &t5, 4) {
        let (encoder, decoder) = (ids(&sample["text_enc"]), ids(&sample["text_dec"]));
        let labels = ids(&sample["labels"]);
        // Each masked span is one sentinel in the encoder's input, in order, and opens the
        // decoder's span; the decoder starts at the bos and its labels end at the eos.
        let used: Vec<i64> = encoder
            .iter()
            .copied()
            .filter(|t| sentinels.contains(t))
            .collect();
        assert!(!used.is_empty(), "{sample}");
        assert_eq!(used, sentinels[..used.len()], "{sample}");
        assert_eq!(decoder[0], role("bos"), "{sample}");
        assert_eq!(decoder[1], sentinels[0], "{sample}");
        let ends = labels.iter().position(|&t| t == role("eos")).unwrap();
        assert!(labels[ends + 1..].iter().all(|&t| t == -1), "{sample}");
    }
}

#[test]
fn masked_families_refuse_tokenizers_without_mask_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let mut flags = strings(&[
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
    ]);
    flags.push(shared("gpt2-tokenizer.json"));
    let data = sentencepiece_sentences(dir.path());
    let t5: &[&str] = &["--vocab-extra-ids", "10", "--decoder-seq-length", "16"];
    for (binary, extra) in [("pretrain_bert", &[][..]), ("pretrain_t5", t5)] {
        let out = pretrain_masked(binary, &data, &dir.path().join("cache"), extra)
            .args(&flags)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{binary}: {stderr}");
        assert!(
            stderr.contains("Megatron's HuggingFaceTokenizer does not have")
                && stderr.contains("SentencePieceTokenizer"),
            "{binary}: {stderr}"
        );
    }
}
