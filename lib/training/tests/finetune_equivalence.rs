//! BERT finetuning (`eval_tasks --task MNLI|RACE`) runs on the training engine, so its parallel
//! layouts must equal one rank: a small BERT with a classification (or multiple-choice) head
//! finetuned for three steps on fixture files with TP=2, TP=2 + SP, and DP=2 with the
//! distributed optimizer, ranks as threads, gives the losses, the (merged) weights and the
//! accuracy counts of the one-rank run; a run stopped inside an epoch resumes bit for bit; a
//! pretrained checkpoint of one layout starts a run of another.

mod support;

use std::path::{Path, PathBuf};

use megatron_parallel::Placement;
use megatron_training::args::FinetuneArgs;
use megatron_training::tasks::{finetune, EvalObserver};
use megatron_training::TrainingSummary;
use support::{assert_equivalent, train_in};

struct Quiet;

impl EvalObserver for Quiet {
    fn log(&mut self, _line: &str) {}
    fn start(&mut self, _what: &str, _total: u64) {}
    fn batch_done(&mut self) {}
}

struct Finetune(FinetuneArgs);

impl support::Pretrain for Finetune {
    fn parse(argv: Vec<String>) -> Self {
        Finetune(support::parse_flags(argv))
    }

    fn sequence_parallel(&self) -> bool {
        self.0.model.common.parallel.sequence_parallel
    }

    /// The run, and (on the logging rank) its accuracies in `--results-json`.
    fn run(&self, placement: &Placement) -> anyhow::Result<TrainingSummary> {
        let summary = finetune(&self.0, placement, &mut Quiet)?;
        if let (Some(path), true) = (
            &self.0.task.results_json,
            placement.parallel.is_logging_rank(),
        ) {
            std::fs::write(path, summary.json()["epochs"].to_string())?;
        }
        Ok(summary.training)
    }
}

const WORDS: [&str; 16] = [
    "the", "cat", "dog", "house", "river", "city", "book", "road", "child", "window", "and",
    "never", "surely", "perhaps", "where", "why",
];

/// A WordPiece vocabulary of the fixture's words.
fn write_vocab(dir: &Path) -> PathBuf {
    let path = dir.join("vocab.txt");
    let specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];
    let text: String = specials
        .iter()
        .chain(&WORDS)
        .map(|t| format!("{t}\n"))
        .collect();
    std::fs::write(&path, text).unwrap();
    path
}

/// An MNLI train or dev `.tsv` (12 or 16 columns, the label last); the marker word in
/// sentence2 decides the label.
fn write_mnli(path: &Path, rows: usize, dev: bool) {
    let columns = if dev { 16 } else { 12 };
    let mut text = (0..columns)
        .map(|c| format!("column{c}"))
        .collect::<Vec<_>>()
        .join("\t")
        + "\n";
    let labels = [
        ("never", "contradiction"),
        ("surely", "entailment"),
        ("perhaps", "neutral"),
    ];
    for i in 0..rows {
        let (marker, label) = labels[(i * 7 + usize::from(dev)) % 3];
        let mut fields = vec![i.to_string(); 8];
        fields.push(format!(
            "the {} and the {}",
            WORDS[1 + i % 9],
            WORDS[1 + (i * 5) % 9]
        ));
        fields.push(format!("{} {marker}", WORDS[1 + (i * 3) % 9]));
        fields.resize(columns, label.to_string());
        text += &(fields.join("\t") + "\n");
    }
    std::fs::write(path, text).unwrap();
}

/// A RACE directory of one document with `questions` questions.
fn write_race(dir: &Path, questions: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let document = serde_json::json!({
        "article": "the cat and the dog . the river and the city .",
        "questions": vec!["where the _"; questions],
        // Choices of different words and lengths, so that their encodings differ.
        "options": (0..questions)
            .map(|q| vec![
                WORDS[1 + q % 9].to_string(),
                format!("{} {} and", WORDS[2 + q % 9], WORDS[3 + q % 7]),
                "book road child window never".to_string(),
                "why perhaps surely the house".to_string(),
            ])
            .collect::<Vec<_>>(),
        "answers": (0..questions).map(|q| ["A", "B", "C", "D"][q % 4]).collect::<Vec<_>>(),
    });
    std::fs::write(dir.join("1.txt"), document.to_string() + "\n").unwrap();
}

/// The task's flags: 24 training examples in global batches of 8 for one epoch, three steps.
fn flags(dir: &Path, task: &str) -> Vec<String> {
    let vocab = write_vocab(dir);
    let (train, valid) = if task == "RACE" {
        let (train, valid) = (dir.join("RACE/train"), dir.join("RACE/dev"));
        write_race(&train, 24);
        write_race(&valid, 6);
        (train, valid)
    } else {
        let (train, valid) = (dir.join("train.tsv"), dir.join("dev_matched.tsv"));
        write_mnli(&train, 24, false);
        write_mnli(&valid, 10, true);
        (train, valid)
    };
    [
        "--task",
        task,
        "--epochs",
        "1",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--max-position-embeddings",
        "32",
        "--tokenizer-type",
        "BertWordPieceLowerCase",
    ]
    .iter()
    .chain(support::TINY_OPTIMIZATION)
    .map(|s| s.to_string())
    .chain([
        "--vocab-file".into(),
        vocab.display().to_string(),
        "--train-data".into(),
        train.display().to_string(),
        "--valid-data".into(),
        valid.display().to_string(),
    ])
    .collect()
}

/// The one-rank run and the `world`-rank run of `task` agree, accuracy included.
fn check(task: &str, world: usize, tensor: usize, extra: &[&str], what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let flags = flags(dir.path(), task);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let run = |name: &str, world: usize, tensor: usize, extra: &[&str]| {
        let run_dir = dir.path().join(name);
        std::fs::create_dir(&run_dir).unwrap();
        let results = run_dir.join("results.json");
        let mut extra: Vec<&str> = extra.to_vec();
        let results_flag = results.display().to_string();
        extra.extend(["--results-json", results_flag.as_str()]);
        let outcome = train_in::<Finetune>(&run_dir, &flags, world, tensor, 1, &extra).unwrap();
        let accuracy: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
        (outcome, accuracy)
    };
    let micro = (8 / (world / tensor)).to_string();
    let (reference, reference_accuracy) = run("one", 1, 1, &["--micro-batch-size", "8"]);
    let mut parallel_extra = vec!["--micro-batch-size", micro.as_str()];
    parallel_extra.extend(extra);
    let (parallel, accuracy) = run("parallel", world, tensor, &parallel_extra);
    if task == "RACE" {
        assert_multiple_choice_equivalent(&reference, &parallel, what);
    } else {
        assert_equivalent(&reference, &parallel, what);
    }
    assert_eq!(reference_accuracy, accuracy, "{what}");
    assert!(
        reference
            .weights
            .keys()
            .any(|k| k.starts_with("classification_head") || k.starts_with("multichoice_head")),
        "{what}: no task head among {:?}",
        reference.weights.keys().collect::<Vec<_>>()
    );
}

/// [`assert_equivalent`] for multiple choice, whose cross entropy over a question's choices
/// cancels the gradient of what the choices share: the head's bias gets none at all (a constant
/// added to every score leaves the softmax unchanged) and the trunk's biases little, so float32
/// noise moves them by up to ~1e-7 in three steps; a weight may differ by 1e-6 in absolute terms.
fn assert_multiple_choice_equivalent(
    reference: &support::Outcome,
    parallel: &support::Outcome,
    what: &str,
) {
    assert_eq!(reference.losses.len(), 3, "{what}");
    for (ours, theirs) in reference.losses.iter().zip(&parallel.losses) {
        for ((name, a), (_, b)) in ours.iter().zip(theirs) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{what}: {name} {b} against {a}"
            );
        }
    }
    assert_eq!(reference.weights.len(), parallel.weights.len(), "{what}");
    for (name, a) in &reference.weights {
        let b = &parallel.weights[name];
        let scale = a.abs().max().double_value(&[]);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(
            diff <= (1e-5 * scale).max(1e-6),
            "{what}: {name} differs by {diff:e} (largest weight {scale:e})"
        );
    }
}

#[test]
fn mnli_tensor_parallel_equals_one_rank() {
    check("MNLI", 2, 2, &[], "MNLI TP=2");
}

#[test]
fn mnli_sequence_parallel_equals_one_rank() {
    check("MNLI", 2, 2, &["--sequence-parallel"], "MNLI TP=2 + SP");
}

#[test]
fn mnli_distributed_optimizer_equals_one_rank() {
    check(
        "MNLI",
        2,
        1,
        &["--use-distributed-optimizer"],
        "MNLI DP=2, distributed optimizer",
    );
}

#[test]
fn race_tensor_parallel_equals_one_rank() {
    check("RACE", 2, 2, &[], "RACE TP=2");
}

#[test]
fn resuming_mid_epoch_is_bitwise_identical() {
    let dir = tempfile::tempdir().unwrap();
    let mut flags = flags(dir.path(), "MNLI");
    flags.extend([
        "--epochs".into(),
        "2".into(),
        "--micro-batch-size".into(),
        "8".into(),
    ]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let run = |name: &str, extra: &[&str]| {
        let run_dir = dir.path().join(name);
        std::fs::create_dir_all(&run_dir).unwrap();
        let results = run_dir.join(format!("results{}.json", extra.len()));
        let results_flag = results.display().to_string();
        let mut extra = extra.to_vec();
        extra.extend(["--results-json", results_flag.as_str()]);
        let outcome = train_in::<Finetune>(&run_dir, &flags, 2, 2, 1, &extra).unwrap();
        let accuracy: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
        (outcome, accuracy)
    };
    let (straight, straight_accuracy) = run("straight", &[]);
    // Three iterations an epoch: stop inside the second epoch, then resume.
    let (_, first_accuracy) = run("resumed", &["--exit-interval", "4"]);
    let checkpoint = dir.path().join("resumed/ckpt").display().to_string();
    let (resumed, resumed_accuracy) = run("resumed", &["--load", checkpoint.as_str()]);
    assert_eq!(straight.losses.len(), 6);
    assert_eq!(straight.losses, resumed.losses);
    for (name, tensor) in &straight.weights {
        assert!(
            tensor.equal(&resumed.weights[name]),
            "{name} differs after resuming"
        );
    }
    assert_eq!(straight_accuracy[0], first_accuracy[0]);
    assert_eq!(straight_accuracy[1], resumed_accuracy[0]);
    assert_eq!(resumed_accuracy[0]["epoch"], 1);
}

#[test]
fn pretrained_checkpoints_load_into_any_tensor_parallel_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mnli_flags = flags(dir.path(), "MNLI");
    let mnli_flags: Vec<&str> = mnli_flags.iter().map(String::as_str).collect();
    let run = |name: &str, tensor: usize, extra: &[&str]| {
        let run_dir = dir.path().join(name);
        std::fs::create_dir(&run_dir).unwrap();
        let mut extra = extra.to_vec();
        extra.extend(["--micro-batch-size", "8"]);
        train_in::<Finetune>(&run_dir, &mnli_flags, tensor, tensor, 1, &extra).unwrap()
    };
    let checkpoint = |name: &str| dir.path().join(name).join("ckpt").display().to_string();
    // Checkpoints saved with TP=1 and TP=2 start further runs (task head included).
    run("one", 1, &[]);
    run("two", 2, &[]);
    let (one, two) = (checkpoint("one"), checkpoint("two"));
    let from_one = run("from-one", 1, &["--pretrained-checkpoint", one.as_str()]);
    let cut = run("cut", 2, &["--pretrained-checkpoint", one.as_str()]);
    assert_equivalent(&from_one, &cut, "TP=2 from a TP=1 checkpoint");
    let merged = run("merged", 1, &["--pretrained-checkpoint", two.as_str()]);
    let (a, b) = (from_one.lm_losses()[0], merged.lm_losses()[0]);
    assert!(
        (a - b).abs() <= 1e-4 * a,
        "TP=1 from a TP=2 checkpoint: first loss {b}, from the TP=1 checkpoint {a}"
    );
    // Another task starts from the MNLI model: its classification head is dropped.
    let race_dir = dir.path().join("race");
    std::fs::create_dir(&race_dir).unwrap();
    let race_flags = flags(&race_dir, "RACE");
    let race_flags: Vec<&str> = race_flags.iter().map(String::as_str).collect();
    let race = train_in::<Finetune>(
        &race_dir,
        &race_flags,
        1,
        1,
        1,
        &[
            "--micro-batch-size",
            "8",
            "--pretrained-checkpoint",
            one.as_str(),
        ],
    )
    .unwrap();
    assert!(race.weights.contains_key("multichoice_head.weight"));
    assert!(!race.weights.contains_key("classification_head.weight"));
}
