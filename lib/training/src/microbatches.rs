//! How many micro-batches make one global batch, including Megatron's batch-size ramp-up
//! (`--rampup-batch-size start increment samples`) and step schedule
//! (`--step-batch-size-schedule`), and the iteration count of sample-based training.

use anyhow::{bail, ensure, Context, Result};

/// `--rampup-batch-size <start> <increment> <ramp samples>`: grow the global batch from `start`
/// to `--global-batch-size` in steps of `increment`, spread evenly over the first `ramp_samples`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchRampup {
    pub start: u64,
    pub increment: u64,
    pub ramp_samples: u64,
}

impl BatchRampup {
    /// The flag's three values, in order.
    pub fn from_flag_values(values: &[u64]) -> Result<Self> {
        match *values {
            [start, increment, ramp_samples] => Ok(Self { start, increment, ramp_samples }),
            _ => bail!(
                "--rampup-batch-size takes three values: <start batch size> <batch size increment> <ramp-up samples>, got {}",
                values.len()
            ),
        }
    }
}

/// `--step-batch-size-schedule "THRESHOLD:BATCH ..."` (Megatron main's
/// `StepBatchsizeNumMicroBatchesCalculator`): the global batch is BATCH once THRESHOLD tokens
/// (THRESHOLD / seq-length samples) have been trained on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepSchedule {
    /// (threshold in samples, global batch size), thresholds rising from 0.
    steps: Vec<(u64, u64)>,
}

/// A number with an optional K, M, B or T suffix (10^3 to 10^12), fractions allowed before
/// the suffix, truncated as Python's `int(float(value) * multiplier)`.
fn suffixed_number(text: &str, entry: &str) -> Result<u64> {
    let text = text.trim().to_uppercase();
    let (digits, multiplier) = match text.chars().last() {
        Some('K') => (&text[..text.len() - 1], 1e3),
        Some('M') => (&text[..text.len() - 1], 1e6),
        Some('B') => (&text[..text.len() - 1], 1e9),
        Some('T') => (&text[..text.len() - 1], 1e12),
        _ => (&text[..], 1.0),
    };
    let value: f64 = digits
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite() && *v >= 0.0)
        .with_context(|| {
            format!("--step-batch-size-schedule: {entry:?}: {text:?} is not a number ≥ 0")
        })?;
    Ok((value * multiplier) as u64)
}

impl StepSchedule {
    /// Megatron's schedule string, thresholds in tokens of `seq_length`.
    pub fn parse(text: &str, seq_length: u64) -> Result<Self> {
        ensure!(
            seq_length > 0,
            "--step-batch-size-schedule needs a positive --seq-length"
        );
        let mut steps = text
            .replace(',', " ")
            .split_whitespace()
            .map(|entry| {
                let (threshold, batch) = entry.split_once(':').with_context(|| {
                    format!("--step-batch-size-schedule: {entry:?} is not THRESHOLD:BATCH_SIZE")
                })?;
                Ok((
                    suffixed_number(threshold, entry)? / seq_length,
                    suffixed_number(batch, entry)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        steps.sort_by_key(|&(threshold, _)| threshold);
        ensure!(
            !steps.is_empty(),
            "--step-batch-size-schedule needs at least one THRESHOLD:BATCH_SIZE"
        );
        ensure!(
            steps[0].0 == 0,
            "--step-batch-size-schedule: the first threshold must be 0, got {} samples",
            steps[0].0
        );
        for pair in steps.windows(2) {
            ensure!(
                pair[1].0 > pair[0].0,
                "--step-batch-size-schedule: thresholds must rise, got {} samples twice (each \
                 threshold is in tokens, divided by --seq-length)",
                pair[0].0
            );
        }
        if let Some(&(threshold, _)) = steps.iter().find(|&&(_, batch)| batch == 0) {
            bail!("--step-batch-size-schedule: the batch size from {threshold} samples on is 0");
        }
        Ok(Self { steps })
    }

    fn global_batch_size_at(&self, consumed_samples: u64) -> u64 {
        self.steps
            .iter()
            .take_while(|&&(threshold, _)| consumed_samples >= threshold)
            .last()
            .map_or(self.steps[0].1, |&(_, batch)| batch)
    }

    /// The largest global batch of the schedule.
    pub fn largest_global_batch_size(&self) -> u64 {
        self.steps
            .iter()
            .map(|&(_, batch)| batch)
            .max()
            .unwrap_or(0)
    }
}

/// How the global batch size changes as training goes: Megatron's ramp-up or step schedule.
#[derive(Debug, Clone, PartialEq)]
pub enum BatchSizeSchedule {
    Rampup(BatchRampup),
    Steps(StepSchedule),
}

/// A schedule checked against the final global batch size.
#[derive(Debug, Clone, PartialEq)]
enum Schedule {
    Ramp(Ramp),
    Steps(StepSchedule),
}

impl Schedule {
    fn new(schedule: BatchSizeSchedule, global_batch_size: u64) -> Result<Self> {
        Ok(match schedule {
            BatchSizeSchedule::Rampup(rampup) => {
                Schedule::Ramp(Ramp::new(rampup, global_batch_size)?)
            }
            BatchSizeSchedule::Steps(steps) => Schedule::Steps(steps),
        })
    }

    fn global_batch_size_at(&self, consumed_samples: u64) -> u64 {
        match self {
            Schedule::Ramp(ramp) => ramp.global_batch_size_at(consumed_samples),
            Schedule::Steps(steps) => steps.global_batch_size_at(consumed_samples),
        }
    }
}

/// A ramp checked against the final global batch size.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Ramp {
    rampup: BatchRampup,
    final_global_batch_size: u64,
    /// A float, as in Megatron: the increments need not divide the ramp's samples evenly.
    samples_per_increment: f64,
}

impl Ramp {
    fn new(rampup: BatchRampup, final_global_batch_size: u64) -> Result<Self> {
        let BatchRampup {
            start,
            increment,
            ramp_samples,
        } = rampup;
        ensure!(
            final_global_batch_size > 0,
            "global batch size should be positive, got {final_global_batch_size}"
        );
        ensure!(
            start > 0,
            "--rampup-batch-size: start batch size should be positive, got {start}"
        );
        ensure!(
            increment > 0,
            "--rampup-batch-size: batch size increment should be positive, got {increment}"
        );
        // Megatron accepts 0 here but then divides 0 by 0 at the first update.
        ensure!(
            ramp_samples > 0,
            "--rampup-batch-size: ramp-up samples should be positive, got {ramp_samples}"
        );
        ensure!(
            start <= final_global_batch_size,
            "--rampup-batch-size: expected global batch size to be greater than or equal to start batch size, \
             got {final_global_batch_size} and {start}"
        );
        let span = final_global_batch_size - start;
        ensure!(
            span % increment == 0,
            "--rampup-batch-size: expected global batch size interval ({span}) to be divisible by global batch size increment ({increment})"
        );
        let increments = span / increment;
        // Megatron divides by zero here.
        ensure!(
            increments > 0,
            "--rampup-batch-size: start batch size {start} already equals --global-batch-size: there is nothing to ramp"
        );
        Ok(Self {
            rampup,
            final_global_batch_size,
            samples_per_increment: ramp_samples as f64 / increments as f64,
        })
    }

    /// The global batch size once `consumed_samples` have been trained on.
    fn global_batch_size_at(&self, consumed_samples: u64) -> u64 {
        if consumed_samples > self.rampup.ramp_samples {
            return self.final_global_batch_size;
        }
        // Truncation toward zero, as Python's int() of the float quotient.
        let increments_done = (consumed_samples as f64 / self.samples_per_increment) as u64;
        self.rampup.start + increments_done * self.rampup.increment
    }
}

/// Megatron's number-of-micro-batches calculator (constant, ramp-up or step schedule).
#[derive(Debug, Clone, PartialEq)]
pub struct MicrobatchCalculator {
    micro_batch_size: u64,
    data_parallel_size: u64,
    schedule: Option<Schedule>,
    decrease_batch_size_if_needed: bool,
    current_global_batch_size: u64,
    current_running_global_batch_size: u64,
    num_microbatches: u64,
}

impl MicrobatchCalculator {
    /// `decrease_batch_size_if_needed` (`--decrease-batch-size-if-needed`) rounds the global
    /// batch down to a multiple of `micro_batch_size × data_parallel_size` instead of refusing it.
    pub fn new(
        global_batch_size: u64,
        micro_batch_size: u64,
        data_parallel_size: u64,
        schedule: Option<BatchSizeSchedule>,
        decrease_batch_size_if_needed: bool,
    ) -> Result<Self> {
        ensure!(
            micro_batch_size > 0,
            "--micro-batch-size should be positive, got {micro_batch_size}"
        );
        ensure!(
            data_parallel_size > 0,
            "the data-parallel size should be positive, got {data_parallel_size}"
        );
        ensure!(
            !(decrease_batch_size_if_needed
                && matches!(schedule, Some(BatchSizeSchedule::Steps(_)))),
            "--step-batch-size-schedule does not go with --decrease-batch-size-if-needed"
        );
        let mut calculator = Self {
            micro_batch_size,
            data_parallel_size,
            schedule: schedule
                .map(|schedule| Schedule::new(schedule, global_batch_size))
                .transpose()?,
            decrease_batch_size_if_needed,
            current_global_batch_size: global_batch_size,
            current_running_global_batch_size: global_batch_size,
            num_microbatches: 0,
        };
        if calculator.schedule.is_some() {
            calculator.update(0, false)?;
            return Ok(calculator);
        }
        let per_step = calculator.micro_batch_times_data_parallel();
        if !decrease_batch_size_if_needed {
            ensure!(
                global_batch_size % per_step == 0,
                "global batch size ({global_batch_size}) is not divisible by micro batch size ({micro_batch_size}) \
                 times data parallel size ({data_parallel_size})"
            );
        }
        calculator.current_running_global_batch_size = round_down(global_batch_size, per_step);
        calculator.num_microbatches = calculator.current_running_global_batch_size / per_step;
        ensure!(
            calculator.num_microbatches >= 1,
            "number of microbatches should be at least 1, got 0 (global batch size {global_batch_size} < micro batch size \
             {micro_batch_size} × data parallel size {data_parallel_size})"
        );
        Ok(calculator)
    }

    /// Moves along the schedule to `consumed_samples` (nothing to do without one). With
    /// `consistency_check`, a batch size that the micro-batches cannot tile is an error unless
    /// batches may be decreased. Nothing changes when it fails.
    pub fn update(&mut self, consumed_samples: u64, consistency_check: bool) -> Result<()> {
        let Some(schedule) = &self.schedule else {
            return Ok(());
        };
        let current = schedule.global_batch_size_at(consumed_samples);
        let per_step = self.micro_batch_times_data_parallel();
        let tiles = current % per_step == 0;
        if consistency_check && !self.decrease_batch_size_if_needed {
            ensure!(
                tiles,
                "current global batch size ({current}) is not divisible by micro-batch-size ({}) times data parallel size ({})",
                self.micro_batch_size,
                self.data_parallel_size
            );
        }
        let running = if self.decrease_batch_size_if_needed && !tiles {
            round_down(current, per_step)
        } else {
            current
        };
        let num_microbatches = running / per_step;
        if consistency_check {
            ensure!(
                num_microbatches >= 1,
                "number of microbatches should be at least 1, got 0 (global batch size {current} < micro batch size {} × \
                 data parallel size {})",
                self.micro_batch_size,
                self.data_parallel_size
            );
        }
        self.current_global_batch_size = current;
        self.current_running_global_batch_size = running;
        self.num_microbatches = num_microbatches;
        Ok(())
    }

    /// The global batch size the schedule asks for now.
    pub fn current_global_batch_size(&self) -> u64 {
        self.current_global_batch_size
    }

    /// The global batch size actually trained now: the current one, rounded down to a multiple of
    /// `micro_batch_size × data_parallel_size` under `--decrease-batch-size-if-needed`.
    pub fn current_running_global_batch_size(&self) -> u64 {
        self.current_running_global_batch_size
    }

    pub fn num_microbatches(&self) -> u64 {
        self.num_microbatches
    }

    pub fn micro_batch_size(&self) -> u64 {
        self.micro_batch_size
    }

    pub fn micro_batch_times_data_parallel(&self) -> u64 {
        self.micro_batch_size * self.data_parallel_size
    }
}

fn round_down(batch_size: u64, divisor: u64) -> u64 {
    batch_size / divisor * divisor
}

/// The iteration count of sample-based training (`--train-samples`), as Megatron's
/// `update_train_iters`. With a ramp: walk it one global batch at a time while within both the
/// ramp and the training samples (the last ramp batch may overshoot them), then add whole full
/// batches; a partial last batch is dropped. With a step schedule: walk it to the training
/// samples (the last batch may overshoot them).
pub fn train_iters_from_samples(
    train_samples: u64,
    global_batch_size: u64,
    schedule: Option<&BatchSizeSchedule>,
) -> Result<u64> {
    ensure!(
        global_batch_size > 0,
        "--global-batch-size should be positive, got {global_batch_size}"
    );
    let rampup = match schedule {
        None => return Ok(train_samples / global_batch_size),
        Some(BatchSizeSchedule::Steps(steps)) => {
            let (mut iterations, mut consumed) = (0, 0);
            while consumed < train_samples {
                consumed += steps.global_batch_size_at(consumed);
                iterations += 1;
            }
            return Ok(iterations);
        }
        Some(BatchSizeSchedule::Rampup(rampup)) => rampup,
    };
    let ramp = Ramp::new(*rampup, global_batch_size)?;
    let mut iterations = 0;
    let mut consumed = 0;
    while consumed <= rampup.ramp_samples && consumed <= train_samples {
        consumed += ramp.global_batch_size_at(consumed);
        iterations += 1;
    }
    Ok(iterations + train_samples.saturating_sub(consumed) / global_batch_size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Start 32, +32 per step, over 1000 samples, to 128: 3 increments, one per 333.33 samples.
    const RAMP: BatchRampup = BatchRampup {
        start: 32,
        increment: 32,
        ramp_samples: 1000,
    };

    #[test]
    fn constant_batch_splits_into_micro_batches() {
        let calculator = MicrobatchCalculator::new(128, 4, 8, None, false).unwrap();
        assert_eq!(calculator.num_microbatches(), 4); // 128 / (4 × 8)
        assert_eq!(calculator.current_global_batch_size(), 128);
        assert_eq!(calculator.micro_batch_times_data_parallel(), 32);

        let error = MicrobatchCalculator::new(100, 4, 8, None, false)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("global batch size (100) is not divisible by micro batch size (4) times data parallel size (8)"),
            "{error}"
        );

        // Decreased to the multiple of 32 below 100.
        let decreased = MicrobatchCalculator::new(100, 4, 8, None, true).unwrap();
        assert_eq!(
            (
                decreased.current_global_batch_size(),
                decreased.current_running_global_batch_size(),
                decreased.num_microbatches()
            ),
            (100, 96, 3)
        );

        let error = MicrobatchCalculator::new(16, 4, 8, None, true)
            .unwrap_err()
            .to_string();
        assert!(error.contains("at least 1"), "{error}");
    }

    #[test]
    fn rampup_sequence() {
        let mut calculator =
            MicrobatchCalculator::new(128, 4, 2, Some(BatchSizeSchedule::Rampup(RAMP)), false)
                .unwrap();
        assert_eq!(
            (
                calculator.current_global_batch_size(),
                calculator.num_microbatches()
            ),
            (32, 4)
        );
        // Batch = 32 + floor(consumed / 333.33) × 32 up to 1000 samples, then 128.
        for (consumed, batch) in [
            (332, 32),
            (334, 64),
            (666, 64),
            (667, 96),
            (999, 96),
            (1000, 128),
            (1001, 128),
            (50_000, 128),
        ] {
            calculator.update(consumed, true).unwrap();
            assert_eq!(
                calculator.current_global_batch_size(),
                batch,
                "after {consumed} samples"
            );
            assert_eq!(
                calculator.num_microbatches(),
                batch / 8,
                "after {consumed} samples"
            );
        }
    }

    #[test]
    fn ramp_batches_that_do_not_tile_are_checked_or_decreased() {
        // Batches 30, 60, 90, 120 against micro-batch 4 × dp 2 = 8.
        let ramp = BatchRampup {
            start: 30,
            increment: 30,
            ramp_samples: 300,
        };
        let mut strict =
            MicrobatchCalculator::new(120, 4, 2, Some(BatchSizeSchedule::Rampup(ramp)), false)
                .unwrap();
        assert_eq!(strict.current_global_batch_size(), 30);
        let error = strict.update(0, true).unwrap_err().to_string();
        assert!(
            error.contains(
                "current global batch size (30) is not divisible by micro-batch-size (4)"
            ),
            "{error}"
        );
        strict.update(400, true).unwrap();
        assert_eq!(strict.num_microbatches(), 15); // 120 / 8

        let mut decreasing =
            MicrobatchCalculator::new(120, 4, 2, Some(BatchSizeSchedule::Rampup(ramp)), true)
                .unwrap();
        decreasing.update(150, true).unwrap(); // 150 / 100 → batch 60, decreased to 56
        assert_eq!(
            (
                decreasing.current_global_batch_size(),
                decreasing.current_running_global_batch_size()
            ),
            (60, 56)
        );
        assert_eq!(decreasing.num_microbatches(), 7);
    }

    #[test]
    fn invalid_ramps_are_refused() {
        let cases = [
            (
                BatchRampup { start: 256, ..RAMP },
                "greater than or equal to start batch size",
            ),
            (
                BatchRampup {
                    increment: 20,
                    ..RAMP
                },
                "interval (96) to be divisible by global batch size increment (20)",
            ),
            (BatchRampup { start: 128, ..RAMP }, "nothing to ramp"),
            (
                BatchRampup {
                    increment: 0,
                    ..RAMP
                },
                "increment should be positive",
            ),
            (
                BatchRampup {
                    ramp_samples: 0,
                    ..RAMP
                },
                "ramp-up samples should be positive",
            ),
        ];
        for (ramp, needle) in cases {
            let error =
                MicrobatchCalculator::new(128, 4, 2, Some(BatchSizeSchedule::Rampup(ramp)), false)
                    .unwrap_err()
                    .to_string();
            assert!(error.contains(needle), "expected '{needle}' in: {error}");
        }
        assert!(BatchRampup::from_flag_values(&[32, 32])
            .unwrap_err()
            .to_string()
            .contains("three values"));
        assert_eq!(
            BatchRampup::from_flag_values(&[32, 32, 1000]).unwrap(),
            RAMP
        );
    }

    #[test]
    fn train_iters_walk_the_ramp_then_count_full_batches() {
        // No ramp: 10000 // 128.
        assert_eq!(train_iters_from_samples(10_000, 128, None).unwrap(), 78);
        // Ramp: 11 batches of 32 (0 → 352), 5 of 64 (352 → 672), 4 of 96 (672 → 1056 > 1000):
        // 20 iterations, then (10000 - 1056) // 128 = 69.
        assert_eq!(
            train_iters_from_samples(10_000, 128, Some(&BatchSizeSchedule::Rampup(RAMP))).unwrap(),
            89
        );
        // Stopping inside the ramp: 11 × 32 (→ 352), then 64s to 416, 480 and 544 (> 500): 14,
        // one batch past the requested samples, as in Megatron.
        assert_eq!(
            train_iters_from_samples(500, 128, Some(&BatchSizeSchedule::Rampup(RAMP))).unwrap(),
            14
        );
        assert_eq!(
            train_iters_from_samples(1056, 128, Some(&BatchSizeSchedule::Rampup(RAMP))).unwrap(),
            20
        );
    }

    #[test]
    fn step_schedules_parse_as_megatron_and_set_the_batch_by_tokens() {
        // Tokens of sequences of 1000: thresholds 0, 2.5M and 5M tokens are 0, 2500 and 5000
        // samples; the entries come in any order, commas or spaces between them.
        let steps = StepSchedule::parse("5M:64, 0:16 2.5m:32", 1000).unwrap();
        let schedule = BatchSizeSchedule::Steps(steps.clone());
        let mut calculator =
            MicrobatchCalculator::new(16, 4, 2, Some(schedule.clone()), false).unwrap();
        for (consumed, batch) in [(0, 16), (2499, 16), (2500, 32), (4999, 32), (5000, 64)] {
            calculator.update(consumed, true).unwrap();
            assert_eq!(calculator.current_global_batch_size(), batch, "{consumed}");
            assert_eq!(calculator.num_microbatches(), batch / 8, "{consumed}");
        }
        assert_eq!(steps.largest_global_batch_size(), 64);
        // 157 batches of 16 reach 2512 samples, 78 of 32 reach 5008, then 1 of 64.
        assert_eq!(
            train_iters_from_samples(5010, 64, Some(&schedule)).unwrap(),
            157 + 78 + 1
        );
        assert_eq!(
            StepSchedule::parse("0:1K", 8)
                .unwrap()
                .global_batch_size_at(0),
            1000
        );
        for (bad, says) in [
            ("10:16", "first threshold must be 0"),
            ("0:16 0:32", "thresholds must rise"),
            ("0:16 5", "is not THRESHOLD:BATCH_SIZE"),
            ("0:0", "is 0"),
            ("0:x", "is not a number"),
        ] {
            let error = StepSchedule::parse(bad, 1).unwrap_err().to_string();
            assert!(error.contains(says), "{bad}: {error}");
        }
        let error = MicrobatchCalculator::new(16, 4, 2, Some(schedule), true).unwrap_err();
        assert!(error
            .to_string()
            .contains("--decrease-batch-size-if-needed"));
    }
}
