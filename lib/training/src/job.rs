//! A pretraining binary's run: joining the job with the pretraining flags, training, leaving.

use std::time::Duration;

use anyhow::Result;

use super::device::{gemms_without_workspace, reproducible_cpu_gemms, single_threaded_cpu_ops};
use super::engine::TrainingSummary;
use crate::args::{ParallelArgs, TrainingArgs};
use megatron_parallel::{join_launched_job, Backend, Job, JoinOptions, Placement};

/// Joins the job with the pretraining flags (`--device`, `--local-rank`, the parallel sizes,
/// `--distributed-backend`, `--distributed-timeout-minutes`, and `experts`, the
/// `--expert-model-parallel-size` of a model with Mixture-of-Experts layers); on a GPU, cuBLAS without a
/// workspace; with `--deterministic-mode`, CPU GEMMs that give the same bits on every run
/// (reproducible MKL branches, one intra-op thread on a CPU device).
pub fn join_job(
    parallel: &ParallelArgs,
    training: &TrainingArgs,
    experts: Option<usize>,
) -> Result<(Job, Placement)> {
    if training.deterministic_mode {
        reproducible_cpu_gemms();
    }
    let (job, placement) = join_launched_job(&JoinOptions {
        device: &training.device,
        local_rank: parallel.local_rank,
        tensor_parallel: parallel.tensor_model_parallel_size,
        context_parallel: parallel.context_parallel_size,
        pipeline_parallel: parallel.pipeline_model_parallel_size,
        expert_parallel: experts,
        sequence_parallel: parallel.sequence_parallel,
        backend: Backend::parse(&parallel.distributed_backend)?,
        timeout: Duration::from_secs_f64(parallel.distributed_timeout_minutes * 60.0),
    })?;
    if placement.device.is_cuda() {
        gemms_without_workspace();
    } else if training.deterministic_mode {
        single_threaded_cpu_ops();
    }
    if job.env.world_size > 1 && placement.parallel.is_logging_rank() {
        report_nodes(&job, &placement);
    }
    Ok((job, placement))
}

/// Says how the job spreads over nodes, and warns when tensor-parallel groups cross them: their
/// collectives, several per layer, would then run over the network.
fn report_nodes(job: &Job, placement: &Placement) {
    let node = job.env.node;
    let layout = placement.parallel.layout;
    println!(
        "> {} process(es) on {} node(s), {} per node; {}",
        job.env.world_size,
        node.nodes,
        node.local_world_size,
        layout.describe()
    );
    if !node.holds_whole_groups(layout.tensor) {
        eprintln!(
            "warning: tensor-parallel groups of {} ranks span nodes of {} process(es); keep \
             --tensor-model-parallel-size a divisor of the processes per node",
            layout.tensor, node.local_world_size
        );
    }
}

/// A pretraining binary's run: joins the job, runs `train` on this rank and leaves the job. The
/// summary comes back on the rank that logs, `None` on the others.
pub fn run_job(
    parallel: &ParallelArgs,
    training: &TrainingArgs,
    experts: Option<usize>,
    train: impl FnOnce(&Placement) -> Result<TrainingSummary>,
) -> Result<Option<TrainingSummary>> {
    let (job, placement) = join_job(parallel, training, experts)?;
    let summary = train(&placement)?;
    job.finish()?;
    Ok(placement.parallel.is_logging_rank().then_some(summary))
}
