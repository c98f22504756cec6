//! `pretrain_gpt`: Megatron's `pretrain_gpt.py` — same flags, same data order, same log lines.

use std::process::ExitCode;

use clap::Parser;
use megatron_training::GptPretrainArgs;
use megatron_training::{pretrain_gpt, run_job};

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
        let common = &cli.args;
        let summary = run_job(&common.parallel, &common.training, |runtime| {
            pretrain_gpt(&cli.args, runtime)
        })?;
        if let Some(summary) = summary {
            println!("{}", summary.line("pretrain_gpt", false, "validation loss"));
        }
        Ok(())
    })
}
