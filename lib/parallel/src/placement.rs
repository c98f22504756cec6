//! Joining the launched job: where this process computes, from the launcher's environment
//! (torchrun or Slurm variables; a lone process otherwise) and the binary's flags.

use std::time::Duration;

use anyhow::Result;
use megatron_kernels::runtime::resolve_device;
use tch::Device;

use crate::{Backend, Job, LaunchEnv, ParallelLayout, ParallelState};

/// Where this process computes: its parallel groups and its device.
pub struct Placement {
    pub parallel: ParallelState,
    pub device: Device,
}

/// What a binary's flags say about the job it joins.
#[derive(Debug, Clone)]
pub struct JoinOptions<'a> {
    /// `--device`: `auto`, `cpu`, `cuda` or `cuda:N`.
    pub device: &'a str,
    /// `--local-rank` when given; otherwise the launcher's `LOCAL_RANK`.
    pub local_rank: Option<usize>,
    pub tensor_parallel: usize,
    /// `--context-parallel-size` (1 where a binary has no such flag).
    pub context_parallel: usize,
    pub pipeline_parallel: usize,
    /// `--expert-model-parallel-size` for a model with Mixture-of-Experts layers; `None`
    /// builds no expert groups.
    pub expert_parallel: Option<usize>,
    pub sequence_parallel: bool,
    /// The backend asked for; on CPUs gloo is used whatever it says, since NCCL cannot run there.
    pub backend: Backend,
    /// `--distributed-timeout-minutes`.
    pub timeout: Duration,
}

/// Joins the job, picks this rank's device from `options.device` and its local rank, and builds
/// the groups of tensor × context × pipeline × the data-parallel rest.
pub fn join_launched_job(options: &JoinOptions) -> Result<(Job, Placement)> {
    let env = LaunchEnv::from_env()?;
    let device = resolve_device(options.device, options.local_rank.unwrap_or(env.local_rank))?;
    let mut layout = ParallelLayout::with_context(
        env.world_size,
        options.tensor_parallel,
        options.context_parallel,
        options.pipeline_parallel,
    )?;
    if let Some(expert) = options.expert_parallel {
        layout = layout.with_expert_parallel(expert)?;
    }
    let backend = if device.is_cuda() {
        options.backend
    } else {
        Backend::Gloo
    };
    let job = Job::join(env, options.timeout)?;
    let parallel = job.parallel_state(layout, options.sequence_parallel, backend, device)?;
    Ok((job, Placement { parallel, device }))
}
