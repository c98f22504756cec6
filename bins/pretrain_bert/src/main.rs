//! `pretrain_bert`: Megatron's `pretrain_bert.py` — same flags, same losses, same log lines.

use std::process::ExitCode;

use clap::Parser;
use megatron_core::args::BertPretrainArgs;
use megatron_core::training::{join_job, pretrain_bert};

/// Pretrain a BERT model (masked-LM and, unless --bert-no-binary-head, sentence-order
/// prediction) on Megatron indexed datasets preprocessed with --split-sentences (or
/// --mock-data), on one GPU, many GPUs (launched by torchrun or srun) or CPUs.
///
/// Flags keep Megatron's names and defaults (--tokenizer-type defaults to
/// BertWordPieceLowerCase, as in pretrain_bert.py); a flag given twice takes its last value.
/// SIGTERM or Ctrl-C saves (with --save) and exits after the current iteration.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
#[command(mut_arg("tokenizer_type", |arg| arg.default_value("BertWordPieceLowerCase")))]
struct Cli {
    #[command(flatten)]
    args: BertPretrainArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| {
        let (job, runtime) = join_job(&cli.args.common.parallel, &cli.args.common.training.device)?;
        let summary = pretrain_bert(&cli.args, &runtime)?;
        job.finish()?;
        if !runtime.parallel.is_logging_rank() {
            return Ok(());
        }
        let losses: Vec<String> = summary
            .last_losses
            .iter()
            .map(|(name, value)| format!("{name} {value:.4}"))
            .collect();
        let losses = if losses.is_empty() {
            "lm loss -".to_string()
        } else {
            losses.join(", ")
        };
        let validation = summary
            .validation_loss
            .map_or("-".to_string(), |l| format!("{l:.4}"));
        let checkpoint = summary
            .last_checkpoint
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string());
        println!(
            "pretrain_bert: {} iterations, {} samples, {losses}, validation lm loss {validation}, checkpoint {checkpoint}, \
             {:.1} s ({})",
            summary.iterations, summary.consumed_samples, summary.seconds, summary.exit_reason
        );
        Ok(())
    })
}
