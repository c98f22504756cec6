//! TensorBoard itself reads our event files: scalars written through `TrainingMetrics` are
//! loaded by TensorBoard's `EventAccumulator` (scripts/check_tensorboard.py) with the tags,
//! steps and float32 values Megatron's training log would show.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_training::metrics::{EvalSplit, TrainingMetrics};
use serde_json::Value;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$MEGATRON_RS_TEST_PYTHON`, else the project venv; it must have the `tensorboard` module.
fn python_with_tensorboard() -> PathBuf {
    let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    let imports = Command::new(&python)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        imports,
        "{} cannot import tensorboard: run scripts/test.sh, which installs \
         scripts/test-requirements.txt into .venv (or point MEGATRON_RS_TEST_PYTHON at a python \
         that has them)",
        python.display()
    );
    python
}

/// What check_tensorboard.py reports of `dir`.
fn tensorboard_report(dir: &Path) -> Value {
    let out = Command::new(python_with_tensorboard())
        .arg(workspace_root().join("scripts/check_tensorboard.py"))
        .arg(dir)
        .output()
        .expect("run scripts/check_tensorboard.py");
    assert!(
        out.status.success(),
        "check_tensorboard.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("check_tensorboard.py prints JSON")
}

/// Runs check_tensorboard.py on `dir`: the file version TensorBoard parsed from the
/// `brain.Event:<n>` header and every tag's `[step, value]` pairs.
fn read_with_tensorboard(dir: &Path) -> (Option<f64>, BTreeMap<String, Vec<(i64, f64)>>) {
    let report = tensorboard_report(dir);
    let scalars = report["scalars"]
        .as_object()
        .expect("a scalars object")
        .iter()
        .map(|(tag, points)| {
            let points = points
                .as_array()
                .expect("a list of points")
                .iter()
                .map(|point| (point[0].as_i64().unwrap(), point[1].as_f64().unwrap()))
                .collect();
            (tag.clone(), points)
        })
        .collect();
    (report["file_version"].as_f64(), scalars)
}

#[test]
fn tensorboard_reads_training_and_validation_scalars() {
    let dir = tempfile::tempdir().unwrap();
    let tb_dir = dir.path().join("tensorboard");
    let mut metrics = TrainingMetrics::new(Some(&tb_dir), None).unwrap();
    metrics
        .record_iteration(
            1,
            8,
            &[
                ("lm loss", 10.5),
                ("learning-rate", 1.5e-4),
                ("iteration-time", 0.25),
            ],
        )
        .unwrap();
    metrics
        .record_iteration(
            2,
            16,
            &[
                ("lm loss", 9.75),
                ("learning-rate", 3.0e-4),
                ("iteration-time", 0.125),
            ],
        )
        .unwrap();
    metrics
        .record_eval(2, 16, EvalSplit::Validation, &[("lm loss", 9.0)])
        .unwrap();
    drop(metrics);

    let (file_version, scalars) = read_with_tensorboard(&tb_dir);
    assert_eq!(file_version, Some(2.0));

    // TensorBoard keeps float32; these are the float32 roundings of the values written.
    let lr1 = f64::from(1.5e-4f32);
    let lr2 = f64::from(3.0e-4f32);
    let ppl = f64::from(9.0f64.exp() as f32);
    let expected: BTreeMap<String, Vec<(i64, f64)>> = [
        ("lm loss", vec![(1, 10.5), (2, 9.75)]),
        ("lm loss vs samples", vec![(8, 10.5), (16, 9.75)]),
        ("learning-rate", vec![(1, lr1), (2, lr2)]),
        ("learning-rate vs samples", vec![(8, lr1), (16, lr2)]),
        ("iteration-time", vec![(1, 0.25), (2, 0.125)]),
        ("lm loss validation", vec![(2, 9.0)]),
        ("lm loss validation vs samples", vec![(16, 9.0)]),
        ("lm loss validation ppl", vec![(2, ppl)]),
        ("lm loss validation ppl vs samples", vec![(16, ppl)]),
    ]
    .into_iter()
    .map(|(tag, points)| (tag.to_owned(), points))
    .collect();
    assert_eq!(scalars, expected);
}

/// The run's flags are written as Megatron's `write_args_to_tensorboard` writes them: one text
/// summary per argument, Python's `str()` of its value, which TensorBoard's text plugin reads.
#[test]
fn tensorboard_reads_the_args_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let tb_dir = dir.path().join("tensorboard");
    let mut metrics = TrainingMetrics::new(Some(&tb_dir), None).unwrap();
    let args = serde_json::json!({
        "seed": 1234, "lr": 1e-5, "bf16": true, "split": null,
        "lr_decay_style": "cosine", "profile_ranks": [0, 1],
    });
    metrics.record_args(7, &args).unwrap();
    drop(metrics);
    let report = tensorboard_report(&tb_dir);
    let texts: BTreeMap<String, Value> = report["texts"]
        .as_object()
        .expect("a texts object")
        .iter()
        .map(|(tag, points)| (tag.clone(), points.clone()))
        .collect();
    let expected: BTreeMap<String, Value> = [
        ("seed", "1234"),
        ("lr", "1e-05"),
        ("bf16", "True"),
        ("split", "None"),
        ("lr_decay_style", "cosine"),
        ("profile_ranks", "[0, 1]"),
    ]
    .into_iter()
    .map(|(name, text)| {
        (
            format!("{name}/text_summary"),
            serde_json::json!([[7, text]]),
        )
    })
    .collect();
    assert_eq!(texts, expected);
}
