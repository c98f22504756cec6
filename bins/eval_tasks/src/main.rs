//! `eval_tasks`: Megatron's `tasks/main.py` — the zero-shot GPT tasks (LAMBADA accuracy and
//! WikiText-103 perplexity of a trained checkpoint) and BERT finetuning on RACE, MNLI and QQP,
//! with Megatron's flags and result lines. The finetuning tasks take `pretrain_bert`'s flags, so
//! `--task` picks the parser.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use indicatif::ProgressBar;
use megatron_cli::bail_usage;
use megatron_data::flags::TokenizerArgs;
use megatron_data::tokenizer::build_tokenizer;
use megatron_inference::CheckpointModelArgs;
use megatron_training::args::FinetuneArgs;
use megatron_training::join_job;
use megatron_training::tasks::{
    evaluate, finetune, EvalModel, EvalObserver, EvalOptions, FinetuneTask, LambadaReportKind, Task,
};

/// Evaluate a GPT checkpoint as Megatron's `tasks/main.py` does:
/// `eval_tasks --task LAMBADA --valid-data lambada_test.jsonl --strict-lambada --load ckpt
/// --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt`, or `--task WIKITEXT103
/// --valid-data wiki.test.tokens`. The architecture comes from the checkpoint; Megatron's model
/// flags are accepted and checked against it. Under torchrun with
/// --tensor-model-parallel-size N the model is split over N processes.
///
/// BERT finetuning (--task RACE, MNLI or QQP) takes every pretrain_bert flag instead: see
/// `eval_tasks --task MNLI --help`.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    /// LAMBADA (accuracy) or WIKITEXT103 (perplexity); RACE, MNLI and QQP finetune a BERT
    /// (see `eval_tasks --task MNLI --help`).
    #[arg(long, value_parser = ["LAMBADA", "WIKITEXT103", "RACE", "MNLI", "QQP"], hide_possible_values = true)]
    task: String,
    /// The data file: LAMBADA's JSON lines (key "text"), or WikiText's raw `wiki.*.tokens`
    /// (the detokenizer is picked from the path as Megatron does: ptb, wiki or lambada).
    #[arg(long, num_args = 0.., action = clap::ArgAction::Set)]
    valid_data: Vec<PathBuf>,
    /// LAMBADA: predict the whole last word (Megatron's recommended setting), not only its
    /// last BPE token.
    #[arg(long)]
    strict_lambada: bool,
    /// WikiText: stride between windows; each later window scores only its last this many
    /// tokens (values below 1 mean 1).
    #[arg(long, default_value_t = 32, allow_negative_numbers = true)]
    overlapping_eval: i64,
    /// Windows (or passages) per forward pass [default: --micro-batch-size, else 8].
    #[arg(long)]
    eval_micro_batch_size: Option<usize>,
    /// LAMBADA numbers to print: megatron (its formulation), lm-eval (lm-evaluation-harness's
    /// lambada_openai formulation), or both, each labelled.
    #[arg(long, default_value = "megatron", value_parser = ["megatron", "lm-eval", "both"], hide_possible_values = true)]
    report: String,
    /// Also write the numbers to this JSON file.
    #[arg(long)]
    results_json: Option<PathBuf>,
    /// Print "> working on iteration: N" every this many micro-batches (0: never).
    #[arg(long, default_value_t = 100)]
    log_interval: usize,
    #[command(flatten)]
    model: CheckpointModelArgs,
    #[command(flatten, next_help_heading = "Tokenizer")]
    tokenizer: TokenizerArgs,
}

/// Megatron's lines on stdout (rank 0 only), a progress bar on stderr.
struct Console {
    print: bool,
    bar: Option<ProgressBar>,
}

impl EvalObserver for Console {
    fn log(&mut self, line: &str) {
        if self.print {
            match &self.bar {
                Some(bar) => bar.suspend(|| println!("{line}")),
                None => println!("{line}"),
            }
        }
    }

    fn start(&mut self, what: &str, total: u64) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        if self.print {
            self.bar = Some(megatron_cli::progress_bar(
                total,
                &format!("batches of {what}"),
            ));
        }
    }

    fn batch_done(&mut self) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// Finetune a pretrained BERT on RACE (multiple choice), MNLI or QQP (classification) as
/// Megatron's tasks/main.py does, and print the accuracy on every --valid-data set after every
/// epoch: `eval_tasks --task MNLI --train-data MNLI/train.tsv --valid-data
/// MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv --pretrained-checkpoint bert-ckpt --epochs 3
/// --micro-batch-size 8 --lr 5e-5 --lr-warmup-fraction 0.065 --save mnli ...` with the BERT's
/// model flags and vocabulary. --epochs 0 only scores the loaded model. Every pretrain_bert
/// flag is accepted (parallelism, precision, schedule, checkpoints, logging); --save writes a
/// checkpoint after every epoch, --load resumes one.
#[derive(Parser)]
#[command(
    name = "eval_tasks",
    version,
    args_override_self = true,
    max_term_width = 100
)]
#[command(mut_arg("tokenizer_type", |arg| arg.default_value("BertWordPieceLowerCase")))]
struct FinetuneCli {
    #[command(flatten)]
    args: FinetuneArgs,
}

/// The last `--task` value on the command line (`--task X` or `--task=X`).
fn task_on_command_line() -> Option<String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut task = None;
    for (i, arg) in args.iter().enumerate() {
        if let Some(value) = arg.strip_prefix("--task=") {
            task = Some(value.to_string());
        } else if arg == "--task" {
            task = args.get(i + 1).cloned();
        }
    }
    task
}

fn main() -> ExitCode {
    if task_on_command_line().is_some_and(|task| FinetuneTask::parse(&task).is_some()) {
        let cli = FinetuneCli::parse();
        return megatron_cli::run(|| run_finetune(&cli.args));
    }
    let cli = Cli::parse();
    megatron_cli::run(|| run(&cli))
}

fn run_finetune(args: &FinetuneArgs) -> Result<()> {
    let common = &args.model.common;
    let (job, placement) = join_job(&common.parallel, &common.training, None)?;
    let mut console = Console {
        print: placement.parallel.is_logging_rank(),
        bar: None,
    };
    let summary = finetune(args, &placement, &mut console)?;
    if let (Some(path), true) = (&args.task.results_json, console.print) {
        write_results(path, &summary.json())?;
    }
    console.log(&summary.line());
    drop(placement);
    job.finish()
}

/// Writes `results` to `path` through a temporary name.
fn write_results(path: &std::path::Path, results: &serde_json::Value) -> Result<()> {
    let partial = path.with_extension("json.tmp");
    std::fs::write(&partial, serde_json::to_string_pretty(results)? + "\n")
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, path).with_context(|| format!("writing {}", path.display()))
}

fn run(cli: &Cli) -> Result<()> {
    let task = Task::parse(&cli.task)?;
    let report = LambadaReportKind::parse(&cli.report)?;
    let valid_data = match cli.valid_data.as_slice() {
        [one] => one.clone(),
        [] => bail_usage!("give the data file with --valid-data"),
        many => bail_usage!(
            "--valid-data takes one file for {}, got {}",
            task.name(),
            many.len()
        ),
    };
    cli.model.print_ignored_flag_notes("eval_tasks");
    let (job, parallel, device) = cli.model.join_job()?;
    let tokenizer = build_tokenizer(&cli.tokenizer.config()?)?;
    let model = cli.model.load_model_for(&*tokenizer, device, &parallel)?;
    let options = EvalOptions {
        task,
        valid_data,
        seq_length: cli.model.seq_length_for(&model.config),
        strict_lambada: cli.strict_lambada,
        overlapping_eval: Some(cli.overlapping_eval),
        micro_batch_size: cli
            .eval_micro_batch_size
            .or(cli.model.micro_batch_size)
            .unwrap_or(8)
            .max(1),
        report,
        log_interval: cli.log_interval,
    };
    let mut console = Console {
        print: parallel.is_logging_rank(),
        bar: None,
    };
    let results = evaluate(
        &EvalModel {
            model: &model,
            tensor_group: &parallel.tensor,
        },
        tokenizer.as_ref(),
        &options,
        &mut console,
    )?;
    if let Some(bar) = console.bar.take() {
        bar.finish_and_clear();
    }
    if let (Some(path), true) = (&cli.results_json, console.print) {
        write_results(path, &results)?;
    }
    console.log("done :-)");
    drop(model);
    drop(parallel);
    job.finish()
}
