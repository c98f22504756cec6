//! Logging flags (spec §4.8).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct LoggingArgs {
    /// Print the training log line every N iterations.
    #[arg(long, default_value_t = 100)]
    pub log_interval: u64,
    /// Write TensorBoard event files here (and metrics.jsonl, unless --metrics-file).
    #[arg(long)]
    pub tensorboard_dir: Option<PathBuf>,
    /// Write TensorBoard scalars every N iterations.
    #[arg(long, default_value_t = 1)]
    pub tensorboard_log_interval: u64,
    /// Add Megatron's throughput field (TFLOP/s per GPU) to the log line.
    #[arg(long)]
    pub log_throughput: bool,
    /// Add the L2 norm of the parameters to the log line and TensorBoard (`params-norm`).
    #[arg(long)]
    pub log_params_norm: bool,
    /// Add the number of zeros in the gradient (after reduction, before clipping) to the log
    /// line and TensorBoard (`num-zeros`).
    #[arg(long)]
    pub log_num_zeros_in_grad: bool,
    /// Write the CUDA caching allocator's memory use to TensorBoard every logged iteration
    /// (`mem-reserved-bytes`, `mem-allocated-bytes`, `mem-max-allocated-bytes`,
    /// `mem-allocated-count`); on a CPU nothing is written and a note says so.
    #[arg(long)]
    pub log_memory_to_tensorboard: bool,
    /// JSON-lines file of per-iteration metrics [default: TENSORBOARD_DIR/metrics.jsonl].
    #[arg(long)]
    pub metrics_file: Option<PathBuf>,
    /// Accepted for compatibility (timers are not broken down).
    #[arg(long)]
    pub timing_log_level: Option<u32>,
    /// Profile iterations --profile-step-start to --profile-step-end: with
    /// --use-pytorch-profiler a libtorch (Kineto) trace, otherwise the CUDA profiler range that
    /// `nsys profile --capture-range=cudaProfilerApi` records.
    #[arg(long)]
    pub profile: bool,
    /// With --profile: write a Chrome trace of the profiled iterations (operators, CUDA kernels)
    /// to --tensorboard-dir as trace_rank<R>_iter<START>-<END>.json.
    #[arg(long)]
    pub use_pytorch_profiler: bool,
    /// First profiled iteration (counting completed iterations, as Megatron does).
    #[arg(long, default_value_t = 10)]
    pub profile_step_start: u64,
    /// Profiling stops once this many iterations are complete.
    #[arg(long, default_value_t = 12)]
    pub profile_step_end: u64,
    /// Global ranks that profile.
    #[arg(long, num_args = 1.., default_values_t = [0], action = clap::ArgAction::Set)]
    pub profile_ranks: Vec<usize>,
}
