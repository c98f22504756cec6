//! `pretrain_bert`: Megatron's `pretrain_bert.py` — same flags, same losses, same log lines.

use std::process::ExitCode;

use clap::Parser;
use megatron_training::BertPretrainArgs;
use megatron_training::{pretrain_bert, run_job};

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
        let common = &cli.args.common;
        let summary = run_job(&common.parallel, &common.training, None, |runtime| {
            pretrain_bert(&cli.args, runtime)
        })?;
        if let Some(summary) = summary {
            println!(
                "{}",
                summary.line("pretrain_bert", true, "validation lm loss")
            );
        }
        Ok(())
    })
}
