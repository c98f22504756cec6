//! `pretrain_gpt`: Megatron's `pretrain_gpt.py` — same flags, same data order, same log lines.

use std::process::ExitCode;

use clap::Parser;
use megatron_convert::{import_for_resume, OptimizerShards, TargetLayout};
use megatron_parallel::Placement;
use megatron_training::GptPretrainArgs;
use megatron_training::{pretrain_gpt, run_job};

/// Pretrain a GPT model on Megatron indexed datasets (or --mock-data), on one GPU, many GPUs
/// (launched by torchrun or srun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT or
/// SLURM_*), or CPUs.
///
/// Flags keep Megatron's names and defaults, and as with Megatron's argparse a flag given twice
/// takes its last value; checkpoints use Megatron's directory layout with safetensors shards,
/// and --load also resumes Megatron's own torch and torch_dist checkpoints (imported on the fly).
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
        let summary = run_job(
            &common.parallel,
            &common.training,
            common.model.moe.expert_parallel(),
            |runtime| {
                let mut args = cli.args.clone();
                // Kept until the run ends: the run reads the rewritten checkpoint from it.
                let _prepared = prepare_load(&mut args, runtime)?;
                pretrain_gpt(&args, runtime)
            },
        )?;
        if let Some(summary) = summary {
            println!("{}", summary.line("pretrain_gpt", false, "validation loss"));
        }
        Ok(())
    })
}

/// Points --load at a copy laid out for this run (its model-parallel layout, its distributed
/// optimizer's shards) where --load names a Megatron torch or torch_dist checkpoint, or one of
/// ours saved under another layout; rank 0 says so.
fn prepare_load(
    args: &mut GptPretrainArgs,
    runtime: &Placement,
) -> anyhow::Result<Option<tempfile::TempDir>> {
    let Some(load) = args.checkpoint.load.clone() else {
        return Ok(None);
    };
    let layout = TargetLayout {
        tensor: args.parallel.tensor_model_parallel_size,
        pipeline: args.parallel.pipeline_model_parallel_size,
        virtual_stages: args.parallel.virtual_stages(args.model.num_layers)?,
    };
    let optimizer = !args.checkpoint.no_load_optim && !args.checkpoint.finetune;
    // The distributed optimizer is sharded over data × context.
    let data_parallel = runtime.parallel.data_with_context.size();
    let shards = args
        .parallel
        .use_distributed_optimizer
        .then(|| OptimizerShards {
            data_parallel,
            bucket_size: args.parallel.bucket_size(data_parallel),
        });
    let prepared = import_for_resume(&load, layout, optimizer, shards)?;
    let Some(prepared) = prepared else {
        return Ok(None);
    };
    if runtime.parallel.rank == 0 {
        println!("{}", prepared.description);
    }
    args.checkpoint.load = Some(prepared.directory.path().to_path_buf());
    Ok(Some(prepared.directory))
}
