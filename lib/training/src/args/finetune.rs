//! `eval_tasks`' finetuning flags (Megatron's `tasks/main.py` task arguments for RACE, MNLI
//! and QQP) on top of every `pretrain_bert` flag.

use std::path::PathBuf;

use clap::Args;

use crate::families::BertPretrainArgs;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct FinetuneTaskArgs {
    /// RACE (multiple choice), MNLI or QQP (classification).
    #[arg(long)]
    pub task: String,
    /// Training data: RACE directories of *.txt files (RACE/train/middle RACE/train/high), or
    /// GLUE .tsv files (MNLI/train.tsv, QQP/train.tsv).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub train_data: Vec<PathBuf>,
    /// Validation data, scored separately after every epoch (RACE/dev/middle,
    /// MNLI/dev_matched.tsv MNLI/dev_mismatched.tsv, ...).
    #[arg(long, num_args = 0.., action = clap::ArgAction::Set)]
    pub valid_data: Vec<PathBuf>,
    /// Passes over the training data; 0 only scores --valid-data with the loaded model.
    #[arg(long)]
    pub epochs: Option<u64>,
    /// Keep the last, incomplete batch of every epoch (completed with the epoch's first
    /// samples) instead of dropping it.
    #[arg(long)]
    pub keep_last: bool,
    /// Examples per forward when scoring --valid-data [default: --micro-batch-size].
    #[arg(long)]
    pub eval_micro_batch_size: Option<u64>,
    /// Also write the accuracies of every epoch to this JSON file.
    #[arg(long)]
    pub results_json: Option<PathBuf>,
}

/// Every flag of a finetuning run: `pretrain_bert`'s and the task's.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct FinetuneArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub model: BertPretrainArgs,
    #[command(flatten, next_help_heading = "Task")]
    #[serde(flatten)]
    pub task: FinetuneTaskArgs,
}
