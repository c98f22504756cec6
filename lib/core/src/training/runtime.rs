//! A training process's place in its job, from the launcher's environment and the flags.

use std::time::Duration;

use anyhow::Result;
use tch::Device;

use super::device::{gemms_without_workspace, resolve_device};
use super::engine::TrainingSummary;
use crate::args::ParallelArgs;
use crate::parallel::{Backend, Job, LaunchEnv, ParallelLayout, ParallelState};

/// Where a training run executes: its parallel groups and its device.
pub struct Runtime {
    pub parallel: ParallelState,
    pub device: Device,
}

/// Joins the job (torchrun or Slurm variables; a lone process otherwise), picks this rank's
/// device from `--device` and `LOCAL_RANK` (on a GPU, cuBLAS without a workspace), and builds
/// the groups of `--tensor-model-parallel-size` × `--pipeline-model-parallel-size` × the
/// data-parallel rest. On CPUs the gloo backend is used whatever `--distributed-backend` says,
/// since NCCL cannot run there.
pub fn join_job(parallel: &ParallelArgs, device: &str) -> Result<(Job, Runtime)> {
    let env = LaunchEnv::from_env()?;
    let timeout = Duration::from_secs_f64(parallel.distributed_timeout_minutes * 60.0);
    let local_rank = parallel.local_rank.unwrap_or(env.local_rank);
    let device = resolve_device(device, local_rank)?;
    if device.is_cuda() {
        gemms_without_workspace();
    }
    let layout = ParallelLayout::new(
        env.world_size,
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
    )?;
    let mut backend = Backend::parse(&parallel.distributed_backend)?;
    if backend == Backend::Nccl && !device.is_cuda() {
        backend = Backend::Gloo;
    }
    let job = Job::join(env, timeout)?;
    let state = job.parallel_state(layout, parallel.sequence_parallel, backend, device)?;
    Ok((
        job,
        Runtime {
            parallel: state,
            device,
        },
    ))
}

/// A pretraining binary's run: joins the job, runs `train` on this rank and leaves the job. The
/// summary comes back on the rank that logs, `None` on the others.
pub fn run_job(
    parallel: &ParallelArgs,
    device: &str,
    train: impl FnOnce(&Runtime) -> Result<TrainingSummary>,
) -> Result<Option<TrainingSummary>> {
    let (job, runtime) = join_job(parallel, device)?;
    let summary = train(&runtime)?;
    job.finish()?;
    Ok(runtime.parallel.is_logging_rank().then_some(summary))
}
