//! Megatron's text output during training, byte for byte (core_v0.13 `training_log` and
//! `evaluate_and_print_results`), so that existing log parsers read our logs.

use megatron_cli::python_format::{format_exp_upper, format_fixed};
use std::fmt::Write;

/// What one `--log-interval` line reports.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationLog {
    /// Local time as `YYYY-MM-DD HH:MM:SS` (see [`local_timestamp`]).
    pub timestamp: String,
    pub iteration: u64,
    pub train_iters: u64,
    pub consumed_samples: u64,
    /// Printed only when positive, as Megatron does.
    pub skipped_samples: Option<u64>,
    /// Wall time of the interval divided by its iterations.
    pub elapsed_ms_per_iter: f64,
    /// With `--log-throughput`.
    pub throughput_tflops: Option<f64>,
    pub learning_rate: f64,
    /// With `--decoupled-lr`.
    pub decoupled_learning_rate: Option<f64>,
    pub global_batch_size: u64,
    /// Each loss averaged over the interval's non-skipped iterations, in the order they were
    /// first reported; as in Megatron, only positive averages are printed.
    pub losses: Vec<(String, f64)>,
    pub loss_scale: f64,
    pub grad_norm: Option<f64>,
    pub num_zeros: Option<u64>,
    pub params_norm: Option<f64>,
    pub skipped_iterations: u64,
    pub nan_iterations: u64,
    pub tokens_per_second: Option<f64>,
    pub mfu_percent: Option<f64>,
}

/// The iteration line: Megatron's fields in Megatron's order and formats, each ending in ` |`,
/// starting with a space.
///
/// Our two extra fields, ` tokens per second: N |` and ` MFU: X.X% |`, come after Megatron's
/// last field (`number of nan iterations`) so that parsers written for Megatron's lines, which
/// match the fields they know in order, keep working.
pub fn format_iteration_line(log: &IterationLog) -> String {
    let mut line = format!(" [{}]", log.timestamp);
    let mut field = |text: String| {
        line.push(' ');
        line.push_str(&text);
        line.push_str(" |");
    };
    field(format!(
        "iteration {:8}/{:8}",
        log.iteration, log.train_iters
    ));
    field(format!("consumed samples: {:12}", log.consumed_samples));
    if let Some(skipped) = log.skipped_samples.filter(|&skipped| skipped > 0) {
        field(format!("skipped samples: {skipped:12}"));
    }
    field(format!(
        "elapsed time per iteration (ms): {}",
        format_fixed(log.elapsed_ms_per_iter, 1)
    ));
    if let Some(throughput) = log.throughput_tflops {
        field(format!(
            "throughput per GPU (TFLOP/s/GPU): {}",
            format_fixed(throughput, 1)
        ));
    }
    field(format!(
        "learning rate: {}",
        format_exp_upper(log.learning_rate, 6)
    ));
    if let Some(rate) = log.decoupled_learning_rate {
        field(format!(
            "decoupled learning rate: {}",
            format_exp_upper(rate, 6)
        ));
    }
    field(format!("global batch size: {:5}", log.global_batch_size));
    for (key, average) in &log.losses {
        // Megatron's `avg > 0.0`: also hides NaN averages.
        if *average > 0.0 {
            field(format!("{key}: {}", format_exp_upper(*average, 6)));
        }
    }
    field(format!("loss scale: {}", format_fixed(log.loss_scale, 1)));
    if let Some(norm) = log.grad_norm {
        field(format!("grad norm: {}", format_fixed(norm, 3)));
    }
    if let Some(zeros) = log.num_zeros {
        field(format!("num zeros: {zeros}"));
    }
    if let Some(norm) = log.params_norm {
        field(format!("params norm: {}", format_fixed(norm, 3)));
    }
    field(format!(
        "number of skipped iterations: {:3}",
        log.skipped_iterations
    ));
    field(format!(
        "number of nan iterations: {:3}",
        log.nan_iterations
    ));
    if let Some(tokens) = log.tokens_per_second {
        field(format!("tokens per second: {}", format_fixed(tokens, 0)));
    }
    if let Some(mfu) = log.mfu_percent {
        field(format!("MFU: {}%", format_fixed(mfu, 1)));
    }
    line
}

/// The evaluation report: ` validation loss at <label> | <key> value: X | <key> PPL: Y | ...`
/// between two dash lines one longer than it, joined by newlines (no trailing newline).
/// `label` is Megatron's prefix: `iteration N`, `iteration N on validation set`,
/// `iteration N on test set`.
pub fn format_eval_block(label: &str, losses: &[(String, f64)]) -> String {
    let mut report = format!(" validation loss at {label} | ");
    for (key, loss) in losses {
        let _ = write!(
            report,
            "{key} value: {} | {key} PPL: {} | ",
            format_exp_upper(*loss, 6),
            format_exp_upper(perplexity(*loss), 6)
        );
    }
    let dashes = "-".repeat(report.chars().count() + 1);
    format!("{dashes}\n{report}\n{dashes}")
}

/// `exp(min(20, loss))` with Python's `min`, which keeps 20 when the loss is NaN.
fn perplexity(loss: f64) -> f64 {
    if loss < 20.0 { loss } else { 20.0 }.exp()
}

/// The local time as Megatron stamps its log lines: `YYYY-MM-DD HH:MM:SS`.
pub fn local_timestamp() -> String {
    chrono::Local::now().format("%Y-%m-%d %H:%M:%S").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minimal() -> IterationLog {
        IterationLog {
            timestamp: "2025-07-01 12:34:56".to_string(),
            iteration: 100,
            train_iters: 500_000,
            consumed_samples: 51_200,
            skipped_samples: Some(0),
            elapsed_ms_per_iter: 1234.5678,
            throughput_tflops: None,
            learning_rate: 2.9999e-05,
            decoupled_learning_rate: None,
            global_batch_size: 512,
            losses: vec![("lm loss".to_string(), 7.123456789)],
            loss_scale: 65536.0,
            grad_norm: Some(2.34567),
            num_zeros: None,
            params_norm: None,
            skipped_iterations: 0,
            nan_iterations: 0,
            tokens_per_second: None,
            mfu_percent: None,
        }
    }

    // Expected lines: Megatron's `training_log` format statements run in python3 on the same values.
    #[test]
    fn minimal_line_matches_megatron() {
        assert_eq!(
            format_iteration_line(&minimal()),
            " [2025-07-01 12:34:56] iteration      100/  500000 | consumed samples:        51200 | elapsed time per \
             iteration (ms): 1234.6 | learning rate: 2.999900E-05 | global batch size:   512 | lm loss: 7.123457E+00 | \
             loss scale: 65536.0 | grad norm: 2.346 | number of skipped iterations:   0 | number of nan iterations:   0 |"
        );
    }

    #[test]
    fn full_line_matches_megatron() {
        let log = IterationLog {
            iteration: 12345,
            train_iters: 20000,
            consumed_samples: 6_320_640,
            skipped_samples: Some(1024),
            elapsed_ms_per_iter: 456.78,
            throughput_tflops: Some(187.654),
            learning_rate: 0.00015,
            decoupled_learning_rate: Some(1.5e-05),
            losses: vec![
                ("lm loss".to_string(), 2.5),
                ("mtp loss".to_string(), 0.0),
                ("aux".to_string(), f64::NAN),
            ],
            loss_scale: 1.0,
            grad_norm: Some(0.98765),
            num_zeros: Some(17),
            params_norm: Some(1234.5678),
            skipped_iterations: 3,
            nan_iterations: 1,
            ..minimal()
        };
        let megatron = " [2025-07-01 12:34:56] iteration    12345/   20000 | consumed samples:      6320640 | skipped \
                        samples:         1024 | elapsed time per iteration (ms): 456.8 | throughput per GPU \
                        (TFLOP/s/GPU): 187.7 | learning rate: 1.500000E-04 | decoupled learning rate: 1.500000E-05 | \
                        global batch size:   512 | lm loss: 2.500000E+00 | loss scale: 1.0 | grad norm: 0.988 | num \
                        zeros: 17 | params norm: 1234.568 | number of skipped iterations:   3 | number of nan \
                        iterations:   1 |";
        assert_eq!(format_iteration_line(&log), megatron);

        let ours = IterationLog {
            tokens_per_second: Some(1_234_567.8),
            mfu_percent: Some(45.26),
            ..log
        };
        assert_eq!(
            format_iteration_line(&ours),
            format!("{megatron} tokens per second: 1234568 | MFU: 45.3% |")
        );
    }

    // Expected blocks: Megatron's `evaluate_and_print_results` string building run in python3.
    #[test]
    fn eval_block_matches_megatron() {
        let dashes = "-".repeat(96);
        assert_eq!(
            format_eval_block("iteration 1000", &[("lm loss".to_string(), 3.456789)]),
            format!(
                "{dashes}\n validation loss at iteration 1000 | lm loss value: 3.456789E+00 | lm loss PPL: 3.171498E+01 | \n{dashes}"
            )
        );
        // PPL is capped at exp(20) = 4.851652E+08, also for a NaN loss (Python's min(20, nan) is 20).
        let dashes = "-".repeat(159);
        assert_eq!(
            format_eval_block(
                "iteration 2000 on test set",
                &[("lm loss".to_string(), 25.0), ("nan loss".to_string(), f64::NAN)]
            ),
            format!(
                "{dashes}\n validation loss at iteration 2000 on test set | lm loss value: 2.500000E+01 | lm loss PPL: \
                 4.851652E+08 | nan loss value: NAN | nan loss PPL: 4.851652E+08 | \n{dashes}"
            )
        );
    }

    #[test]
    fn timestamp_is_a_local_date_and_time() {
        let stamp = local_timestamp();
        assert_eq!(stamp.len(), 19, "{stamp}");
        chrono::NaiveDateTime::parse_from_str(&stamp, "%Y-%m-%d %H:%M:%S").unwrap();
    }
}
