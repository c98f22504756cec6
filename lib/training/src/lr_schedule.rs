//! Megatron's `OptimizerParamScheduler`: the learning-rate schedule (warmup, then constant,
//! linear, cosine, inverse-square-root or warmup-stable-decay) and the weight-decay increment,
//! both counted in **samples**, plus the derivation of its horizons from the command line and
//! the checkpointed state with Megatron's field names.

use anyhow::{anyhow, bail, Result};
use megatron_cli::{bail_usage, usage_error};
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;
use std::fmt;
use std::str::FromStr;

/// A flag value that is not one of the choices the flag accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: unknown value '{value}' (expected one of: {expected})")]
pub struct UnknownChoice {
    pub flag: &'static str,
    pub value: String,
    pub expected: String,
}

/// The fixed set of spellings of a flag with choices.
trait FlagChoice: Copy + 'static {
    const FLAG: &'static str;
    const ALL: &'static [Self];
    fn as_str(self) -> &'static str;

    fn parse_choice(value: &str) -> Result<Self, UnknownChoice> {
        Self::ALL
            .iter()
            .copied()
            .find(|choice| choice.as_str() == value)
            .ok_or_else(|| UnknownChoice {
                flag: Self::FLAG,
                value: value.to_string(),
                expected: Self::ALL
                    .iter()
                    .map(|choice| choice.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

/// `--lr-decay-style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LrDecayStyle {
    #[serde(rename = "constant")]
    Constant,
    #[serde(rename = "linear")]
    Linear,
    #[serde(rename = "cosine")]
    Cosine,
    #[serde(rename = "inverse-square-root")]
    InverseSquareRoot,
    /// Warmup-stable-decay: constant at the peak, then annealed over the last
    /// `--lr-wsd-decay-iters/samples` of the decay horizon.
    #[serde(rename = "WSD")]
    Wsd,
}

impl FlagChoice for LrDecayStyle {
    const FLAG: &'static str = "--lr-decay-style";
    const ALL: &'static [Self] = &[
        Self::Constant,
        Self::Linear,
        Self::Cosine,
        Self::InverseSquareRoot,
        Self::Wsd,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
            Self::InverseSquareRoot => "inverse-square-root",
            Self::Wsd => "WSD",
        }
    }
}

/// `--lr-wsd-decay-style`: the shape of the annealing phase of [`LrDecayStyle::Wsd`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WsdDecayStyle {
    Linear,
    Cosine,
    Exponential,
    MinusSqrt,
}

impl FlagChoice for WsdDecayStyle {
    const FLAG: &'static str = "--lr-wsd-decay-style";
    const ALL: &'static [Self] = &[
        Self::Exponential,
        Self::Linear,
        Self::Cosine,
        Self::MinusSqrt,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Linear => "linear",
            Self::Cosine => "cosine",
            Self::Exponential => "exponential",
            Self::MinusSqrt => "minus_sqrt",
        }
    }
}

/// `--weight-decay-incr-style`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WdIncrStyle {
    #[serde(rename = "constant")]
    Constant,
    #[serde(rename = "linear")]
    Linear,
    #[serde(rename = "cosine")]
    Cosine,
}

impl FlagChoice for WdIncrStyle {
    const FLAG: &'static str = "--weight-decay-incr-style";
    const ALL: &'static [Self] = &[Self::Constant, Self::Linear, Self::Cosine];

    fn as_str(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
        }
    }
}

macro_rules! flag_choice_impls {
    ($($choice:ty),*) => {$(
        impl $choice {
            /// The flag value, spelled as Megatron spells it.
            pub fn as_str(self) -> &'static str {
                FlagChoice::as_str(self)
            }
        }

        impl FromStr for $choice {
            type Err = UnknownChoice;

            fn from_str(value: &str) -> Result<Self, UnknownChoice> {
                Self::parse_choice(value)
            }
        }

        impl fmt::Display for $choice {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}

flag_choice_impls!(LrDecayStyle, WsdDecayStyle, WdIncrStyle);

/// The schedule flags as the binary parses them, with Megatron's defaults (`Default`); `None`
/// wherever Megatron's default is `None`.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleFlags {
    pub lr: Option<f64>,
    pub min_lr: f64,
    pub lr_warmup_init: f64,
    pub lr_decay_style: LrDecayStyle,
    pub lr_decay_iters: Option<u64>,
    pub lr_decay_samples: Option<u64>,
    pub lr_warmup_fraction: Option<f64>,
    pub lr_warmup_iters: u64,
    pub lr_warmup_samples: u64,
    pub lr_wsd_decay_style: WsdDecayStyle,
    pub lr_wsd_decay_iters: Option<u64>,
    pub lr_wsd_decay_samples: Option<u64>,
    pub weight_decay: f64,
    pub start_weight_decay: Option<f64>,
    pub end_weight_decay: Option<f64>,
    pub weight_decay_incr_style: WdIncrStyle,
    pub train_iters: Option<u64>,
    pub train_samples: Option<u64>,
    pub global_batch_size: u64,
}

impl Default for ScheduleFlags {
    fn default() -> Self {
        Self {
            lr: None,
            min_lr: 0.0,
            lr_warmup_init: 0.0,
            lr_decay_style: LrDecayStyle::Linear,
            lr_decay_iters: None,
            lr_decay_samples: None,
            lr_warmup_fraction: None,
            lr_warmup_iters: 0,
            lr_warmup_samples: 0,
            lr_wsd_decay_style: WsdDecayStyle::Exponential,
            lr_wsd_decay_iters: None,
            lr_wsd_decay_samples: None,
            weight_decay: 0.01,
            start_weight_decay: None,
            end_weight_decay: None,
            weight_decay_incr_style: WdIncrStyle::Constant,
            train_iters: None,
            train_samples: None,
            global_batch_size: 1,
        }
    }
}

/// The scheduler's parameters, every horizon in samples.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_init_lr: f64,
    /// A float because Megatron computes `--lr-warmup-fraction × decay_steps` without rounding
    /// (and checkpoints it as such); the warmup test `num_steps <= warmup_steps` and the warmup
    /// slope use that exact value.
    pub warmup_steps: f64,
    pub decay_steps: u64,
    pub decay_style: LrDecayStyle,
    pub wsd_decay_steps: Option<u64>,
    pub wsd_decay_style: WsdDecayStyle,
    pub start_wd: f64,
    pub end_wd: f64,
    pub wd_incr_steps: u64,
    pub wd_incr_style: WdIncrStyle,
}

/// How long training runs, as given on the command line.
enum TrainingHorizon {
    Iterations(u64),
    Samples(u64),
}

impl SchedulerConfig {
    /// Megatron's `get_optimizer_param_scheduler` together with the argument checks it relies on.
    pub fn from_flags(flags: &ScheduleFlags) -> Result<Self> {
        let max_lr = flags.lr.ok_or_else(|| {
            usage_error("--lr is required: the learning-rate schedule has no peak")
        })?;
        let gbs = flags.global_batch_size;
        let horizon = match (flags.train_iters, flags.train_samples) {
            (Some(iters), None) => TrainingHorizon::Iterations(iters),
            (None, Some(samples)) => TrainingHorizon::Samples(samples),
            (Some(_), Some(_)) => {
                bail_usage!(
                    "--train-iters and --train-samples are exclusive: give only one of them"
                )
            }
            (None, None) => bail_usage!("either --train-iters or --train-samples must be given"),
        };
        let (decay_steps, warmup_steps, wsd_decay_steps, wd_incr_steps) = match horizon {
            TrainingHorizon::Iterations(train_iters) => {
                for (given, flag) in [
                    (flags.lr_decay_samples.is_some(), "--lr-decay-samples"),
                    (flags.lr_warmup_samples != 0, "--lr-warmup-samples"),
                ] {
                    if given {
                        bail_usage!("{flag} is for sample-based training (--train-samples); with --train-iters use the -iters flag");
                    }
                }
                if flags.lr_warmup_fraction.is_some() && flags.lr_warmup_iters != 0 {
                    bail_usage!("give only one of --lr-warmup-fraction and --lr-warmup-iters");
                }
                let decay_iters = flags.lr_decay_iters.unwrap_or(train_iters);
                let decay_steps = iterations_to_samples(decay_iters, gbs, "--lr-decay-iters")?;
                let warmup_steps = match flags.lr_warmup_fraction {
                    Some(fraction) => fraction * decay_steps as f64,
                    None => iterations_to_samples(flags.lr_warmup_iters, gbs, "--lr-warmup-iters")?
                        as f64,
                };
                let wsd_decay_steps = flags
                    .lr_wsd_decay_iters
                    .map(|iters| iterations_to_samples(iters, gbs, "--lr-wsd-decay-iters"))
                    .transpose()?;
                let wd_incr_steps = iterations_to_samples(train_iters, gbs, "--train-iters")?;
                (decay_steps, warmup_steps, wsd_decay_steps, wd_incr_steps)
            }
            TrainingHorizon::Samples(train_samples) => {
                for (given, flag) in [
                    (flags.lr_decay_iters.is_some(), "--lr-decay-iters"),
                    (flags.lr_warmup_iters != 0, "--lr-warmup-iters"),
                ] {
                    if given {
                        bail_usage!("{flag} is for iteration-based training (--train-iters); with --train-samples use the -samples flag");
                    }
                }
                if flags.lr_warmup_fraction.is_some() && flags.lr_warmup_samples != 0 {
                    bail_usage!("give only one of --lr-warmup-fraction and --lr-warmup-samples");
                }
                let decay_steps = flags.lr_decay_samples.unwrap_or(train_samples);
                let warmup_steps = match flags.lr_warmup_fraction {
                    Some(fraction) => fraction * decay_steps as f64,
                    None => flags.lr_warmup_samples as f64,
                };
                (
                    decay_steps,
                    warmup_steps,
                    flags.lr_wsd_decay_samples,
                    train_samples,
                )
            }
        };
        let (start_wd, end_wd) = match flags.weight_decay_incr_style {
            WdIncrStyle::Constant => {
                if flags.start_weight_decay.is_some() || flags.end_weight_decay.is_some() {
                    bail_usage!("--start-weight-decay/--end-weight-decay need --weight-decay-incr-style linear or cosine (with the default constant style, --weight-decay applies throughout)");
                }
                (flags.weight_decay, flags.weight_decay)
            }
            style => match (flags.start_weight_decay, flags.end_weight_decay) {
                (Some(start), Some(end)) => (start, end),
                _ => bail_usage!("--weight-decay-incr-style {style} needs both --start-weight-decay and --end-weight-decay"),
            },
        };
        let config = Self {
            max_lr,
            min_lr: flags.min_lr,
            warmup_init_lr: flags.lr_warmup_init,
            warmup_steps,
            decay_steps,
            decay_style: flags.lr_decay_style,
            wsd_decay_steps,
            wsd_decay_style: flags.lr_wsd_decay_style,
            start_wd,
            end_wd,
            wd_incr_steps,
            wd_incr_style: flags.weight_decay_incr_style,
        };
        config.validate()?;
        Ok(config)
    }

    /// The invariants the schedule formulas rely on (Megatron asserts them in the constructor).
    pub fn validate(&self) -> Result<()> {
        if self.min_lr.is_nan() || self.min_lr < 0.0 {
            bail!("--min-lr must be non-negative, got {}", self.min_lr);
        }
        if self.max_lr.is_nan() || self.max_lr < self.min_lr {
            bail!(
                "--lr ({}) must be at least --min-lr ({})",
                self.max_lr,
                self.min_lr
            );
        }
        if self.warmup_init_lr.is_nan() || self.warmup_init_lr > self.max_lr {
            bail!(
                "--lr-warmup-init ({}) must not exceed --lr ({})",
                self.warmup_init_lr,
                self.max_lr
            );
        }
        if self.decay_steps == 0 {
            bail!("the learning-rate decay horizon is 0 samples (--lr-decay-iters/--lr-decay-samples, or --train-iters/--train-samples)");
        }
        if self.warmup_steps.is_nan()
            || self.warmup_steps < 0.0
            || self.warmup_steps >= self.decay_steps as f64
        {
            bail!(
                "the warmup ({} samples, from --lr-warmup-*) must be shorter than the decay horizon ({} samples)",
                self.warmup_steps,
                self.decay_steps
            );
        }
        if self.decay_style == LrDecayStyle::Wsd && self.wsd_decay_steps.is_none() {
            bail_usage!("--lr-decay-style WSD needs --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)");
        }
        if self.start_wd.is_nan() || self.start_wd < 0.0 {
            bail!(
                "the starting weight decay must be non-negative, got {}",
                self.start_wd
            );
        }
        if self.end_wd.is_nan() || self.end_wd < self.start_wd {
            bail!(
                "--end-weight-decay ({}) must be at least --start-weight-decay ({})",
                self.end_wd,
                self.start_wd
            );
        }
        match self.wd_incr_style {
            WdIncrStyle::Constant if self.start_wd != self.end_wd => bail!(
                "--weight-decay-incr-style constant needs equal start and end weight decay, got {} and {}",
                self.start_wd,
                self.end_wd
            ),
            WdIncrStyle::Linear | WdIncrStyle::Cosine if self.wd_incr_steps == 0 => {
                bail!("the weight-decay increment horizon is 0 samples (--train-iters/--train-samples)")
            }
            _ => Ok(()),
        }
    }
}

fn iterations_to_samples(iterations: u64, global_batch_size: u64, flag: &str) -> Result<u64> {
    iterations
        .checked_mul(global_batch_size)
        .ok_or_else(|| anyhow!("{flag} {iterations} × --global-batch-size {global_batch_size} overflows a sample count"))
}

/// What to do when the command line and a checkpoint disagree on the scheduler's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulerLoadPolicy {
    /// Megatron's default: every parameter must match.
    #[default]
    RequireMatch,
    /// `--override-opt_param-scheduler`: keep the command line's values.
    OverrideFromCli,
    /// `--use-checkpoint-opt_param-scheduler`: take the checkpoint's values.
    UseCheckpoint,
}

/// The checkpointed scheduler, with the keys (and key order) of Megatron's `state_dict()`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    pub max_lr: f64,
    pub lr_warmup_steps: f64,
    pub num_steps: u64,
    pub lr_decay_style: LrDecayStyle,
    pub lr_decay_steps: u64,
    pub min_lr: f64,
    pub start_wd: f64,
    pub end_wd: f64,
    pub wd_incr_style: WdIncrStyle,
    pub wd_incr_steps: u64,
}

/// The learning rate and weight decay for the number of samples trained so far.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerParamScheduler {
    config: SchedulerConfig,
    num_steps: u64,
}

impl OptimizerParamScheduler {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            config,
            num_steps: 0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Samples the schedule has advanced over.
    pub fn num_steps(&self) -> u64 {
        self.num_steps
    }

    /// Advances by the samples of one successful optimizer step (`M × mbs × dp`).
    pub fn step(&mut self, increment: u64) {
        self.num_steps += increment;
    }

    /// The learning rate at the current step.
    pub fn lr(&self) -> f64 {
        self.lr_between(self.config.max_lr, self.config.min_lr)
    }

    /// The learning rate at the current step for a parameter group with its own peak and floor
    /// (`--decoupled-lr` / `--decoupled-min-lr`); warmup still starts at `--lr-warmup-init`.
    pub fn lr_between(&self, max_lr: f64, min_lr: f64) -> f64 {
        let config = &self.config;
        let steps = self.num_steps as f64;
        let warmup = config.warmup_steps;
        if warmup > 0.0 && steps <= warmup {
            // Megatron's operation order (scale by steps, then divide), for identical rounding.
            return config.warmup_init_lr + (max_lr - config.warmup_init_lr) * steps / warmup;
        }
        // Arm order matters: the constant style ignores the horizon.
        let coefficient = match config.decay_style {
            LrDecayStyle::Constant => return max_lr,
            _ if self.num_steps > config.decay_steps => return min_lr,
            LrDecayStyle::InverseSquareRoot => {
                let lr = max_lr * warmup.max(1.0).powf(0.5) / steps.max(1.0).powf(0.5);
                return lr.max(min_lr);
            }
            LrDecayStyle::Linear => 1.0 - self.decay_ratio(),
            LrDecayStyle::Cosine => 0.5 * ((PI * self.decay_ratio()).cos() + 1.0),
            LrDecayStyle::Wsd => self.wsd_coefficient(),
        };
        min_lr + coefficient * (max_lr - min_lr)
    }

    /// How far through the decay phase (after warmup) the schedule is, from 0 to 1.
    fn decay_ratio(&self) -> f64 {
        let warmup = self.config.warmup_steps;
        (self.num_steps as f64 - warmup) / (self.config.decay_steps as f64 - warmup)
    }

    fn wsd_coefficient(&self) -> f64 {
        let anneal_steps = self
            .config
            .wsd_decay_steps
            .expect("validate() requires WSD decay steps for WSD");
        // In i128: the anneal phase may be configured longer than the whole decay horizon.
        let anneal_start = i128::from(self.config.decay_steps) - i128::from(anneal_steps);
        let into_anneal = i128::from(self.num_steps) - anneal_start;
        if into_anneal <= 0 {
            return 1.0;
        }
        let q = into_anneal as f64 / anneal_steps as f64;
        match self.config.wsd_decay_style {
            WsdDecayStyle::Linear => 1.0 - q,
            WsdDecayStyle::Cosine => 0.5 * ((PI * q).cos() + 1.0),
            WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(q) - 1.0,
            WsdDecayStyle::MinusSqrt => 1.0 - q.sqrt(),
        }
    }

    /// The weight decay at the current step.
    pub fn weight_decay(&self) -> f64 {
        let config = &self.config;
        if self.num_steps > config.wd_incr_steps {
            return config.end_wd;
        }
        let ratio = self.num_steps as f64 / config.wd_incr_steps as f64;
        let coefficient = match config.wd_incr_style {
            WdIncrStyle::Constant => return config.end_wd,
            WdIncrStyle::Linear => ratio,
            WdIncrStyle::Cosine => 0.5 * ((PI * (1.0 - ratio)).cos() + 1.0),
        };
        config.start_wd + coefficient * (config.end_wd - config.start_wd)
    }

    pub fn state(&self) -> SchedulerState {
        let config = &self.config;
        SchedulerState {
            max_lr: config.max_lr,
            lr_warmup_steps: config.warmup_steps,
            num_steps: self.num_steps,
            lr_decay_style: config.decay_style,
            lr_decay_steps: config.decay_steps,
            min_lr: config.min_lr,
            start_wd: config.start_wd,
            end_wd: config.end_wd,
            wd_incr_style: config.wd_incr_style,
            wd_incr_steps: config.wd_incr_steps,
        }
    }

    /// Restores the step count from a checkpoint and reconciles the parameters per `policy`.
    /// Nothing changes when it fails.
    pub fn load_state(
        &mut self,
        state: &SchedulerState,
        policy: SchedulerLoadPolicy,
    ) -> Result<()> {
        let cli = &self.config;
        let config = SchedulerConfig {
            max_lr: reconcile("max_lr", "--lr", cli.max_lr, state.max_lr, policy)?,
            min_lr: reconcile("min_lr", "--min-lr", cli.min_lr, state.min_lr, policy)?,
            warmup_steps: reconcile(
                "lr_warmup_steps",
                "--lr-warmup-*",
                cli.warmup_steps,
                state.lr_warmup_steps,
                policy,
            )?,
            decay_steps: reconcile(
                "lr_decay_steps",
                "--lr-decay-iters/--lr-decay-samples/--train-*",
                cli.decay_steps,
                state.lr_decay_steps,
                policy,
            )?,
            decay_style: reconcile(
                "lr_decay_style",
                "--lr-decay-style",
                cli.decay_style,
                state.lr_decay_style,
                policy,
            )?,
            start_wd: reconcile(
                "start_wd",
                "--start-weight-decay",
                cli.start_wd,
                state.start_wd,
                policy,
            )?,
            end_wd: reconcile(
                "end_wd",
                "--end-weight-decay",
                cli.end_wd,
                state.end_wd,
                policy,
            )?,
            wd_incr_steps: reconcile(
                "wd_incr_steps",
                "--train-iters/--train-samples",
                cli.wd_incr_steps,
                state.wd_incr_steps,
                policy,
            )?,
            wd_incr_style: reconcile(
                "wd_incr_style",
                "--weight-decay-incr-style",
                cli.wd_incr_style,
                state.wd_incr_style,
                policy,
            )?,
            ..cli.clone()
        };
        config.validate().map_err(|error| {
            error.context("the scheduler restored from the checkpoint is invalid")
        })?;
        self.config = config;
        // Megatron steps a fresh scheduler (at 0) by the saved count, i.e. sets it.
        self.num_steps = state.num_steps;
        Ok(())
    }
}

fn reconcile<T: PartialEq + fmt::Display>(
    field: &str,
    flag: &str,
    cli: T,
    checkpoint: T,
    policy: SchedulerLoadPolicy,
) -> Result<T> {
    match policy {
        SchedulerLoadPolicy::OverrideFromCli => Ok(cli),
        SchedulerLoadPolicy::UseCheckpoint => Ok(checkpoint),
        SchedulerLoadPolicy::RequireMatch if cli == checkpoint => Ok(checkpoint),
        SchedulerLoadPolicy::RequireMatch => bail!(
            "learning-rate scheduler field {field}: the command line ({flag}) gives {cli} but the checkpoint has {checkpoint}; \
             pass --override-opt_param-scheduler to keep the command line's values or \
             --use-checkpoint-opt_param-scheduler to take the checkpoint's"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// max 1.0, min 0.1, no warmup-init offset, warmup 100 samples, decay horizon 1100 samples.
    fn config(style: LrDecayStyle) -> SchedulerConfig {
        SchedulerConfig {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup_init_lr: 0.0,
            warmup_steps: 100.0,
            decay_steps: 1100,
            decay_style: style,
            wsd_decay_steps: None,
            wsd_decay_style: WsdDecayStyle::Exponential,
            start_wd: 0.01,
            end_wd: 0.01,
            wd_incr_steps: 1100,
            wd_incr_style: WdIncrStyle::Constant,
        }
    }

    fn lr_at(config: &SchedulerConfig, steps: u64) -> f64 {
        let mut scheduler = OptimizerParamScheduler::new(config.clone()).unwrap();
        scheduler.step(steps);
        scheduler.lr()
    }

    fn assert_close(actual: f64, expected: f64) {
        assert!(
            (actual - expected).abs() <= 1e-12 * expected.abs().max(1.0),
            "{actual} != {expected}"
        );
    }

    #[test]
    fn flag_values_parse_and_print_as_megatron_spells_them() {
        for (text, style) in [
            ("constant", LrDecayStyle::Constant),
            ("linear", LrDecayStyle::Linear),
            ("cosine", LrDecayStyle::Cosine),
            ("inverse-square-root", LrDecayStyle::InverseSquareRoot),
            ("WSD", LrDecayStyle::Wsd),
        ] {
            assert_eq!(text.parse::<LrDecayStyle>().unwrap(), style);
            assert_eq!(style.as_str(), text);
        }
        for (text, style) in [
            ("linear", WsdDecayStyle::Linear),
            ("cosine", WsdDecayStyle::Cosine),
            ("exponential", WsdDecayStyle::Exponential),
            ("minus_sqrt", WsdDecayStyle::MinusSqrt),
        ] {
            assert_eq!(text.parse::<WsdDecayStyle>().unwrap(), style);
            assert_eq!(style.as_str(), text);
        }
        assert_eq!(
            "cosine".parse::<WdIncrStyle>().unwrap(),
            WdIncrStyle::Cosine
        );
        let error = "wsd".parse::<LrDecayStyle>().unwrap_err().to_string();
        assert!(
            error.contains("--lr-decay-style") && error.contains("'wsd'") && error.contains("WSD"),
            "{error}"
        );
    }

    #[test]
    fn warmup_is_linear_from_init_and_includes_its_last_step() {
        let config = SchedulerConfig {
            warmup_init_lr: 0.1,
            max_lr: 0.3,
            min_lr: 0.0,
            ..config(LrDecayStyle::Linear)
        };
        assert_eq!(lr_at(&config, 0), 0.1);
        // 0.1 + 0.2 × 50/100
        assert_close(lr_at(&config, 50), 0.2);
        // At N = W the warmup branch applies (`<=`): 0.1 + (0.3 - 0.1)·100/100 rounds to
        // 0.30000000000000004 in f64 (python3 prints the same), where the decay branch would give
        // exactly 0.3.
        assert_eq!(lr_at(&config, 100), 0.30000000000000004);
    }

    #[test]
    fn linear_decay_reaches_min_at_the_horizon() {
        let config = config(LrDecayStyle::Linear);
        // r = (600 - 100)/(1100 - 100) = 0.5 → 0.1 + 0.5 × 0.9
        assert_close(lr_at(&config, 600), 0.55);
        // r = 1 → min
        assert_close(lr_at(&config, 1100), 0.1);
        assert_eq!(lr_at(&config, 1101), 0.1);
    }

    #[test]
    fn cosine_decay() {
        let config = config(LrDecayStyle::Cosine);
        // r = 250/1000 = 0.25 → c = 0.5(cos(π/4) + 1) = 0.5(1 + √½) = 0.853553390593...
        // lr = 0.1 + 0.853553390593 × 0.9
        assert_close(lr_at(&config, 350), 0.8681980515339464);
        // r = 0.5 → c = 0.5
        assert_close(lr_at(&config, 600), 0.55);
    }

    #[test]
    fn constant_style_keeps_the_peak_even_past_the_horizon() {
        let config = config(LrDecayStyle::Constant);
        assert_eq!(lr_at(&config, 101), 1.0);
        assert_eq!(lr_at(&config, 5000), 1.0);
    }

    #[test]
    fn inverse_square_root_decay_is_floored_at_min() {
        let config = SchedulerConfig {
            decay_steps: 1_000_000,
            ..config(LrDecayStyle::InverseSquareRoot)
        };
        // 1.0 × √100 / √400 = 10/20
        assert_close(lr_at(&config, 400), 0.5);
        // 10/√2500 = 0.2
        assert_close(lr_at(&config, 2500), 0.2);
        // 10/√40000 = 0.05 < min 0.1
        assert_eq!(lr_at(&config, 40_000), 0.1);
        assert_eq!(lr_at(&config, 1_000_001), 0.1);
    }

    #[test]
    fn wsd_is_flat_then_anneals_over_its_last_steps() {
        // No warmup, decay horizon 1000, anneal over the last 200: the anneal starts after 800.
        let wsd = |style| SchedulerConfig {
            min_lr: 0.0,
            warmup_steps: 0.0,
            decay_steps: 1000,
            wsd_decay_steps: Some(200),
            wsd_decay_style: style,
            ..config(LrDecayStyle::Wsd)
        };
        // q = (900 - 800)/200 = 0.5 at step 900, per anneal shape:
        let halfway = [
            (WsdDecayStyle::Linear, 0.5),                      // 1 - q
            (WsdDecayStyle::Cosine, 0.5),                      // 0.5(cos(π/2) + 1)
            (WsdDecayStyle::Exponential, 0.41421356237309515), // 2·0.5^0.5 - 1 = √2 - 1
            (WsdDecayStyle::MinusSqrt, 0.2928932188134524),    // 1 - √0.5
        ];
        for (style, expected) in halfway {
            let config = wsd(style);
            assert_eq!(lr_at(&config, 500), 1.0, "{style}");
            assert_eq!(lr_at(&config, 800), 1.0, "{style}");
            assert_close(lr_at(&config, 900), expected);
            // q = 1: every shape reaches 0 = min.
            assert_close(lr_at(&config, 1000), 0.0);
        }
    }

    #[test]
    fn weight_decay_increments() {
        let wd = |style, steps| {
            let config = SchedulerConfig {
                start_wd: 0.01,
                end_wd: 0.1,
                wd_incr_steps: 1000,
                wd_incr_style: style,
                ..config(LrDecayStyle::Linear)
            };
            let mut scheduler = OptimizerParamScheduler::new(config).unwrap();
            scheduler.step(steps);
            scheduler.weight_decay()
        };
        // ρ = 0.25: 0.01 + 0.25 × 0.09
        assert_close(wd(WdIncrStyle::Linear, 250), 0.0325);
        // 0.5(cos(0.75π) + 1) = 0.5(1 - √½) = 0.1464466094067262; 0.01 + that × 0.09
        assert_close(wd(WdIncrStyle::Cosine, 250), 0.023180194846605363);
        assert_close(wd(WdIncrStyle::Cosine, 0), 0.01);
        assert_eq!(wd(WdIncrStyle::Linear, 2000), 0.1);
        let constant = OptimizerParamScheduler::new(config(LrDecayStyle::Linear)).unwrap();
        assert_eq!(constant.weight_decay(), 0.01);
    }

    fn iteration_flags() -> ScheduleFlags {
        ScheduleFlags {
            lr: Some(3e-4),
            train_iters: Some(1000),
            global_batch_size: 8,
            ..ScheduleFlags::default()
        }
    }

    #[test]
    fn iteration_based_flags_become_sample_counts() {
        let config = SchedulerConfig::from_flags(&ScheduleFlags {
            lr_warmup_iters: 10,
            ..iteration_flags()
        })
        .unwrap();
        // decay = train_iters × gbs = 1000 × 8; warmup = 10 × 8; wd horizon = 1000 × 8
        assert_eq!(config.decay_steps, 8000);
        assert_eq!(config.warmup_steps, 80.0);
        assert_eq!(config.wd_incr_steps, 8000);
        assert_eq!((config.start_wd, config.end_wd), (0.01, 0.01));
        assert_eq!(config.decay_style, LrDecayStyle::Linear);

        // The fraction is of the *decay* horizon: 0.01 × (900 × 8) = 72.
        let config = SchedulerConfig::from_flags(&ScheduleFlags {
            lr_warmup_fraction: Some(0.01),
            lr_decay_iters: Some(900),
            lr_decay_style: LrDecayStyle::Wsd,
            lr_wsd_decay_iters: Some(100),
            ..iteration_flags()
        })
        .unwrap();
        assert_eq!(config.decay_steps, 7200);
        assert_close(config.warmup_steps, 72.0);
        assert_eq!(config.wsd_decay_steps, Some(800));
        assert_eq!(config.wd_incr_steps, 8000);
    }

    #[test]
    fn sample_based_flags_are_taken_as_given() {
        let flags = ScheduleFlags {
            lr: Some(1.0),
            train_samples: Some(100_000),
            lr_warmup_samples: 1000,
            weight_decay_incr_style: WdIncrStyle::Linear,
            start_weight_decay: Some(0.0),
            end_weight_decay: Some(0.1),
            global_batch_size: 256,
            ..ScheduleFlags::default()
        };
        let config = SchedulerConfig::from_flags(&flags).unwrap();
        assert_eq!(
            (
                config.decay_steps,
                config.warmup_steps,
                config.wd_incr_steps
            ),
            (100_000, 1000.0, 100_000)
        );
        assert_eq!((config.start_wd, config.end_wd), (0.0, 0.1));

        // A warmup fraction that is not a whole number of samples stays fractional:
        // 0.001 × 12345 = 12.345, so step 12 is still warming up (1.0 × 12/12.345) and 13 is not.
        let config = SchedulerConfig::from_flags(&ScheduleFlags {
            lr_warmup_samples: 0,
            lr_warmup_fraction: Some(0.001),
            lr_decay_samples: Some(12345),
            ..flags
        })
        .unwrap();
        assert_close(config.warmup_steps, 12.345);
        assert_close(lr_at(&config, 12), 0.9720534629404617);
        // linear: 1 - (13 - 12.345)/(12345 - 12.345)
        assert_close(lr_at(&config, 13), 1.0 - 0.655 / 12332.655);
    }

    #[test]
    fn contradictory_flags_are_refused_by_name() {
        let cases = [
            (
                ScheduleFlags {
                    lr: None,
                    ..iteration_flags()
                },
                "--lr",
            ),
            (
                ScheduleFlags {
                    train_samples: Some(10),
                    ..iteration_flags()
                },
                "--train-samples",
            ),
            (
                ScheduleFlags {
                    train_iters: None,
                    ..iteration_flags()
                },
                "--train-iters",
            ),
            (
                ScheduleFlags {
                    lr_warmup_fraction: Some(0.1),
                    lr_warmup_iters: 5,
                    ..iteration_flags()
                },
                "--lr-warmup-fraction",
            ),
            (
                ScheduleFlags {
                    lr_decay_samples: Some(100),
                    ..iteration_flags()
                },
                "--lr-decay-samples",
            ),
            (
                ScheduleFlags {
                    train_iters: None,
                    train_samples: Some(1000),
                    lr_warmup_iters: 2,
                    ..iteration_flags()
                },
                "--lr-warmup-iters",
            ),
            (
                ScheduleFlags {
                    lr_decay_style: LrDecayStyle::Wsd,
                    ..iteration_flags()
                },
                "--lr-wsd-decay-iters",
            ),
            (
                ScheduleFlags {
                    start_weight_decay: Some(0.0),
                    ..iteration_flags()
                },
                "--weight-decay-incr-style",
            ),
            (
                ScheduleFlags {
                    weight_decay_incr_style: WdIncrStyle::Cosine,
                    end_weight_decay: Some(0.1),
                    ..iteration_flags()
                },
                "--start-weight-decay",
            ),
            (
                ScheduleFlags {
                    min_lr: 1e-3,
                    ..iteration_flags()
                },
                "--min-lr",
            ),
            (
                ScheduleFlags {
                    lr_warmup_iters: 1000,
                    ..iteration_flags()
                },
                "shorter than the decay",
            ),
        ];
        for (flags, needle) in cases {
            let error = SchedulerConfig::from_flags(&flags).unwrap_err();
            let text = error.to_string();
            assert!(text.contains(needle), "expected '{needle}' in: {text}");
            // Flags that cannot go together are usage errors; values that cannot work (a
            // warmup longer than the decay) are checked again on a restored schedule too.
            let usage = !matches!(needle, "--min-lr" | "shorter than the decay");
            assert_eq!(megatron_cli::is_usage_error(&error), usage, "{text}");
        }
    }

    #[test]
    fn state_uses_megatron_keys_and_round_trips_through_json() {
        let mut scheduler = OptimizerParamScheduler::new(config(LrDecayStyle::Cosine)).unwrap();
        scheduler.step(350);
        let json = serde_json::to_string(&scheduler.state()).unwrap();
        assert_eq!(
            json,
            r#"{"max_lr":1.0,"lr_warmup_steps":100.0,"num_steps":350,"lr_decay_style":"cosine","lr_decay_steps":1100,"min_lr":0.1,"start_wd":0.01,"end_wd":0.01,"wd_incr_style":"constant","wd_incr_steps":1100}"#
        );
        let state: SchedulerState = serde_json::from_str(&json).unwrap();
        let mut resumed = OptimizerParamScheduler::new(config(LrDecayStyle::Cosine)).unwrap();
        resumed
            .load_state(&state, SchedulerLoadPolicy::RequireMatch)
            .unwrap();
        assert_eq!(resumed, scheduler);
        assert_close(resumed.lr(), 0.8681980515339464);
    }

    #[test]
    fn disagreeing_checkpoint_follows_the_policy() {
        let mut trained = OptimizerParamScheduler::new(SchedulerConfig {
            max_lr: 0.5,
            ..config(LrDecayStyle::Linear)
        })
        .unwrap();
        trained.step(600);
        let state = trained.state();
        let fresh = || OptimizerParamScheduler::new(config(LrDecayStyle::Linear)).unwrap();

        let mut scheduler = fresh();
        let error = scheduler
            .load_state(&state, SchedulerLoadPolicy::RequireMatch)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("max_lr")
                && error.contains("--lr")
                && error.contains("gives 1 ")
                && error.contains("has 0.5"),
            "{error}"
        );
        assert_eq!(scheduler, fresh(), "a refused load changes nothing");

        // Command line: 0.1 + 0.5 × (1.0 - 0.1) at r = 0.5.
        scheduler
            .load_state(&state, SchedulerLoadPolicy::OverrideFromCli)
            .unwrap();
        assert_eq!(scheduler.num_steps(), 600);
        assert_close(scheduler.lr(), 0.55);

        // Checkpoint: 0.1 + 0.5 × (0.5 - 0.1).
        let mut scheduler = fresh();
        scheduler
            .load_state(&state, SchedulerLoadPolicy::UseCheckpoint)
            .unwrap();
        assert_close(scheduler.lr(), 0.3);
    }
}
