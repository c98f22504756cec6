//! Evaluation tasks (`eval_tasks`, Megatron's `tasks/main.py`, spec §7). A task names its data
//! builder (in `megatron_data::tasks`) and its metric; the zero-shot GPT tasks ([`Task`]) score
//! a loaded model over batches of windows; the BERT finetuning tasks ([`FinetuneTask`]) train a
//! task head on the training engine and score it after every epoch.

mod finetune;
mod report;
mod run;
mod zeroshot;

pub use finetune::{finetune, EpochAccuracy, FinetuneSummary, FinetuneTask, SetAccuracy};
pub use report::{LambadaReport, WikitextReport};
pub use run::{
    evaluate, run_lambada, run_wikitext, EvalModel, EvalObserver, EvalOptions, LambadaReportKind,
};
pub use zeroshot::{score_lambada, score_windows, LambadaScores};

use anyhow::{bail, Result};

/// `--task`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// Accuracy of the last word (spec §7.2).
    Lambada,
    /// Perplexity over overlapping windows (spec §7.3).
    Wikitext103,
}

impl Task {
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "LAMBADA" => Task::Lambada,
            "WIKITEXT103" => Task::Wikitext103,
            other => bail!("--task {other:?}: expected LAMBADA, WIKITEXT103, RACE, MNLI or QQP"),
        })
    }

    /// Megatron's name for the task, as its result line prints it.
    pub fn name(self) -> &'static str {
        match self {
            Task::Lambada => "LAMBADA",
            Task::Wikitext103 => "WIKITEXT103",
        }
    }
}
