//! Training runs compared with Megatron's: the values Megatron logged for a golden run (its
//! `<name>.train.txt`) beside those ours writes to `--metrics-file`.

use std::ops::RangeInclusive;
use std::path::Path;
use std::process::Command;

use crate::{bin, run_job};

/// A value both logs carry for every training iteration.
#[derive(Clone, Copy, Debug)]
pub enum Logged {
    LmLoss,
    GradNorm,
    LoadBalancingLoss,
}

impl Logged {
    /// The field's label in Megatron's log line (`... | lm loss: 9.1E+00 | ...`).
    fn megatron_label(self) -> &'static str {
        match self {
            Logged::LmLoss => "lm loss:",
            Logged::GradNorm => "grad norm:",
            Logged::LoadBalancingLoss => "load_balancing_loss:",
        }
    }

    /// The field's key in our metrics records.
    fn metrics_key(self) -> &'static str {
        match self {
            Logged::LmLoss => "lm loss",
            Logged::GradNorm => "grad-norm",
            Logged::LoadBalancingLoss => "load_balancing_loss",
        }
    }
}

/// One training iteration: its number and the values asked for, in their order.
pub type Step = (u64, Vec<f64>);

/// The `values` of every training iteration of Megatron's log `train_txt`.
pub fn megatron_log(train_txt: &Path, values: &[Logged]) -> Vec<Step> {
    let text = std::fs::read_to_string(train_txt)
        .unwrap_or_else(|e| panic!("{}: {e}", train_txt.display()));
    let field = |line: &str, label: &str| -> f64 {
        let start = line
            .find(label)
            .unwrap_or_else(|| panic!("no {label} in {line}"))
            + label.len();
        line[start..]
            .split('|')
            .next()
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    text.lines()
        .filter(|line| line.contains("lm loss:"))
        .map(|line| {
            let iteration = line[line.find("iteration").unwrap() + "iteration".len()..]
                .split('/')
                .next()
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            let logged = values
                .iter()
                .map(|value| field(line, value.megatron_label()))
                .collect();
            (iteration, logged)
        })
        .collect()
}

/// The `values` of every training iteration of a `--metrics-file`.
pub fn metrics_steps(metrics: &Path, values: &[Logged]) -> Vec<Step> {
    std::fs::read_to_string(metrics)
        .unwrap_or_else(|e| panic!("{}: {e}", metrics.display()))
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|record| record.get("lm loss").is_some())
        .map(|record| {
            let logged = values
                .iter()
                .map(|value| {
                    record[value.metrics_key()]
                        .as_f64()
                        .unwrap_or_else(|| panic!("no {value:?} in {record}"))
                })
                .collect();
            (record["iteration"].as_u64().unwrap(), logged)
        })
        .collect()
}

/// How far one value of ours is from Megatron's over the same iterations.
#[derive(Debug)]
pub struct Distance {
    /// The largest absolute difference.
    pub largest: f64,
    /// The mean absolute difference.
    pub mean: f64,
    /// The largest difference relative to Megatron's value.
    pub largest_relative: f64,
}

/// The distance of each value of `ours` from `megatron`'s over the iterations `ours` logged,
/// all of which Megatron's log must hold.
pub fn distances(ours: &[Step], megatron: &[Step]) -> Vec<Distance> {
    let pairs: Vec<(&Vec<f64>, &Vec<f64>)> = ours
        .iter()
        .map(|(iteration, values)| {
            let logged = megatron
                .iter()
                .find(|(i, _)| i == iteration)
                .unwrap_or_else(|| panic!("Megatron logged no iteration {iteration}"));
            (values, &logged.1)
        })
        .collect();
    let width = pairs.first().map_or(0, |(values, _)| values.len());
    (0..width)
        .map(|v| {
            let absolute: Vec<f64> = pairs.iter().map(|(a, b)| (a[v] - b[v]).abs()).collect();
            Distance {
                largest: absolute.iter().cloned().fold(0.0, f64::max),
                mean: absolute.iter().sum::<f64>() / absolute.len() as f64,
                largest_relative: pairs
                    .iter()
                    .map(|(a, b)| (a[v] - b[v]).abs() / b[v].abs())
                    .fold(0.0, f64::max),
            }
        })
        .collect()
}

/// `pretrain_gpt` with `flags`, resumed from `load` by `ranks` processes launched as torchrun
/// launches them: the `values` it logged, which must be those of the `iterations`.
pub fn resume_pretrain_gpt(
    load: &Path,
    ranks: usize,
    flags: &[&str],
    values: &[Logged],
    iterations: RangeInclusive<u64>,
    dir: &Path,
) -> Vec<Step> {
    let metrics = tempfile::Builder::new()
        .suffix(".jsonl")
        .tempfile_in(dir)
        .unwrap()
        .into_temp_path();
    run_job(ranks, &load.display().to_string(), |_| {
        let mut command: Command = bin("pretrain_gpt");
        command
            .args(flags)
            .arg("--load")
            .arg(load)
            .arg("--metrics-file")
            .arg(&metrics);
        command
    });
    let steps = metrics_steps(&metrics, values);
    assert_eq!(
        steps.iter().map(|step| step.0).collect::<Vec<_>>(),
        iterations.collect::<Vec<_>>(),
        "{}: the iterations logged after the resume: {steps:?}",
        load.display()
    );
    steps
}
