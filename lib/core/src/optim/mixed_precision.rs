//! The optimizer step with float32 main parameters and gradient accumulators.

use std::collections::HashMap;

use anyhow::{bail, ensure, Context, Result};
use tch::{Kind, Tensor};

use super::groups::ParamGroup;
use super::state::OptimizerTensors;
use crate::ops::{self, AdamwHyper};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// `--optimizer adam`: AdamW (decoupled weight decay), as Megatron's fused Adam.
    Adam { beta1: f64, beta2: f64, eps: f64 },
    /// `--optimizer sgd`: momentum SGD with L2-style weight decay, as `torch.optim.SGD`.
    Sgd { momentum: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSettings {
    pub kind: OptimizerKind,
    /// `--clip-grad`; 0 disables clipping.
    pub clip_grad: f64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The fp16 loss scaler found an inf/NaN gradient; parameters were left untouched.
    pub skipped: bool,
    /// Global L2 norm of the (unscaled) gradients before clipping; `None` when skipped.
    pub grad_norm: Option<f64>,
}

enum Moments {
    Adam { exp_avg: Tensor, exp_avg_sq: Tensor, step: Tensor },
    Sgd { momentum: Option<Tensor> },
}

struct Entry {
    name: String,
    model: Tensor,
    /// Float32 master weights; the model parameter itself when that is float32.
    main: Tensor,
    main_grad: Tensor,
    group: ParamGroup,
    moments: Moments,
}

pub struct MixedPrecisionOptimizer {
    entries: Vec<Entry>,
    settings: OptimizerSettings,
}

impl MixedPrecisionOptimizer {
    /// `parameters`: the model's parameters under their state-dict names.
    pub fn new(parameters: Vec<(String, Tensor)>, settings: OptimizerSettings) -> Self {
        let entries = parameters
            .into_iter()
            .map(|(name, model)| {
                let main = tch::no_grad(|| {
                    if model.kind() == Kind::Float {
                        model.shallow_clone()
                    } else {
                        model.detach().to_kind(Kind::Float)
                    }
                });
                let main_grad = main.zeros_like();
                let moments = match settings.kind {
                    OptimizerKind::Adam { .. } => Moments::Adam {
                        exp_avg: main.zeros_like(),
                        exp_avg_sq: main.zeros_like(),
                        step: Tensor::zeros([], (Kind::Float, main.device())),
                    },
                    OptimizerKind::Sgd { .. } => Moments::Sgd { momentum: None },
                };
                let group = ParamGroup::of(&name, &model.size());
                Entry { name, model, main, main_grad, group, moments }
            })
            .collect();
        MixedPrecisionOptimizer { entries, settings }
    }

    /// After a micro-batch's backward: adds the parameters' gradients into the float32
    /// accumulators and clears them, so accumulation over micro-batches happens in float32
    /// whatever the parameter dtype (Megatron's `main_grad`).
    pub fn accumulate_grads(&mut self) -> Result<()> {
        let mut targets = Vec::new();
        let mut grads = Vec::new();
        for entry in &self.entries {
            let grad = entry.model.grad();
            if grad.defined() {
                targets.push(entry.main_grad.shallow_clone());
                grads.push(grad);
            }
        }
        let target_refs: Vec<&Tensor> = targets.iter().collect();
        let grad_refs: Vec<&Tensor> = grads.iter().collect();
        ops::foreach_add_(&target_refs, &grad_refs)?;
        ops::foreach_zero_(&grad_refs)?;
        Ok(())
    }

    /// Unscales (fp16), checks, clips and applies the accumulated gradients, then clears them.
    /// `loss_scale` is the fp16 scaler's current scale (`None` for bf16/fp32).
    pub fn step(&mut self, lr: f64, weight_decay: f64, loss_scale: Option<f32>) -> Result<StepOutcome> {
        let grads: Vec<&Tensor> = self.entries.iter().map(|e| &e.main_grad).collect();
        let device = self.entries.first().map(|e| e.main.device()).context("the optimizer has no parameters")?;
        if let Some(scale) = loss_scale {
            let found_inf = Tensor::zeros([], (Kind::Float, device));
            let inverse = Tensor::from(1.0 / scale).to_device(device);
            ops::unscale_and_check_finite(&grads, &found_inf, &inverse)?;
            if found_inf.double_value(&[]) > 0.0 {
                self.zero_main_grads()?;
                return Ok(StepOutcome { skipped: true, grad_norm: None });
            }
        }
        let norm = ops::total_norm(&grads)?;
        let grad_norm = norm.double_value(&[]);
        if self.settings.clip_grad > 0.0 {
            // Megatron scales only when the coefficient is below one; multiplying by exactly
            // 1.0 is the identity, so clamping keeps that without a branch on the host.
            let coefficient = (Tensor::from(self.settings.clip_grad as f32).to_device(device) / (norm + 1e-6)).clamp_max(1.0);
            ops::foreach_mul_(&grads, &coefficient)?;
        }
        match self.settings.kind {
            OptimizerKind::Adam { beta1, beta2, eps } => {
                for group in [ParamGroup::Decayed, ParamGroup::NotDecayed] {
                    let decay = if group == ParamGroup::Decayed { weight_decay } else { 0.0 };
                    self.adam_step(group, AdamwHyper { lr, beta1, beta2, eps, weight_decay: decay })?;
                }
            }
            OptimizerKind::Sgd { momentum } => self.sgd_step(lr, weight_decay, momentum),
        }
        self.copy_main_to_model()?;
        self.zero_main_grads()?;
        Ok(StepOutcome { skipped: false, grad_norm: Some(grad_norm) })
    }

    fn adam_step(&mut self, group: ParamGroup, hyper: AdamwHyper) -> Result<()> {
        let (mut params, mut grads, mut exp_avgs, mut exp_avg_sqs, mut steps) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for entry in self.entries.iter().filter(|e| e.group == group) {
            let Moments::Adam { exp_avg, exp_avg_sq, step } = &entry.moments else {
                bail!("parameter {} has no Adam state", entry.name);
            };
            params.push(&entry.main);
            grads.push(&entry.main_grad);
            exp_avgs.push(exp_avg);
            exp_avg_sqs.push(exp_avg_sq);
            steps.push(step);
        }
        tch::no_grad(|| ops::fused_adamw(&params, &grads, &exp_avgs, &exp_avg_sqs, &steps, hyper))?;
        Ok(())
    }

    fn sgd_step(&mut self, lr: f64, weight_decay: f64, momentum: f64) {
        tch::no_grad(|| {
            for entry in &mut self.entries {
                let decay = if entry.group == ParamGroup::Decayed { weight_decay } else { 0.0 };
                let mut direction = if decay != 0.0 { &entry.main_grad + &entry.main * decay } else { entry.main_grad.copy() };
                if momentum != 0.0 {
                    let Moments::Sgd { momentum: buffer } = &mut entry.moments else { continue };
                    direction = match buffer.take() {
                        None => direction,
                        Some(previous) => previous * momentum + direction,
                    };
                    *buffer = Some(direction.shallow_clone());
                }
                let _ = entry.main.g_sub_(&(direction * lr));
            }
        });
    }

    fn copy_main_to_model(&self) -> Result<()> {
        let (models, mains): (Vec<&Tensor>, Vec<&Tensor>) = self
            .entries
            .iter()
            .filter(|e| e.model.kind() != Kind::Float)
            .map(|e| (&e.model, &e.main))
            .unzip();
        tch::no_grad(|| ops::foreach_copy_(&models, &mains))?;
        Ok(())
    }

    fn zero_main_grads(&self) -> Result<()> {
        let grads: Vec<&Tensor> = self.entries.iter().map(|e| &e.main_grad).collect();
        ops::foreach_zero_(&grads)?;
        Ok(())
    }

    /// Float32 master weights and optimizer moments, for checkpoints.
    pub fn state_tensors(&self) -> OptimizerTensors {
        let mut out = Vec::new();
        for entry in &self.entries {
            out.push((format!("main.{}", entry.name), entry.main.shallow_clone()));
            match &entry.moments {
                Moments::Adam { exp_avg, exp_avg_sq, step } => {
                    out.push((format!("exp_avg.{}", entry.name), exp_avg.shallow_clone()));
                    out.push((format!("exp_avg_sq.{}", entry.name), exp_avg_sq.shallow_clone()));
                    out.push((format!("step.{}", entry.name), step.shallow_clone()));
                }
                Moments::Sgd { momentum: Some(buffer) } => {
                    out.push((format!("momentum.{}", entry.name), buffer.shallow_clone()));
                }
                Moments::Sgd { momentum: None } => {}
            }
        }
        out
    }

    /// Restores [`state_tensors`](Self::state_tensors) and re-derives the model parameters
    /// from the master weights (so a half-precision model resumes from the exact fp32 values).
    pub fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let get = |key: String| -> Result<&Tensor> {
            tensors.get(&key).with_context(|| format!("optimizer state has no tensor {key}"))
        };
        tch::no_grad(|| -> Result<()> {
            for entry in &mut self.entries {
                let main = get(format!("main.{}", entry.name))?;
                ensure!(main.size() == entry.main.size(), "optimizer tensor main.{}: shape mismatch", entry.name);
                entry.main.copy_(main);
                match &mut entry.moments {
                    Moments::Adam { exp_avg, exp_avg_sq, step } => {
                        exp_avg.copy_(get(format!("exp_avg.{}", entry.name))?);
                        exp_avg_sq.copy_(get(format!("exp_avg_sq.{}", entry.name))?);
                        step.copy_(get(format!("step.{}", entry.name))?);
                    }
                    Moments::Sgd { momentum } => {
                        *momentum = tensors
                            .get(&format!("momentum.{}", entry.name))
                            .map(|t| t.to_kind(Kind::Float).to_device(entry.main.device()));
                    }
                }
            }
            Ok(())
        })?;
        self.copy_main_to_model()
    }
}
