//! One evaluation from data file to results: Megatron's `tasks/zeroshot_gpt/evaluate.py` main
//! loop, with its log lines.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use megatron_data::tasks::{
    detokenizer_for_path, Detokenizer, LambadaDataset, LambadaFormulation, LmDataset, TaskSample,
    WikitextData,
};
use megatron_data::tokenizer::Tokenizer;
use serde_json::{json, Value};

use super::{score_lambada, score_windows, LambadaReport, Task, WikitextReport};
use megatron_models::GptModel;
use megatron_parallel::Communicator;

/// `--report`: which LAMBADA numbers to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LambadaReportKind {
    Megatron,
    LmEval,
    Both,
}

impl LambadaReportKind {
    pub fn parse(value: &str) -> Result<Self> {
        Ok(match value {
            "megatron" => Self::Megatron,
            "lm-eval" => Self::LmEval,
            "both" => Self::Both,
            other => bail!("--report {other:?}: expected megatron, lm-eval or both"),
        })
    }
}

/// What to evaluate and how.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    pub task: Task,
    pub valid_data: PathBuf,
    pub seq_length: usize,
    pub strict_lambada: bool,
    /// `--overlapping-eval` (`None`: windows do not overlap).
    pub overlapping_eval: Option<i64>,
    pub micro_batch_size: usize,
    pub report: LambadaReportKind,
    /// Print `> working on iteration: N` every this many micro-batches (Megatron's
    /// `--log-interval`).
    pub log_interval: usize,
}

/// Where an evaluation reports to: Megatron's log lines, and each micro-batch done.
pub trait EvalObserver {
    fn log(&mut self, line: &str);
    /// `total` micro-batches in the pass about to start (named by `what`).
    fn start(&mut self, what: &str, total: u64);
    fn batch_done(&mut self);
    /// The pass is over (its progress display can go).
    fn finish(&mut self) {}
}

/// The model and how to reach the other tensor-parallel ranks (every rank runs the same
/// batches).
pub struct EvalModel<'a> {
    pub model: &'a GptModel,
    pub tensor_group: &'a Arc<dyn Communicator>,
}

/// Runs the task and returns its results as JSON; the result boxes go to `observer.log`.
pub fn evaluate(
    model: &EvalModel,
    tokenizer: &dyn Tokenizer,
    options: &EvalOptions,
    observer: &mut dyn EvalObserver,
) -> Result<Value> {
    let Some(pad) = tokenizer.eod() else {
        bail!("the zero-shot tasks pad with the end-of-document token; this tokenizer has none");
    };
    let task = options.task.name();
    let path = &options.valid_data;
    match options.task {
        Task::Lambada => {
            let mut results = serde_json::Map::new();
            results.insert("task".into(), json!(task));
            let megatron = if options.strict_lambada {
                (LambadaFormulation::MegatronStrict, "megatron_strict")
            } else {
                (LambadaFormulation::MegatronNonStrict, "megatron_non_strict")
            };
            let mut passes = Vec::new();
            if options.report != LambadaReportKind::LmEval {
                passes.push(megatron);
            }
            if options.report != LambadaReportKind::Megatron {
                passes.push((LambadaFormulation::LmEval, "lm_eval"));
            }
            for (formulation, name) in passes {
                observer.log(&format!(
                    "> building lambada dataset from {} ...",
                    path.display()
                ));
                let dataset = LambadaDataset::load_formulation(
                    path,
                    tokenizer,
                    options.seq_length,
                    formulation,
                )?;
                observer.log(&format!(" > found {} samples.", dataset.len()));
                let report = run_lambada(model, &dataset, options, observer)?;
                observer.log(&if formulation == LambadaFormulation::LmEval {
                    report.lm_eval_text()
                } else {
                    report.megatron_text(task)
                });
                results.insert(name.into(), report.json(name));
            }
            Ok(Value::Object(results))
        }
        Task::Wikitext103 => {
            let detokenizer = detokenizer_for_path(&path.to_string_lossy()).unwrap_or_else(|| {
                observer.log(&format!(
                    "note: {} names none of ptb, wiki, lambada (Megatron picks the detokenizer from the path); using WikiText's",
                    path.display()
                ));
                Detokenizer::Wikitext
            });
            let data = WikitextData::load(path, tokenizer, detokenizer)?;
            let dataset = LmDataset::new(
                data.tokens,
                options.seq_length,
                pad,
                data.num_original_tokens,
                options.overlapping_eval,
            );
            observer.log(&format!(
                " > number of original tokens: {}, number of detokenized tokens: {}",
                dataset.num_original_tokens, dataset.num_tokenized_tokens
            ));
            let started = std::time::Instant::now();
            let report = run_wikitext(model, &dataset, options, observer)?;
            let seconds = started.elapsed().as_secs_f64();
            observer.log(&report.megatron_text(task));
            let mut results = report.json(task);
            results["scoring_seconds"] = json!(seconds);
            results["windows_per_second"] = json!(report.num_windows as f64 / seconds);
            Ok(results)
        }
    }
}

fn batches(count: usize, micro_batch_size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..count.div_ceil(micro_batch_size))
        .map(move |b| b * micro_batch_size..((b + 1) * micro_batch_size).min(count))
}

fn log_iteration(iteration: usize, options: &EvalOptions, observer: &mut dyn EvalObserver) {
    if options.log_interval > 0 && iteration % options.log_interval == 0 {
        observer.log(&format!("> working on iteration: {iteration}"));
    }
}

pub fn run_lambada(
    model: &EvalModel,
    dataset: &LambadaDataset,
    options: &EvalOptions,
    observer: &mut dyn EvalObserver,
) -> Result<LambadaReport> {
    let mut report = LambadaReport {
        correct: 0,
        total: dataset.len() as u64,
        target_logprob_sum: 0.0,
    };
    observer.start(
        "examples",
        dataset.len().div_ceil(options.micro_batch_size) as u64,
    );
    for (iteration, range) in batches(dataset.len(), options.micro_batch_size).enumerate() {
        log_iteration(iteration, options, observer);
        let samples: Vec<TaskSample> = range.map(|i| dataset.sample(i)).collect();
        let scores = score_lambada(model.model, &samples)?;
        report.correct += scores.correct.iter().filter(|&&c| c).count() as u64;
        report.target_logprob_sum += scores.target_logprobs.iter().sum::<f64>();
        observer.batch_done();
    }
    Ok(report)
}

pub fn run_wikitext(
    model: &EvalModel,
    dataset: &LmDataset,
    options: &EvalOptions,
    observer: &mut dyn EvalObserver,
) -> Result<WikitextReport> {
    let windows = dataset.len();
    let mut loss_sum = 0.0;
    observer.start("windows", windows.div_ceil(options.micro_batch_size) as u64);
    for (iteration, range) in batches(windows, options.micro_batch_size).enumerate() {
        log_iteration(iteration, options, observer);
        let samples: Vec<TaskSample> = range.map(|i| dataset.sample(i)).collect();
        loss_sum += score_windows(model.model, model.tensor_group, &samples)?;
        observer.batch_done();
    }
    Ok(WikitextReport {
        loss_sum,
        num_tokenized_tokens: dataset.num_tokenized_tokens,
        num_original_tokens: dataset.num_original_tokens,
        num_windows: windows,
    })
}
