//! The loss scale of mixed-precision training: constant (`--loss-scale`, or 1.0 for bf16) or
//! Megatron's dynamic scaler for fp16, which backs off after `hysteresis` overflowing steps
//! and grows after `window` clean ones. Scale arithmetic is in f32, as Megatron keeps the scale
//! in a float32 tensor.

use anyhow::{ensure, Result};
use serde::{Deserialize, Serialize};

/// The loss-scaling flags, with Megatron's defaults (`Default`).
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaleFlags {
    /// `--fp16`: without a static `--loss-scale`, scale dynamically.
    pub fp16: bool,
    /// `--loss-scale`: a static scale.
    pub loss_scale: Option<f32>,
    pub initial_loss_scale: f32,
    pub min_loss_scale: f32,
    /// `--loss-scale-window`: clean steps before the scale grows.
    pub loss_scale_window: u64,
    /// `--hysteresis`: overflowing steps (without a growth in between) before the scale backs off.
    pub hysteresis: u32,
}

impl Default for LossScaleFlags {
    fn default() -> Self {
        Self {
            fp16: false,
            loss_scale: None,
            initial_loss_scale: 4_294_967_296.0,
            min_loss_scale: 1.0,
            loss_scale_window: 1000,
            hysteresis: 2,
        }
    }
}

/// The checkpointed state of the dynamic scaler (Megatron's `grad_scaler` entry).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScalerState {
    pub scale: f32,
    pub growth_tracker: u64,
    /// Signed: it keeps counting down through overflows after reaching the back-off threshold.
    pub hysteresis_tracker: i64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LossScaler {
    Constant(f32),
    Dynamic(DynamicLossScaler),
}

impl LossScaler {
    /// Megatron's choice: a static `--loss-scale` when given, the dynamic scaler for fp16,
    /// otherwise (bf16, fp32) a constant 1.0.
    pub fn from_flags(flags: &LossScaleFlags) -> Result<Self> {
        match flags.loss_scale {
            Some(scale) => {
                ensure!(scale > 0.0, "--loss-scale must be positive, got {scale}");
                Ok(Self::Constant(scale))
            }
            None if flags.fp16 => Ok(Self::Dynamic(DynamicLossScaler::new(
                flags.initial_loss_scale,
                flags.min_loss_scale,
                2.0,
                0.5,
                flags.loss_scale_window,
                flags.hysteresis,
            )?)),
            None => Ok(Self::Constant(1.0)),
        }
    }

    pub fn scale(&self) -> f32 {
        match self {
            Self::Constant(scale) => *scale,
            Self::Dynamic(scaler) => scaler.scale,
        }
    }

    /// `1/scale`, computed in f64 and rounded to f32 as Megatron does for unscaling gradients.
    pub fn inv_scale(&self) -> f32 {
        (1.0 / f64::from(self.scale())) as f32
    }

    /// Records whether this step's gradients overflowed; a constant scale ignores it.
    pub fn update(&mut self, found_inf: bool) {
        if let Self::Dynamic(scaler) = self {
            scaler.update(found_inf);
        }
    }

    pub fn is_dynamic(&self) -> bool {
        matches!(self, Self::Dynamic(_))
    }

    /// The state to checkpoint; a constant scale has none.
    pub fn state(&self) -> Option<LossScalerState> {
        match self {
            Self::Constant(_) => None,
            Self::Dynamic(scaler) => Some(scaler.state()),
        }
    }

    /// Restores a checkpointed state; a constant scale keeps its value, as in Megatron.
    pub fn load_state(&mut self, state: &LossScalerState) -> Result<()> {
        match self {
            Self::Constant(_) => Ok(()),
            Self::Dynamic(scaler) => scaler.load_state(state),
        }
    }
}

/// Megatron's `DynamicGradScaler`.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    scale: f32,
    min_scale: f32,
    growth_factor: f32,
    backoff_factor: f32,
    growth_interval: u64,
    hysteresis: u32,
    growth_tracker: u64,
    hysteresis_tracker: i64,
}

impl DynamicLossScaler {
    pub fn new(
        initial_scale: f32,
        min_scale: f32,
        growth_factor: f32,
        backoff_factor: f32,
        growth_interval: u64,
        hysteresis: u32,
    ) -> Result<Self> {
        ensure!(
            initial_scale > 0.0,
            "--initial-loss-scale must be positive, got {initial_scale}"
        );
        ensure!(
            min_scale > 0.0,
            "--min-loss-scale must be positive, got {min_scale}"
        );
        ensure!(
            min_scale <= initial_scale,
            "--min-loss-scale ({min_scale}) must not exceed --initial-loss-scale ({initial_scale})"
        );
        ensure!(
            growth_factor > 1.0,
            "the loss-scale growth factor must exceed 1, got {growth_factor}"
        );
        ensure!(
            backoff_factor > 0.0 && backoff_factor < 1.0,
            "the loss-scale backoff factor must lie strictly between 0 and 1, got {backoff_factor}"
        );
        ensure!(
            growth_interval > 0,
            "--loss-scale-window must be positive, got {growth_interval}"
        );
        ensure!(
            hysteresis > 0,
            "--hysteresis must be positive, got {hysteresis}"
        );
        Ok(Self {
            scale: initial_scale,
            min_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            growth_tracker: 0,
            hysteresis_tracker: i64::from(hysteresis),
        })
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.growth_tracker = 0;
            self.hysteresis_tracker -= 1;
            if self.hysteresis_tracker <= 0 {
                self.scale = (self.scale * self.backoff_factor).max(self.min_scale);
            }
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.growth_tracker = 0;
                self.hysteresis_tracker = i64::from(self.hysteresis);
                self.scale *= self.growth_factor;
            }
        }
    }

    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            scale: self.scale,
            growth_tracker: self.growth_tracker,
            hysteresis_tracker: self.hysteresis_tracker,
        }
    }

    pub fn load_state(&mut self, state: &LossScalerState) -> Result<()> {
        ensure!(
            state.scale.is_finite() && state.scale > 0.0,
            "checkpointed loss scale must be positive and finite, got {}",
            state.scale
        );
        self.scale = state.scale;
        self.growth_tracker = state.growth_tracker;
        self.hysteresis_tracker = state.hysteresis_tracker;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(initial: f32, min: f32, window: u64, hysteresis: u32) -> LossScaler {
        LossScaler::Dynamic(
            DynamicLossScaler::new(initial, min, 2.0, 0.5, window, hysteresis).unwrap(),
        )
    }

    fn run(scaler: &mut LossScaler, overflows: &[bool]) -> Vec<f32> {
        overflows
            .iter()
            .map(|&found_inf| {
                scaler.update(found_inf);
                scaler.scale()
            })
            .collect()
    }

    #[test]
    fn hysteresis_two_backs_off_from_the_second_overflow_on() {
        let mut scaler = scaler(1024.0, 1.0, 1000, 2);
        // Overflow 1: tracker 2 → 1, scale kept. Overflow 2: tracker 0, halve. Overflow 3:
        // tracker -1, halve again (it is not reset until the scale grows).
        assert_eq!(
            run(&mut scaler, &[true, true, true]),
            [1024.0, 512.0, 256.0]
        );
        assert_eq!(
            scaler.state(),
            Some(LossScalerState {
                scale: 256.0,
                growth_tracker: 0,
                hysteresis_tracker: -1
            })
        );
        // A clean step does not restore the hysteresis: the next overflow halves at once.
        assert_eq!(run(&mut scaler, &[false, true]), [256.0, 128.0]);
    }

    #[test]
    fn grows_after_a_window_of_clean_steps_and_resets_hysteresis() {
        let mut scaler = scaler(1024.0, 1.0, 3, 2);
        // One overflow (tracker 2 → 1), then 3 clean steps: × 2 on the third, hysteresis back to 2.
        assert_eq!(
            run(&mut scaler, &[true, false, false, false]),
            [1024.0, 1024.0, 1024.0, 2048.0]
        );
        assert_eq!(scaler.state().unwrap().hysteresis_tracker, 2);
        // An overflow resets the growth count: 2 clean, overflow, 2 clean → no growth yet.
        assert_eq!(
            run(&mut scaler, &[false, false, true, false, false]),
            [2048.0; 5]
        );
        assert_eq!(run(&mut scaler, &[false]), [4096.0]);
    }

    #[test]
    fn backoff_stops_at_the_minimum() {
        let mut scaler = scaler(4.0, 1.5, 1000, 1);
        // 4 → 2 → max(1, 1.5) = 1.5 → 1.5
        assert_eq!(run(&mut scaler, &[true, true, true]), [2.0, 1.5, 1.5]);
    }

    #[test]
    fn flags_choose_the_scaler_as_megatron_does() {
        let bf16 = LossScaler::from_flags(&LossScaleFlags::default()).unwrap();
        assert_eq!(bf16, LossScaler::Constant(1.0));
        assert_eq!(bf16.state(), None);

        let fp16 = LossScaler::from_flags(&LossScaleFlags {
            fp16: true,
            ..LossScaleFlags::default()
        })
        .unwrap();
        assert!(fp16.is_dynamic());
        assert_eq!(fp16.scale(), 2f32.powi(32));
        assert_eq!(fp16.inv_scale(), 2f32.powi(-32));

        let mut fixed = LossScaler::from_flags(&LossScaleFlags {
            fp16: true,
            loss_scale: Some(128.0),
            ..LossScaleFlags::default()
        })
        .unwrap();
        run(&mut fixed, &[true, true, true]);
        assert_eq!(fixed.scale(), 128.0);

        let error = DynamicLossScaler::new(1.0, 2.0, 2.0, 0.5, 1000, 2)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--min-loss-scale (2)") && error.contains("--initial-loss-scale (1)"),
            "{error}"
        );
        let error = DynamicLossScaler::new(8.0, 1.0, 2.0, 0.5, 1000, 0)
            .unwrap_err()
            .to_string();
        assert!(error.contains("--hysteresis"), "{error}");
    }

    #[test]
    fn state_round_trips_through_json() {
        let mut trained = scaler(65536.0, 1.0, 1000, 2);
        run(&mut trained, &[true, false, false]);
        let json = serde_json::to_string(&trained.state().unwrap()).unwrap();
        assert_eq!(
            json,
            r#"{"scale":65536.0,"growth_tracker":2,"hysteresis_tracker":1}"#
        );
        let mut resumed = scaler(4_294_967_296.0, 1.0, 1000, 2);
        resumed
            .load_state(&serde_json::from_str(&json).unwrap())
            .unwrap();
        assert_eq!(resumed, trained);
    }
}
