//! `pretrain_t5`: Megatron's `pretrain_t5.py` — same flags, same loss, same log lines.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};
use megatron_training::{pretrain_t5, run_job};
use megatron_training::{t5_flags, T5PretrainArgs};

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
        let common = &cli.args.common;
        let summary = run_job(&common.parallel, &common.training, None, |runtime| {
            pretrain_t5(&cli.args, runtime)
        })?;
        if let Some(summary) = summary {
            println!(
                "{}",
                summary.line("pretrain_t5", false, "validation lm loss")
            );
        }
        Ok(())
    })
}
