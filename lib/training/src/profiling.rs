//! Megatron's `--profile` over a window of training iterations: a libtorch (Kineto) trace with
//! `--use-pytorch-profiler`, otherwise the CUDA profiler range for nsys.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::args::LoggingArgs;
use megatron_kernels::runtime::{cuda_profiler_start, cuda_profiler_stop, KinetoTrace};

enum Mode {
    Kineto { dir: PathBuf, with_cuda: bool },
    Nsys,
}

enum State {
    Waiting,
    Kineto { trace: KinetoTrace, path: PathBuf },
    Nsys,
    Done,
}

/// Starts profiling before iteration `--profile-step-start` and stops once
/// `--profile-step-end` iterations are complete (or training ends earlier).
pub struct StepProfiler {
    mode: Mode,
    start: u64,
    end: u64,
    rank: usize,
    state: State,
}

impl StepProfiler {
    /// The profiler this rank runs, if `--profile` names it.
    pub fn from_args(args: &LoggingArgs, rank: usize, on_cuda: bool) -> Result<Option<Self>> {
        if !args.profile || !args.profile_ranks.contains(&rank) {
            return Ok(None);
        }
        if args.profile_step_end <= args.profile_step_start {
            megatron_cli::bail_usage!(
                "--profile-step-end ({}) must be greater than --profile-step-start ({})",
                args.profile_step_end,
                args.profile_step_start
            );
        }
        let mode = if args.use_pytorch_profiler {
            let Some(dir) = &args.tensorboard_dir else {
                megatron_cli::bail_usage!(
                    "--use-pytorch-profiler writes its trace into --tensorboard-dir: set it"
                );
            };
            Mode::Kineto {
                dir: dir.clone(),
                with_cuda: on_cuda,
            }
        } else {
            if !on_cuda {
                bail!(
                    "--profile without --use-pytorch-profiler opens the CUDA profiler range for \
                     nsys, which needs a GPU; add --use-pytorch-profiler for a trace on the CPU"
                );
            }
            Mode::Nsys
        };
        Ok(Some(StepProfiler {
            mode,
            start: args.profile_step_start,
            end: args.profile_step_end,
            rank,
            state: State::Waiting,
        }))
    }

    /// Call before each training step with the number of iterations already complete.
    pub fn before_step(&mut self, completed: u64) -> Result<()> {
        if !matches!(self.state, State::Waiting) || completed < self.start {
            return Ok(());
        }
        self.state = match &self.mode {
            Mode::Kineto { dir, with_cuda } => State::Kineto {
                trace: KinetoTrace::start(*with_cuda, true)?,
                path: dir.join(format!(
                    "trace_rank{}_iter{}-{}.json",
                    self.rank, self.start, self.end
                )),
            },
            Mode::Nsys => {
                cuda_profiler_start()?;
                State::Nsys
            }
        };
        Ok(())
    }

    /// Call after each training step with the number of iterations now complete.
    pub fn after_step(&mut self, completed: u64) -> Result<Option<String>> {
        if completed < self.end {
            return Ok(None);
        }
        self.finish()
    }

    /// Ends a running profile (at `--profile-step-end`, or when training stops before it);
    /// returns what was written, for the log.
    pub fn finish(&mut self) -> Result<Option<String>> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Kineto { trace, path } => {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir).with_context(|| {
                        format!("creating the trace directory {}", dir.display())
                    })?;
                }
                trace.save(&path)?;
                Ok(Some(format!("profiler trace saved to {}", path.display())))
            }
            State::Nsys => {
                cuda_profiler_stop()?;
                Ok(Some("CUDA profiler range closed".to_string()))
            }
            State::Waiting | State::Done => Ok(None),
        }
    }
}
