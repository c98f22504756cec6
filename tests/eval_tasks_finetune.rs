//! `eval_tasks --task MNLI|QQP|RACE` as a user runs it, on fixture files written here in each
//! task's official format: a tiny BERT pretrained by `pretrain_bert` learns a synthetic MNLI set
//! whose label a marker word decides, far above chance, with Megatron's accuracy lines after
//! every epoch and a checkpoint per epoch; `--epochs 0` scores that checkpoint again with the
//! same counts; two tensor-parallel processes give the one-process results; QQP (its malformed
//! rows skipped) and RACE (directories of JSON documents) run end to end; bad files and
//! checkpoints get errors naming the file and line or the tensor.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use megatron_e2e::{bin, run_job, run_ok, shared_dir};

fn vocab() -> PathBuf {
    shared_dir().join("data/bert-large-uncased-vocab.txt")
}

/// The tiny BERT's flags, shared by pretraining and finetuning.
fn model_flags() -> Vec<String> {
    [
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
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--device",
        "cpu",
        "--seed",
        "1234",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain(["--vocab-file".to_string(), vocab().display().to_string()])
    .collect()
}

/// A pretrain_bert checkpoint of the tiny BERT (a few steps on mock data), made once.
fn pretrained() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("bert");
        run_ok(
            bin("pretrain_bert")
                .args(model_flags())
                .args(["--mock-data", "--train-iters", "2", "--lr", "1e-3"])
                .args(["--micro-batch-size", "4", "--eval-iters", "0"])
                .arg("--save")
                .arg(&checkpoint),
        );
        (dir, checkpoint)
    })
    .1
}

/// Deterministic draws for the synthetic data.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as usize
    }

    fn words(&mut self, pool: &[&str], count: usize) -> String {
        (0..count)
            .map(|_| pool[self.below(pool.len())])
            .collect::<Vec<_>>()
            .join(" ")
    }
}

const NOUNS: [&str; 12] = [
    "cat", "dog", "house", "river", "teacher", "garden", "city", "book", "music", "road", "child",
    "window",
];
/// The word in sentence2 that decides the label.
const MARKERS: [(&str, &str); 3] = [
    ("never", "contradiction"),
    ("surely", "entailment"),
    ("perhaps", "neutral"),
];

/// An MNLI `.tsv` in GLUE's layout: train files have 12 columns (`label1`, `gold_label`), dev
/// files 16 (five annotator labels, then `gold_label`); the label is the last column.
fn write_mnli(path: &Path, rows: usize, dev: bool, seed: u64) -> Vec<&'static str> {
    let mut rng = Lcg(seed);
    let mut header = vec![
        "index",
        "promptID",
        "pairID",
        "genre",
        "sentence1_binary_parse",
        "sentence2_binary_parse",
        "sentence1_parse",
        "sentence2_parse",
        "sentence1",
        "sentence2",
        "label1",
    ];
    if dev {
        header.extend(["label2", "label3", "label4", "label5"]);
    }
    header.push("gold_label");
    let mut text = header.join("\t") + "\n";
    let mut labels = Vec::new();
    for i in 0..rows {
        let (marker, label) = MARKERS[rng.below(3)];
        let s1 = format!(
            "the {} and the {}",
            rng.words(&NOUNS, 2),
            rng.words(&NOUNS, 2)
        );
        let s2 = format!(
            "{} the {} {}",
            rng.words(&NOUNS, 1),
            rng.words(&NOUNS, 1),
            marker
        );
        let mut fields = vec![
            i.to_string(),
            format!("{}", 1000 + i),
            format!("{i}e"),
            "fiction".to_string(),
            format!("( {s1} )"),
            format!("( {s2} )"),
            format!("(ROOT {s1})"),
            format!("(ROOT {s2})"),
            s1,
            s2,
        ];
        let annotators = if dev { 5 } else { 1 };
        fields.extend((0..annotators).map(|_| label.to_string()));
        fields.push(label.to_string());
        text += &(fields.join("\t") + "\n");
        labels.push(label);
    }
    std::fs::write(path, text).unwrap();
    labels
}

fn finetune(task: &str, extra: &[&str]) -> Command {
    let mut command = bin("eval_tasks");
    command
        .args(["--task", task])
        .args(model_flags())
        .args([
            "--lr",
            "5e-3",
            "--lr-warmup-fraction",
            "0.1",
            "--log-interval",
            "5",
        ])
        .args(["--eval-iters", "1", "--eval-interval", "1000"])
        .args(extra);
    command
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `(epoch, name, correct, total)` of every ` > |epoch: E| metrics for NAME: ...` line, after
/// checking that the line is exactly Megatron's format.
fn metrics_lines(text: &str) -> Vec<(i64, String, u64, u64)> {
    let mut found = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(" > |epoch: ") else {
            continue;
        };
        let (epoch, rest) = rest.split_once("| metrics for ").unwrap();
        let (name, rest) = rest.split_once(": correct / total = ").unwrap();
        let (counts, elapsed) = rest.split_once(" %, elapsed time (sec): ").unwrap();
        let (correct, rest) = counts.split_once(" / ").unwrap();
        let (total, percent) = rest.split_once(" = ").unwrap();
        let (correct, total): (u64, u64) = (correct.parse().unwrap(), total.parse().unwrap());
        assert_eq!(
            percent,
            format!("{:.4}", correct as f64 * 100.0 / total as f64),
            "{line}"
        );
        let (_, decimals) = elapsed.split_once('.').unwrap();
        assert_eq!(decimals.len(), 3, "{line}");
        found.push((epoch.parse().unwrap(), name.to_string(), correct, total));
    }
    found
}

/// `(epoch, correct, total)` of every ` >> |epoch: E| overall: ...` line (format checked).
fn overall_lines(text: &str) -> Vec<(i64, u64, u64)> {
    text.lines()
        .filter_map(|line| line.strip_prefix(" >> |epoch: "))
        .map(|rest| {
            let (epoch, rest) = rest.split_once("| overall: correct / total = ").unwrap();
            let rest = rest.strip_suffix(" %").unwrap();
            let (counts, percent) = rest.split_once(" = ").unwrap();
            let (correct, total) = counts.split_once(" / ").unwrap();
            let (correct, total): (u64, u64) = (correct.parse().unwrap(), total.parse().unwrap());
            assert_eq!(
                percent,
                format!("{:.4}", correct as f64 * 100.0 / total as f64)
            );
            (epoch.parse().unwrap(), correct, total)
        })
        .collect()
}

#[test]
fn mnli_finetuning_learns_the_task_and_reports_megatron_accuracy_lines() {
    let dir = tempfile::tempdir().unwrap();
    let mnli = dir.path().join("MNLI");
    std::fs::create_dir(&mnli).unwrap();
    write_mnli(&mnli.join("train.tsv"), 320, false, 1);
    write_mnli(&mnli.join("dev_matched.tsv"), 60, true, 2);
    write_mnli(&mnli.join("dev_mismatched.tsv"), 50, true, 3);
    let save = dir.path().join("mnli-ckpt");
    let out = run_ok(
        finetune("MNLI", &["--epochs", "3", "--micro-batch-size", "16"])
            .arg("--train-data")
            .arg(mnli.join("train.tsv"))
            .arg("--valid-data")
            .arg(mnli.join("dev_matched.tsv"))
            .arg(mnli.join("dev_mismatched.tsv"))
            .arg("--pretrained-checkpoint")
            .arg(pretrained())
            .arg("--save")
            .arg(&save),
    );
    let text = stdout(&out);
    // The pretrained trunk is loaded; the pooler comes with it, the head starts fresh.
    assert!(
        text.contains(
            "> not in the pretrained checkpoint, freshly initialised: classification_head.weight, classification_head.bias"
        ),
        "{text}"
    );
    assert!(text.contains(" lm loss: "), "{text}");
    let metrics = metrics_lines(&text);
    let names: Vec<(i64, &str, u64)> = metrics
        .iter()
        .map(|(e, n, _, t)| (*e, n.as_str(), *t))
        .collect();
    assert_eq!(
        names,
        [
            (0, "dev-matched", 60),
            (0, "dev-mismatched", 50),
            (1, "dev-matched", 60),
            (1, "dev-mismatched", 50),
            (2, "dev-matched", 60),
            (2, "dev-mismatched", 50),
        ],
        "{text}"
    );
    let overall = overall_lines(&text);
    assert_eq!(overall.len(), 3, "{text}");
    let (epoch, correct, total) = overall[2];
    assert_eq!((epoch, total), (2, 110));
    assert_eq!(correct, metrics[4].2 + metrics[5].2);
    // Chance is a third; the marker word decides the label.
    assert!(
        correct as f64 / total as f64 > 0.8,
        "final accuracy {correct}/{total}\n{text}"
    );
    // 320 examples in batches of 16: 20 iterations an epoch, a checkpoint after each.
    for iteration in [20, 40, 60] {
        assert!(save.join(format!("iter_{iteration:07}")).is_dir(), "{text}");
    }
    let summary = text.lines().last().unwrap();
    assert!(
        summary.starts_with("eval_tasks: MNLI, 3 epochs, 60 iterations, lm loss "),
        "{summary}"
    );
    assert!(
        summary.contains(&format!("({correct}/{total}) after epoch 2")),
        "{summary}"
    );

    // --epochs 0 scores the saved model again (7 examples per forward): the same counts, as
    // epoch -1.
    let results = dir.path().join("results.json");
    let out = run_ok(
        finetune(
            "MNLI",
            &[
                "--epochs",
                "0",
                "--micro-batch-size",
                "16",
                "--eval-micro-batch-size",
                "7",
            ],
        )
        .arg("--valid-data")
        .arg(mnli.join("dev_matched.tsv"))
        .arg(mnli.join("dev_mismatched.tsv"))
        .arg("--load")
        .arg(&save)
        .arg("--results-json")
        .arg(&results),
    );
    let again = stdout(&out);
    assert!(
        again.contains("evaluation only mode, setting epoch to -1"),
        "{again}"
    );
    assert!(
        !again.contains(" lm loss: "),
        "nothing is trained:\n{again}"
    );
    let rescored: Vec<(i64, String, u64, u64)> = metrics_lines(&again);
    let expected: Vec<(i64, String, u64, u64)> = metrics[4..]
        .iter()
        .map(|(_, n, c, t)| (-1, n.clone(), *c, *t))
        .collect();
    assert_eq!(rescored, expected, "{again}");
    assert_eq!(overall_lines(&again), [(-1, correct, total)]);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&results).unwrap()).unwrap();
    assert_eq!(json["epochs"][0]["overall"]["correct"], correct);
    assert_eq!(json["epochs"][0]["sets"][1]["name"], "dev-mismatched");
}

#[test]
fn qqp_skips_malformed_rows_and_runs_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let qqp = dir.path().join("QQP");
    std::fs::create_dir(&qqp).unwrap();
    let mut rng = Lcg(9);
    let mut write = |name: &str, rows: usize| -> usize {
        let mut text = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n".to_string();
        let mut kept = 0;
        for i in 0..rows {
            let duplicate = rng.below(2);
            let q1 = format!("where is the {}", rng.words(&NOUNS, 2));
            let q2 = format!(
                "{} is the {}",
                if duplicate == 1 { "where" } else { "why" },
                rng.words(&NOUNS, 2)
            );
            text += &match i % 10 {
                // Rows Megatron skips with a warning: a missing column, an empty question.
                3 => format!("{i}\t{}\t{}\t{q1}\t{duplicate}\n", 2 * i, 2 * i + 1),
                7 => format!("{i}\t{}\t{}\t{q1}\t \t{duplicate}\n", 2 * i, 2 * i + 1),
                _ => {
                    kept += 1;
                    format!("{i}\t{}\t{}\t{q1}\t{q2}\t{duplicate}\n", 2 * i, 2 * i + 1)
                }
            };
        }
        std::fs::write(qqp.join(name), text).unwrap();
        kept
    };
    let kept_train = write("train.tsv", 60);
    let kept_dev = write("dev.tsv", 30);
    let out = run_ok(
        finetune(
            "QQP",
            &["--epochs", "1", "--micro-batch-size", "8", "--keep-last"],
        )
        .arg("--train-data")
        .arg(qqp.join("train.tsv"))
        .arg("--valid-data")
        .arg(qqp.join("dev.tsv"))
        .arg("--pretrained-checkpoint")
        .arg(pretrained()),
    );
    let text = stdout(&out);
    let at = |line: usize| format!("{}:{line}: ", qqp.join("dev.tsv").display());
    assert!(
        text.contains(&format!(
            "***WARNING*** {}index error (5 columns), skipping",
            at(5)
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("***WARNING*** {}zero length b, skipping", at(9))),
        "{text}"
    );
    assert!(
        text.contains(&format!(" > QQP: {kept_train} examples from ")),
        "{text}"
    );
    let metrics = metrics_lines(&text);
    assert_eq!(metrics.len(), 1, "{text}");
    assert_eq!((metrics[0].0, metrics[0].1.as_str()), (0, "dev"));
    assert_eq!(metrics[0].3, kept_dev as u64);
    // --keep-last: 48 examples in batches of 8 are 6 iterations.
    assert!(
        text.lines().last().unwrap().starts_with(&format!(
            "eval_tasks: QQP, 1 epochs, {} iterations",
            kept_train.div_ceil(8)
        )),
        "{text}"
    );
}

#[test]
fn race_directories_run_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let race = dir.path().join("RACE");
    let document = |id: usize| {
        serde_json::json!({
            "article": format!("The {} walked to the river . It was a long day.", NOUNS[id % 12]),
            "questions": ["Who walked to the river?", "The walk was _ ."],
            "options": [[NOUNS[id % 12], "a bird", "the sun", "nobody"],
                        ["short", "long", "wet", "green"]],
            "answers": ["A", "B"],
            "id": format!("{id}.txt")
        })
        .to_string()
    };
    let mut id = 0;
    for (split, level, files) in [
        ("train", "middle", 3),
        ("train", "high", 2),
        ("dev", "middle", 2),
        ("dev", "high", 1),
    ] {
        let path = race.join(split).join(level);
        std::fs::create_dir_all(&path).unwrap();
        for _ in 0..files {
            std::fs::write(path.join(format!("{id}.txt")), document(id) + "\n").unwrap();
            id += 1;
        }
    }
    let out = run_ok(
        finetune("RACE", &["--epochs", "2", "--micro-batch-size", "2"])
            .arg("--train-data")
            .arg(race.join("train/middle"))
            .arg(race.join("train/high"))
            .arg("--valid-data")
            .arg(race.join("dev/middle"))
            .arg(race.join("dev/high"))
            .arg("--pretrained-checkpoint")
            .arg(pretrained()),
    );
    let text = stdout(&out);
    assert!(
        text.contains("freshly initialised: multichoice_head.weight, multichoice_head.bias"),
        "{text}"
    );
    let metrics: Vec<(i64, String, u64)> = metrics_lines(&text)
        .into_iter()
        .map(|(e, n, _, t)| (e, n, t))
        .collect();
    assert_eq!(
        metrics,
        [
            (0, "dev-middle".to_string(), 4),
            (0, "dev-high".to_string(), 2),
            (1, "dev-middle".to_string(), 4),
            (1, "dev-high".to_string(), 2),
        ],
        "{text}"
    );
    assert_eq!(overall_lines(&text).len(), 2);
    // 5 documents of 2 questions in batches of 2 questions (8 sequences): 5 iterations an epoch.
    assert!(
        text.contains("eval_tasks: RACE, 2 epochs, 10 iterations"),
        "{text}"
    );
}

fn failure(command: &mut Command) -> String {
    let out = command.output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn bad_task_files_and_checkpoints_are_named_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("dev_matched.tsv");
    write_mnli(&good, 10, true, 4);
    let text = std::fs::read_to_string(&good).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mnli_error = |name: &str, contents: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        let stderr = failure(
            finetune("MNLI", &["--epochs", "1", "--micro-batch-size", "2"])
                .arg("--train-data")
                .arg(&path)
                .arg("--valid-data")
                .arg(&good),
        );
        (path, stderr)
    };
    // A row that lost its label column.
    let cut: Vec<&str> = lines[2].split('\t').take(9).collect();
    let (path, stderr) = mnli_error(
        "missing_column.tsv",
        &format!("{}\n{}\n{}\n", lines[0], lines[1], cut.join("\t")),
    );
    assert!(
        stderr.contains(&format!("{}:3: 9 columns", path.display())),
        "{stderr}"
    );
    // A label that is not one of MNLI's three.
    let relabelled = lines[1].rsplit_once('\t').unwrap().0.to_string() + "\tmaybe";
    let (path, stderr) = mnli_error("bad_label.tsv", &format!("{}\n{relabelled}\n", lines[0]));
    assert!(
        stderr.contains(&format!("{}:2: label \"maybe\"", path.display())),
        "{stderr}"
    );
    let (path, stderr) = mnli_error("empty.tsv", "");
    assert!(stderr.contains(&path.display().to_string()), "{stderr}");
    assert!(stderr.contains("empty"), "{stderr}");

    // A RACE directory without documents, and a broken JSON line.
    let race = dir.path().join("RACE/train/middle");
    std::fs::create_dir_all(&race).unwrap();
    let race_run = || {
        failure(
            finetune("RACE", &["--epochs", "1", "--micro-batch-size", "2"])
                .arg("--train-data")
                .arg(&race),
        )
    };
    assert!(race_run().contains("no *.txt files"));
    std::fs::write(race.join("1.txt"), "{\"article\": \"x\"\n").unwrap();
    let stderr = race_run();
    assert!(
        stderr.contains(&format!("{}:1", race.join("1.txt").display())),
        "{stderr}"
    );

    // A pretrained checkpoint of another architecture, and a missing --epochs.
    let mut command = finetune("MNLI", &["--epochs", "1", "--micro-batch-size", "2"]);
    command
        .arg("--train-data")
        .arg(&good)
        .arg("--pretrained-checkpoint")
        .arg(pretrained())
        .args(["--hidden-size", "32"]);
    let stderr = failure(&mut command);
    assert!(stderr.contains("has a different BERT trunk: "), "{stderr}");
    assert!(
        stderr.contains("hidden_size = 64 in the checkpoint, 32 now"),
        "{stderr}"
    );
    // A pretrained BERT given to --load, which resumes finetuning runs.
    let stderr = failure(
        finetune("MNLI", &["--epochs", "1", "--micro-batch-size", "2"])
            .arg("--train-data")
            .arg(&good)
            .arg("--load")
            .arg(pretrained()),
    );
    assert!(
        stderr.contains("holds a pretrained BERT without a task head; start from it with --pretrained-checkpoint"),
        "{stderr}"
    );
    let stderr = failure(
        finetune("MNLI", &["--micro-batch-size", "2"])
            .arg("--train-data")
            .arg(&good),
    );
    assert!(stderr.contains("give --epochs N"), "{stderr}");
}

/// Waits for `child` at most `limit` (killing it past that) and returns its output.
#[test]
fn two_tensor_parallel_processes_equal_one() {
    let dir = tempfile::tempdir().unwrap();
    let mnli = dir.path().join("MNLI");
    std::fs::create_dir(&mnli).unwrap();
    write_mnli(&mnli.join("train.tsv"), 64, false, 5);
    write_mnli(&mnli.join("dev_matched.tsv"), 30, true, 6);
    let command = |json: &Path| {
        let mut command = finetune("MNLI", &["--epochs", "2", "--micro-batch-size", "16"]);
        command
            .arg("--train-data")
            .arg(mnli.join("train.tsv"))
            .arg("--valid-data")
            .arg(mnli.join("dev_matched.tsv"))
            .arg("--pretrained-checkpoint")
            .arg(pretrained())
            .arg("--results-json")
            .arg(json);
        command
    };
    let one_json = dir.path().join("one.json");
    run_ok(&mut command(&one_json));
    let two_json = dir.path().join("two.json");
    run_job(2, "", |_| {
        let mut command = command(&two_json);
        command.args(["--tensor-model-parallel-size", "2"]);
        command
    });
    let read = |path: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let (one, two) = (read(&one_json), read(&two_json));
    assert_eq!(one["epochs"], two["epochs"]);
    assert_eq!(one["iterations"], 8);
    let (a, b) = (
        one["lm_loss"].as_f64().unwrap(),
        two["lm_loss"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() <= 1e-5 * a,
        "lm loss {b} under TP=2, {a} alone"
    );
}
