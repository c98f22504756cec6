//! `pretrain_gpt`: Megatron's `pretrain_gpt.py` — same flags, same data order, same log lines.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use megatron_convert::{
    export_saved_checkpoint, import_for_job, MegatronFormat, NodeCheckpoint, OptimizerShards,
    TargetLayout,
};
use megatron_parallel::{LaunchEnv, Placement};
use megatron_training::{
    pretrain_gpt_with_hooks, run_job, CheckpointExport, ExportingHooks, GptPretrainArgs,
};

/// Pretrain a GPT model on Megatron indexed datasets (or --mock-data), on one GPU, many GPUs
/// (launched by torchrun or srun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT or
/// SLURM_*), or CPUs.
///
/// Flags keep Megatron's names and defaults, and as with Megatron's argparse a flag given twice
/// takes its last value; checkpoints use Megatron's directory layout with safetensors shards,
/// and --load also resumes Megatron's own torch and torch_dist checkpoints (imported on the fly);
/// --ckpt-format torch_dist or torch saves Megatron's.
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
                let export = megatron_format(&mut args, runtime.parallel.rank)
                    .map(|format| Arc::new(Export(format)) as Arc<dyn CheckpointExport>);
                // Kept until the run ends: the run reads the rewritten checkpoint from it.
                let _prepared = prepare_load(&mut args, runtime)?;
                pretrain_gpt_with_hooks(&args, runtime, &mut ExportingHooks(export))
            },
        )?;
        if let Some(summary) = summary {
            println!("{}", summary.line("pretrain_gpt", false, "validation loss"));
        }
        Ok(())
    })
}

/// The Megatron format `--ckpt-format` names for `--save`. Models its writer does not take are
/// saved in ours (the flag set to it), which `--load` reads as well, with a warning saying why:
/// Megatron's scripts that pass the flag still run.
fn megatron_format(args: &mut GptPretrainArgs, rank: usize) -> Option<MegatronFormat> {
    let format = args
        .checkpoint
        .ckpt_format
        .as_deref()
        .and_then(MegatronFormat::named);
    let (Some(format), Some(_)) = (format, &args.checkpoint.save) else {
        return None;
    };
    let moe = args.model.moe.num_experts.is_some();
    let unwritten = if moe && args.parallel.tensor_model_parallel_size > 1 {
        Some("Mixture-of-Experts runs with tensor parallelism are not written in Megatron's formats here")
    } else if moe
        && format == MegatronFormat::TorchDist
        && !args.parallel.use_distributed_optimizer
        && !args.checkpoint.no_save_optim
    {
        Some("the plain optimizer's torch_dist state of a Mixture-of-Experts run is not written here (the distributed optimizer's is)")
    } else if args.fp8.fp8_format.is_some() {
        Some("the fp8 scaling state is not written in Megatron's formats here")
    } else {
        None
    };
    match unwritten {
        Some(why) => {
            if rank == 0 {
                eprintln!(
                    "warning: --ckpt-format {}: {why}; saving --ckpt-format safetensors instead",
                    format.name()
                );
            }
            args.checkpoint.ckpt_format = Some("safetensors".into());
            None
        }
        None => Some(format),
    }
}

/// `--ckpt-format torch_dist` or `torch`: each save rewritten by `checkpoint_convert`'s writer.
struct Export(MegatronFormat);

impl CheckpointExport for Export {
    fn format(&self) -> &'static str {
        self.0.name()
    }

    fn export(&self, ours: &Path, save: &Path) -> anyhow::Result<PathBuf> {
        export_saved_checkpoint(ours, save, self.0)
    }
}

/// Points --load at a copy laid out for this run (its model-parallel layout, its distributed
/// optimizer's shards) where --load names a Megatron torch or torch_dist checkpoint, or one of
/// ours saved under another layout: written once per node, by its local rank 0, which says so.
fn prepare_load(
    args: &mut GptPretrainArgs,
    runtime: &Placement,
) -> anyhow::Result<Option<NodeCheckpoint>> {
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
    let launch = LaunchEnv::from_env()?;
    let prepared = import_for_job(&load, layout, optimizer, shards, runtime, &launch)?;
    let Some(prepared) = prepared else {
        return Ok(None);
    };
    if let Some(description) = &prepared.description {
        println!("{description}");
    }
    args.checkpoint.load = Some(prepared.directory.clone());
    // The copy is another process's when this one did not write it: if that process failed and
    // removed it, this one must fail too rather than train from scratch.
    args.checkpoint.exit_on_missing_checkpoint = true;
    Ok(Some(prepared))
}
