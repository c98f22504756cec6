//! `pretrain_t5`: Megatron's `pretrain_t5.py` — same flags, same loss, same log lines.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};
use megatron_core::args::{t5_flags, T5PretrainArgs};
use megatron_core::training::{join_job, pretrain_t5};

/// Pretrain a T5 encoder-decoder (span corruption: the encoder reads the text with spans
/// replaced by sentinels, the decoder predicts the spans) on Megatron indexed datasets
/// preprocessed with --split-sentences (or --mock-data), on one GPU, many GPUs (launched by
/// torchrun or srun) or CPUs, with tensor, sequence and data parallelism.
///
/// Flags keep Megatron's names and defaults (--encoder-num-layers / --num-layers,
/// --encoder-seq-length / --seq-length, --tokenizer-type defaults to BertWordPieceLowerCase);
/// unlike Megatron core, --decoder-num-layers is honoured. A flag given twice takes its last
/// value. SIGTERM or Ctrl-C saves (with --save) and exits after the current iteration.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    args: T5PretrainArgs,
}

fn main() -> ExitCode {
    let matches = t5_flags(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    megatron_cli::run(|| {
        let (job, runtime) = join_job(&cli.args.common.parallel, &cli.args.common.training.device)?;
        let summary = pretrain_t5(&cli.args, &runtime)?;
        job.finish()?;
        if !runtime.parallel.is_logging_rank() {
            return Ok(());
        }
        let loss = summary
            .last_losses
            .iter()
            .find(|(name, _)| *name == "lm loss")
            .map_or("-".to_string(), |(_, v)| format!("{v:.4}"));
        let validation = summary
            .validation_loss
            .map_or("-".to_string(), |l| format!("{l:.4}"));
        let checkpoint = summary
            .last_checkpoint
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string());
        println!(
            "pretrain_t5: {} iterations, {} samples, lm loss {loss}, validation lm loss {validation}, checkpoint {checkpoint}, \
             {:.1} s ({})",
            summary.iterations, summary.consumed_samples, summary.seconds, summary.exit_reason
        );
        Ok(())
    })
}
