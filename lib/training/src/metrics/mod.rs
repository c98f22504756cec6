//! Training metrics as Megatron writes them: TensorBoard scalars (`--tensorboard-dir`) and, our
//! addition, a JSON-lines file with the same numbers for scripts.
//!
//! Tag names are Megatron's (`training_log` and `evaluate_and_print_results` of core_v0.13.0);
//! the training loop passes them to [`TrainingMetrics::record_iteration`]:
//!
//! | tag | value | `vs samples` twin |
//! |---|---|---|
//! | `learning-rate` | learning rate | yes |
//! | `decoupled-learning-rate` | learning rate of `--decoupled-lr` parameters | no |
//! | `skipped-train-samples` | samples skipped so far | no |
//! | `batch-size` | global batch size | yes |
//! | each loss key, e.g. `lm loss` | averaged loss | yes |
//! | `loss-scale` | fp16 loss scale | yes |
//! | `world-size` | number of ranks | yes |
//! | `grad-norm` | gradient norm before clipping | yes |
//! | `num-zeros` | zeros in the gradient | yes |
//! | `params-norm` | parameter norm | yes |
//! | `mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes`, `mem-allocated-count` | CUDA allocator statistics | no |
//! | `iteration-time` | seconds per iteration | no |
//! | `<timer>-time`, e.g. `forward-backward-time` | timer maxima (`--log-timers-to-tensorboard`) | no |
//! | `throughput` | TFLOP/s per GPU | no |
//! | `iter-energy/gpu`, `power/gpu` | joules per iteration, watts | no |
//!
//! A twin repeats the value under `"<tag> vs samples"` at step = consumed samples. Validation
//! writes `"<key> validation"` and `"<key> validation ppl"` (perplexity `exp(min(20, loss))`),
//! each with its twin.

mod event;
mod jsonl;
mod protobuf;
mod tensorboard;
mod tfrecord;

pub use jsonl::JsonlMetrics;
pub use tensorboard::TensorBoardWriter;

use std::path::Path;

use anyhow::{Context, Result};
use megatron_data::cache::python_str_of_json;
use serde_json::Map;

/// Which split an evaluation scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalSplit {
    Validation,
    Test,
}

/// Megatron caps the exponent so that a diverged loss still gives a finite perplexity.
const MAX_PPL_EXPONENT: f64 = 20.0;

/// Tags that Megatron writes against the iteration only.
const WITHOUT_SAMPLES_TWIN: [&str; 10] = [
    "decoupled-learning-rate",
    "skipped-train-samples",
    "mem-reserved-bytes",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
    "mem-allocated-count",
    "iteration-time",
    "throughput",
    "iter-energy/gpu",
    "power/gpu",
];

fn has_samples_twin(tag: &str) -> bool {
    !WITHOUT_SAMPLES_TWIN.contains(&tag) && !tag.ends_with("-time")
}

/// `exp(min(20, loss))`, Megatron's validation perplexity.
pub fn perplexity(loss: f64) -> f64 {
    loss.min(MAX_PPL_EXPONENT).exp()
}

/// Where the training loop sends its numbers: TensorBoard, a JSON-lines file, both or neither.
/// Every `record_*` call is flushed, so TensorBoard shows progress while training runs.
pub struct TrainingMetrics {
    tensorboard: Option<TensorBoardWriter>,
    jsonl: Option<JsonlMetrics>,
}

impl TrainingMetrics {
    pub fn new(tensorboard_dir: Option<&Path>, jsonl_path: Option<&Path>) -> Result<Self> {
        Ok(TrainingMetrics {
            tensorboard: tensorboard_dir.map(TensorBoardWriter::create).transpose()?,
            jsonl: jsonl_path.map(JsonlMetrics::create).transpose()?,
        })
    }

    /// Logs one training iteration: each `(tag, value)` at step `iteration`, its `vs samples`
    /// twin where Megatron writes one, and the JSON line
    /// `{"iteration", "consumed_samples", <tag>: value, ...}`.
    pub fn record_iteration(
        &mut self,
        iteration: u64,
        consumed_samples: u64,
        scalars: &[(&str, f64)],
    ) -> Result<()> {
        let scalar_tags: Vec<(String, f64, bool)> = scalars
            .iter()
            .map(|&(tag, value)| (tag.to_owned(), value, has_samples_twin(tag)))
            .collect();
        self.write_tensorboard(iteration, consumed_samples, &scalar_tags)?;
        self.write_jsonl(iteration, consumed_samples, None, scalars)
    }

    /// Writes every flag of the run as a TensorBoard text summary at step `iteration`, as
    /// Megatron's `write_args_to_tensorboard` does: the tag is the argument's name, the text
    /// Python's `str()` of its value.
    pub fn record_args(&mut self, iteration: u64, args: &serde_json::Value) -> Result<()> {
        let Some(writer) = self.tensorboard.as_mut() else {
            return Ok(());
        };
        if let Some(flags) = args.as_object() {
            for (name, value) in flags {
                writer.add_text(name, &python_str_of_json(value), iteration as i64)?;
            }
        }
        writer.flush()
    }

    /// Logs an evaluation of `split`: for each `(key, loss)`, `"<key> validation"` and
    /// `"<key> validation ppl"` with their twins (Megatron writes the test set under the same
    /// tags), and the JSON line
    /// `{"iteration", "consumed_samples", "split": "validation"|"test", <key>: loss, "<key> ppl": ppl}`.
    pub fn record_eval(
        &mut self,
        iteration: u64,
        consumed_samples: u64,
        split: EvalSplit,
        losses: &[(&str, f64)],
    ) -> Result<()> {
        let mut scalar_tags = Vec::with_capacity(2 * losses.len());
        let mut fields = Vec::with_capacity(2 * losses.len());
        for &(key, loss) in losses {
            let ppl = perplexity(loss);
            scalar_tags.push((format!("{key} validation"), loss, true));
            scalar_tags.push((format!("{key} validation ppl"), ppl, true));
            fields.push((key.to_owned(), loss));
            fields.push((format!("{key} ppl"), ppl));
        }
        self.write_tensorboard(iteration, consumed_samples, &scalar_tags)?;
        let fields: Vec<(&str, f64)> = fields.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let split = match split {
            EvalSplit::Validation => "validation",
            EvalSplit::Test => "test",
        };
        self.write_jsonl(iteration, consumed_samples, Some(split), &fields)
    }

    /// Writes `(tag, value, with_twin)` scalars, each followed by its twin when asked for.
    fn write_tensorboard(
        &mut self,
        iteration: u64,
        consumed_samples: u64,
        scalars: &[(String, f64, bool)],
    ) -> Result<()> {
        let Some(writer) = self.tensorboard.as_mut() else {
            return Ok(());
        };
        let iteration = step(iteration, "iteration")?;
        let samples = step(consumed_samples, "consumed samples")?;
        for (tag, value, with_twin) in scalars {
            // TensorBoard stores scalars as float32, as PyTorch's SummaryWriter does.
            writer.add_scalar(tag, *value as f32, iteration)?;
            if *with_twin {
                writer.add_scalar(&format!("{tag} vs samples"), *value as f32, samples)?;
            }
        }
        writer.flush()
    }

    fn write_jsonl(
        &mut self,
        iteration: u64,
        consumed_samples: u64,
        split: Option<&str>,
        scalars: &[(&str, f64)],
    ) -> Result<()> {
        let Some(jsonl) = self.jsonl.as_mut() else {
            return Ok(());
        };
        let mut record = Map::new();
        record.insert("iteration".into(), iteration.into());
        record.insert("consumed_samples".into(), consumed_samples.into());
        if let Some(split) = split {
            record.insert("split".into(), split.into());
        }
        for &(tag, value) in scalars {
            record.insert(tag.into(), value.into());
        }
        jsonl.write(&record)
    }
}

fn step(value: u64, what: &str) -> Result<i64> {
    i64::try_from(value).with_context(|| format!("{what} {value} exceeds TensorBoard's int64 step"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn megatron_twins_losses_and_rates_but_not_times() {
        for tag in [
            "learning-rate",
            "batch-size",
            "lm loss",
            "loss-scale",
            "grad-norm",
            "params-norm",
            "num-zeros",
            "world-size",
        ] {
            assert!(has_samples_twin(tag), "{tag}");
        }
        for tag in [
            "iteration-time",
            "forward-backward-time",
            "throughput",
            "mem-allocated-bytes",
            "power/gpu",
            "decoupled-learning-rate",
        ] {
            assert!(!has_samples_twin(tag), "{tag}");
        }
    }

    #[test]
    fn perplexity_is_capped_at_exp_20() {
        assert_eq!(perplexity(1.0), std::f64::consts::E);
        // python -c "import math; print(repr(math.exp(20)))"
        assert_eq!(perplexity(25.0), 485_165_195.409_790_3);
    }

    #[test]
    fn jsonl_lines_carry_iteration_samples_split_and_scalars() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut metrics = TrainingMetrics::new(None, Some(&path)).unwrap();
        metrics
            .record_iteration(10, 320, &[("lm loss", 7.25), ("learning-rate", 1e-4)])
            .unwrap();
        metrics
            .record_eval(10, 320, EvalSplit::Validation, &[("lm loss", 1.0)])
            .unwrap();
        metrics
            .record_iteration(11, 352, &[("lm loss", f64::NAN)])
            .unwrap();

        let lines: Vec<Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        assert_eq!(
            lines,
            [
                serde_json::json!({"iteration": 10, "consumed_samples": 320, "lm loss": 7.25, "learning-rate": 1e-4}),
                serde_json::json!({"iteration": 10, "consumed_samples": 320, "split": "validation", "lm loss": 1.0, "lm loss ppl": std::f64::consts::E}),
                serde_json::json!({"iteration": 11, "consumed_samples": 352, "lm loss": null}),
            ]
        );
    }
}
