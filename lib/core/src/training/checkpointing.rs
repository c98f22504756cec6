//! A training run's state to and from checkpoints.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind};

use super::loss_scale::{LossScaler, LossScalerState};
use super::lr_schedule::{OptimizerParamScheduler, SchedulerLoadPolicy, SchedulerState};
use crate::checkpoint::{load_checkpoint, rank_directory_name, save_checkpoint, CheckpointMetadata, CheckpointParts, LoadOptions, CHECKPOINT_FORMAT};
use crate::model::GptModel;
use crate::optim::MixedPrecisionOptimizer;
use crate::rng::GeneratorState;

/// Megatron's current `checkpoint_version` (per-head QKV layout).
const CHECKPOINT_VERSION: f64 = 3.0;

/// Counters that move with training and are checkpointed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    pub iteration: u64,
    pub consumed_train_samples: u64,
    pub consumed_valid_samples: u64,
    pub floating_point_operations: f64,
}

pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

fn rank_directory() -> String {
    rank_directory_name(0, 0, 1)
}

pub struct SaveRequest<'a> {
    pub root: &'a Path,
    pub progress: Progress,
    pub model: &'a GptModel,
    pub optimizer: Option<(&'a MixedPrecisionOptimizer, &'a str)>,
    pub scheduler: &'a OptimizerParamScheduler,
    pub scaler: &'a LossScaler,
    pub save_rng: bool,
    pub args: serde_json::Value,
}

pub fn save(request: SaveRequest) -> Result<PathBuf> {
    let device = request.model.options().device;
    let rng = request
        .save_rng
        .then(|| -> Result<Vec<(String, tch::Tensor)>> {
            let mut states = vec![("cpu_rng_state".to_string(), GeneratorState::capture(Device::Cpu)?.tensor().copy())];
            if device.is_cuda() {
                states.push(("cuda_rng_state".to_string(), GeneratorState::capture(device)?.tensor().copy()));
            }
            Ok(states)
        })
        .transpose()?;
    let metadata = CheckpointMetadata {
        format: CHECKPOINT_FORMAT.to_string(),
        checkpoint_version: CHECKPOINT_VERSION,
        iteration: request.progress.iteration,
        model_type: "GPT".to_string(),
        model: serde_json::to_value(&request.model.config)?,
        params_dtype: dtype_name(request.model.options().params_dtype).to_string(),
        tensor_model_parallel_size: 1,
        pipeline_model_parallel_size: 1,
        data_parallel_size: 1,
        consumed_train_samples: request.progress.consumed_train_samples,
        consumed_valid_samples: request.progress.consumed_valid_samples,
        num_floating_point_operations_so_far: request.progress.floating_point_operations,
        opt_param_scheduler: Some(serde_json::to_value(request.scheduler.state())?),
        grad_scaler: request.scaler.state().map(serde_json::to_value).transpose()?,
        optimizer: request.optimizer.map(|(_, name)| name.to_string()),
        has_rng_state: rng.is_some(),
        args: request.args,
    };
    let parts = CheckpointParts {
        rank_directory: rank_directory(),
        model: request.model.named_parameters().into_iter().map(|(n, t)| (n, t.detach())).collect(),
        optimizer: request.optimizer.map(|(optimizer, _)| optimizer.state_tensors()),
        rng,
    };
    save_checkpoint(request.root, &metadata, &parts)
}

/// What resuming restored.
pub enum Resumed {
    /// Weights only (`--finetune`, `--pretrained-checkpoint`, or a `release` checkpoint).
    Weights { directory: PathBuf },
    Full { directory: PathBuf, progress: Progress },
}

pub struct LoadRequest<'a> {
    pub root: &'a Path,
    pub finetune: bool,
    pub load_optimizer: bool,
    pub load_rng: bool,
    pub scheduler_policy: SchedulerLoadPolicy,
}

/// Loads the model weights of the checkpoint under `request.root` into `model`, and returns
/// the rest for [`restore_training_state`] once the optimizer exists.
pub fn load_weights(request: &LoadRequest, model: &GptModel) -> Result<Option<crate::checkpoint::LoadedCheckpoint>> {
    let device = model.options().device;
    let options = LoadOptions { optimizer: request.load_optimizer && !request.finetune, rng: request.load_rng && !request.finetune };
    let Some(checkpoint) = load_checkpoint(request.root, &rank_directory(), device, options)? else {
        return Ok(None);
    };
    let saved: crate::model::GptConfig = serde_json::from_value(checkpoint.metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
    if saved != model.config {
        bail!(
            "{} was saved with a different architecture: {}",
            checkpoint.directory.display(),
            config_differences(&saved, &model.config)
        );
    }
    model.load_parameters(&checkpoint.model).with_context(|| format!("loading {}", checkpoint.directory.display()))?;
    Ok(Some(checkpoint))
}

fn config_differences(saved: &crate::model::GptConfig, ours: &crate::model::GptConfig) -> String {
    let (saved, ours) = (serde_json::to_value(saved).unwrap_or_default(), serde_json::to_value(ours).unwrap_or_default());
    let (Some(saved), Some(ours)) = (saved.as_object(), ours.as_object()) else {
        return String::new();
    };
    saved
        .iter()
        .filter(|(k, v)| ours.get(*k) != Some(v))
        .map(|(k, v)| format!("{k} = {v} in the checkpoint, {} now", ours.get(k).cloned().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join("; ")
}

pub struct TrainingState<'a> {
    pub optimizer: &'a mut MixedPrecisionOptimizer,
    pub scheduler: &'a mut OptimizerParamScheduler,
    pub scaler: &'a mut LossScaler,
}

/// Restores counters, optimizer, scheduler, loss scaler and generators from a loaded checkpoint.
pub fn restore_training_state(
    checkpoint: crate::checkpoint::LoadedCheckpoint,
    request: &LoadRequest,
    state: TrainingState,
    device: Device,
) -> Result<Resumed> {
    let directory = checkpoint.directory.clone();
    if request.finetune || checkpoint.release {
        return Ok(Resumed::Weights { directory });
    }
    let metadata = &checkpoint.metadata;
    if let Some(scheduler) = &metadata.opt_param_scheduler {
        let saved: SchedulerState = serde_json::from_value(scheduler.clone()).context("checkpoint scheduler state")?;
        state.scheduler.load_state(&saved, request.scheduler_policy).with_context(|| format!("resuming {}", directory.display()))?;
    }
    if let (Some(scaler), true) = (&metadata.grad_scaler, state.scaler.is_dynamic()) {
        let saved: LossScalerState = serde_json::from_value(scaler.clone()).context("checkpoint loss scaler state")?;
        state.scaler.load_state(&saved)?;
    }
    if let Some(tensors) = &checkpoint.optimizer {
        state.optimizer.load_state_tensors(tensors).with_context(|| format!("optimizer state of {}", directory.display()))?;
    }
    if let Some(rng) = &checkpoint.rng {
        if let Some(cpu) = rng.get("cpu_rng_state") {
            GeneratorState::from_tensor(Device::Cpu, cpu.to_device(Device::Cpu)).restore()?;
        }
        if let (Some(cuda), true) = (rng.get("cuda_rng_state"), device.is_cuda()) {
            GeneratorState::from_tensor(device, cuda.to_device(Device::Cpu)).restore()?;
        }
    }
    Ok(Resumed::Full {
        directory,
        progress: Progress {
            iteration: metadata.iteration,
            consumed_train_samples: metadata.consumed_train_samples,
            consumed_valid_samples: metadata.consumed_valid_samples,
            floating_point_operations: metadata.num_floating_point_operations_so_far,
        },
    })
}
