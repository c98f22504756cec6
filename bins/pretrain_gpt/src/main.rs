//! `pretrain_gpt`: Megatron's `pretrain_gpt.py` — same flags, same data order, same log lines.

use std::process::ExitCode;

use clap::Parser;
use megatron_core::args::GptPretrainArgs;
use megatron_core::training::{join_job, pretrain_gpt};

/// Pretrain a GPT model on Megatron indexed datasets (or --mock-data), on one GPU, many GPUs
/// (launched by torchrun or srun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT or
/// SLURM_*), or CPUs.
///
/// Flags keep Megatron's names and defaults, and as with Megatron's argparse a flag given twice
/// takes its last value; checkpoints use Megatron's directory layout with safetensors shards.
/// SIGTERM or Ctrl-C saves (with --save) and exits after the current iteration.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    args: GptPretrainArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| {
        let (job, runtime) = join_job(&cli.args.parallel, &cli.args.training.device)?;
        let summary = pretrain_gpt(&cli.args, &runtime)?;
        job.finish()?;
        if !runtime.parallel.is_logging_rank() {
            return Ok(());
        }
        let loss = summary
            .last_lm_loss
            .map_or("-".to_string(), |l| format!("{l:.4}"));
        let validation = summary
            .validation_loss
            .map_or("-".to_string(), |l| format!("{l:.4}"));
        let checkpoint = summary
            .last_checkpoint
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string());
        println!(
            "pretrain_gpt: {} iterations, {} samples, lm loss {loss}, validation loss {validation}, checkpoint {checkpoint}, \
             {:.1} s ({})",
            summary.iterations, summary.consumed_samples, summary.seconds, summary.exit_reason
        );
        Ok(())
    })
}
