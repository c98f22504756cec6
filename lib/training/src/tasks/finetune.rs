//! BERT finetuning tasks (`eval_tasks --task RACE|MNLI|QQP`, spec §7.4–7.6): the task's files
//! read into examples, the finetuning family trained on the engine for `--epochs` passes, and
//! after every epoch (or once with `--epochs 0`) the accuracy on every `--valid-data` set in
//! Megatron's lines.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use megatron_data::tasks::{
    read_glue_tsv, read_race_dir, ClassificationSample, GlueTask, PairSpecials,
};
use megatron_data::tokenizer::{build_tokenizer, BertWordPiece};
use serde_json::{json, Value};

use super::EvalObserver;
use crate::args::{FinetuneArgs, PretrainArgs, TokenizerArgs};
use crate::{train_with_hooks, FinetuneFamily, Scorer, TrainingHooks, TrainingSummary};
use megatron_models::bert::{BertModel, TaskExample, TaskExamples, TaskHead};
use megatron_models::FamilyModel;
use megatron_parallel::Placement;
use megatron_store::find_checkpoint;

/// A finetuning `--task`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinetuneTask {
    /// Multiple choice over 4 options (spec §7.4).
    Race,
    /// Classification of sentence pairs (spec §7.5).
    Glue(GlueTask),
}

impl FinetuneTask {
    /// The finetuning task named `name`, if it is one.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "RACE" => Some(FinetuneTask::Race),
            "MNLI" => Some(FinetuneTask::Glue(GlueTask::Mnli)),
            "QQP" => Some(FinetuneTask::Glue(GlueTask::Qqp)),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FinetuneTask::Race => "RACE",
            FinetuneTask::Glue(task) => task.name(),
        }
    }

    fn head(self) -> TaskHead {
        match self {
            FinetuneTask::Race => TaskHead::MultipleChoice,
            FinetuneTask::Glue(task) => TaskHead::Classification {
                num_classes: task.num_classes() as i64,
            },
        }
    }

    /// Megatron's name of a data set in its accuracy lines: the path after the last occurrence
    /// of the task's name, without `/` around it; GLUE also drops `.tsv` and writes `_` as `-`,
    /// RACE writes `/` as `-` (`RACE/dev/middle` → `dev-middle`, `MNLI/dev_matched.tsv` →
    /// `dev-matched`). Megatron strips the characters of `.tsv` from both ends instead, which
    /// turns `QQP/dev.tsv` into `de`; here it is `dev`.
    pub fn dataset_name(self, path: &Path) -> String {
        let text = path.to_string_lossy();
        let after = text
            .rsplit_once(self.name())
            .map_or(&*text, |(_, after)| after);
        match self {
            FinetuneTask::Race => after.trim_matches('/').replace('/', "-"),
            FinetuneTask::Glue(_) => {
                let name = after.trim_matches('/');
                name.strip_suffix(".tsv").unwrap_or(name).replace('_', "-")
            }
        }
    }

    /// The examples of one `--train-data` or `--valid-data` path.
    fn read(
        self,
        path: &Path,
        tokenizer: &BertWordPiece,
        specials: PairSpecials,
        seq_length: usize,
        observer: &mut dyn EvalObserver,
    ) -> Result<Vec<TaskExample>> {
        let examples: Vec<TaskExample> = match self {
            FinetuneTask::Race => read_race_dir(path, tokenizer, specials, seq_length)?
                .into_iter()
                .map(|sample| TaskExample {
                    choices: sample.choices,
                    label: sample.label as i64,
                })
                .collect(),
            FinetuneTask::Glue(task) => {
                let file = read_glue_tsv(task, path)?;
                for warning in &file.skipped {
                    observer.log(&format!("***WARNING*** {warning}"));
                }
                file.rows
                    .iter()
                    .map(|row| {
                        let sample =
                            ClassificationSample::build(row, tokenizer, specials, seq_length)
                                .with_context(|| format!("{}: row {}", path.display(), row.uid))?;
                        Ok(TaskExample {
                            choices: vec![sample.input],
                            label: sample.label as i64,
                        })
                    })
                    .collect::<Result<_>>()?
            }
        };
        ensure!(
            !examples.is_empty(),
            "{}: no {} examples",
            path.display(),
            self.name()
        );
        observer.log(&format!(
            " > {}: {} examples from {}",
            self.name(),
            examples.len(),
            path.display()
        ));
        Ok(examples)
    }
}

/// Correct answers of one data set.
#[derive(Debug, Clone, PartialEq)]
pub struct SetAccuracy {
    pub name: String,
    pub correct: u64,
    pub total: u64,
}

/// The accuracies after one epoch (`-1`: `--epochs 0`, Megatron's evaluation-only mode).
#[derive(Debug, Clone, PartialEq)]
pub struct EpochAccuracy {
    pub epoch: i64,
    pub sets: Vec<SetAccuracy>,
}

impl EpochAccuracy {
    pub fn overall(&self) -> (u64, u64) {
        self.sets
            .iter()
            .fold((0, 0), |(c, t), s| (c + s.correct, t + s.total))
    }
}

fn percent(correct: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        correct as f64 * 100.0 / total as f64
    }
}

/// How a finetuning run ended.
pub struct FinetuneSummary {
    pub task: FinetuneTask,
    pub epochs: u64,
    pub training: TrainingSummary,
    pub accuracies: Vec<EpochAccuracy>,
}

impl FinetuneSummary {
    /// `eval_tasks: MNLI, 3 epochs, 75 iterations, lm loss X, accuracy Y % (c/t) after epoch
    /// 2, checkpoint C, T s (exit reason)`.
    pub fn line(&self) -> String {
        let t = &self.training;
        let loss = t
            .last_lm_loss
            .map_or("-".to_string(), |loss| format!("{loss:.4}"));
        let accuracy = self.accuracies.last().map_or("-".to_string(), |last| {
            let (correct, total) = last.overall();
            format!(
                "{:.4} % ({correct}/{total}) after epoch {}",
                percent(correct, total),
                last.epoch
            )
        });
        let checkpoint = t
            .last_checkpoint
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string());
        format!(
            "eval_tasks: {}, {} epochs, {} iterations, lm loss {loss}, accuracy {accuracy}, checkpoint {checkpoint}, {:.1} s ({})",
            self.task.name(),
            self.epochs,
            t.iterations,
            t.seconds,
            t.exit_reason
        )
    }

    pub fn json(&self) -> Value {
        let epochs: Vec<Value> = self
            .accuracies
            .iter()
            .map(|epoch| {
                let (correct, total) = epoch.overall();
                let sets: Vec<Value> = epoch
                    .sets
                    .iter()
                    .map(|s| {
                        json!({"name": s.name, "correct": s.correct, "total": s.total,
                               "accuracy": percent(s.correct, s.total)})
                    })
                    .collect();
                json!({"epoch": epoch.epoch, "sets": sets,
                       "overall": {"correct": correct, "total": total, "accuracy": percent(correct, total)}})
            })
            .collect();
        json!({
            "task": self.task.name(),
            "iterations": self.training.iterations,
            "lm_loss": self.training.last_lm_loss,
            "epochs": epochs,
        })
    }
}

/// Saves and scores at the end of every epoch, as Megatron's `end_of_epoch_callback`.
struct EpochEnd<'a> {
    sets: Vec<(String, TaskExamples)>,
    iterations_per_epoch: u64,
    /// Examples per forward when scoring (`--eval-micro-batch-size`, else the training one).
    eval_micro_batch_size: Option<u64>,
    observer: &'a mut dyn EvalObserver,
    accuracies: Vec<EpochAccuracy>,
}

const CORRECT: &[&str] = &["correct"];

impl EpochEnd<'_> {
    fn score(&mut self, model: &Scorer<'_, FinetuneFamily>, epoch: i64) -> Result<()> {
        if self.sets.is_empty() {
            return Ok(());
        }
        let observer = &mut *self.observer;
        observer.log("calculating metrics ...");
        let mut result = EpochAccuracy {
            epoch,
            sets: Vec::new(),
        };
        for (name, examples) in &self.sets {
            let started = Instant::now();
            let micro = self
                .eval_micro_batch_size
                .unwrap_or_else(|| model.micro_batch_size());
            observer.start(name, model.batches(examples.0.len() as u64, micro));
            let totals = model.score(examples, CORRECT, micro, &mut || observer.batch_done())?;
            observer.finish();
            let (correct, total) = (totals[0].0.round() as u64, totals[0].1.round() as u64);
            observer.log(&format!(
                " > |epoch: {epoch}| metrics for {name}: correct / total = {correct} / {total} = {:.4} %, elapsed time (sec): {:.3}",
                percent(correct, total),
                started.elapsed().as_secs_f64()
            ));
            result.sets.push(SetAccuracy {
                name: name.clone(),
                correct,
                total,
            });
        }
        let (correct, total) = result.overall();
        observer.log(&format!(
            " >> |epoch: {epoch}| overall: correct / total = {correct} / {total} = {:.4} %",
            percent(correct, total)
        ));
        self.accuracies.push(result);
        Ok(())
    }
}

impl TrainingHooks<FinetuneFamily> for EpochEnd<'_> {
    fn save_after(&self, iteration: u64) -> bool {
        iteration.is_multiple_of(self.iterations_per_epoch)
    }

    fn after_iteration(
        &mut self,
        iteration: u64,
        model: &Scorer<'_, FinetuneFamily>,
    ) -> Result<()> {
        if iteration.is_multiple_of(self.iterations_per_epoch) {
            self.score(model, (iteration / self.iterations_per_epoch) as i64 - 1)?;
        }
        Ok(())
    }

    fn without_training(&mut self, model: &Scorer<'_, FinetuneFamily>) -> Result<()> {
        self.observer
            .log("evaluation only mode, setting epoch to -1");
        self.score(model, -1)
    }
}

/// The WordPiece tokenizer of `--tokenizer-type`/`--vocab-file`, as Megatron's tasks tokenize
/// (no `[CLS]`/`[SEP]` around each text), and its special ids.
fn wordpiece(flags: &TokenizerArgs, task: FinetuneTask) -> Result<(BertWordPiece, PairSpecials)> {
    let lower_case = match flags.tokenizer_type.as_str() {
        "BertWordPieceLowerCase" => true,
        "BertWordPieceCase" => false,
        other => bail!(
            "--tokenizer-type {other}: {} needs BertWordPieceLowerCase or BertWordPieceCase",
            task.name()
        ),
    };
    let vocab = flags
        .vocab_file
        .as_ref()
        .context("give the BERT vocabulary with --vocab-file")?;
    let tokenizer = BertWordPiece::from_file(vocab, lower_case, false)?;
    let specials = PairSpecials::from_bert(&tokenizer)
        .with_context(|| format!("--vocab-file {}", vocab.display()))?;
    Ok((tokenizer, specials))
}

/// The engine's flags for `iterations` iterations of `global_batch_size` examples; none is
/// Megatron's evaluation-only mode (`--epochs 0`): the weights of `--load` or
/// `--pretrained-checkpoint`, scored once, nothing trained or restored besides them.
fn set_run_length(common: &mut PretrainArgs, iterations: u64, global_batch_size: u64) {
    let training = &mut common.training;
    training.global_batch_size = Some(global_batch_size);
    training.train_samples = None;
    if iterations > 0 {
        training.train_iters = Some(iterations);
    } else {
        training.train_iters = None;
        training.skip_train = true;
        training.eval_iters = 0;
        common.checkpoint.finetune = true;
    }
}

/// `--load` resumes a finetuning run; a `pretrain_bert` checkpoint there (no task head) is the
/// common mistake for `--pretrained-checkpoint`.
fn refuse_pretraining_checkpoint(load: &Path) -> Result<()> {
    if let Some(found) = find_checkpoint(load)? {
        let metadata = &found.metadata;
        if metadata.model_type == BertModel::MODEL_TYPE && metadata.model.get("task_head").is_none()
        {
            bail!(
                "--load {}: {} holds a pretrained BERT without a task head; start from it with --pretrained-checkpoint (--load resumes a finetuning run)",
                load.display(),
                found.directory.display()
            );
        }
    }
    Ok(())
}

/// Megatron's `tasks/main.py --task RACE|MNLI|QQP` on this rank of the job.
pub fn finetune(
    args: &FinetuneArgs,
    placement: &Placement,
    observer: &mut dyn EvalObserver,
) -> Result<FinetuneSummary> {
    let task = FinetuneTask::parse(&args.task.task)
        .with_context(|| format!("--task {:?}: expected RACE, MNLI or QQP", args.task.task))?;
    let epochs = args
        .task
        .epochs
        .context("give --epochs N (the passes over --train-data; 0 only scores --valid-data)")?;
    let mut common = args.model.common.clone();
    ensure!(
        common.parallel.pipeline_model_parallel_size == 1,
        "finetuning runs without pipeline parallelism (--pipeline-model-parallel-size 1)"
    );
    ensure!(
        common.training.rampup_batch_size.is_none()
            && common.training.step_batch_size_schedule.is_none(),
        "finetuning allows no --rampup-batch-size or --step-batch-size-schedule (as Megatron's)"
    );
    let micro_batch_size = common.training.micro_batch_size;
    let global_batch_size = micro_batch_size * placement.parallel.data_parallel_size() as u64;
    if let Some(given) = common.training.global_batch_size {
        ensure!(
            given == global_batch_size,
            "finetuning has no gradient accumulation: --global-batch-size must be --micro-batch-size × data-parallel size = {global_batch_size}, got {given}"
        );
    }
    let (tokenizer, specials) = wordpiece(&common.tokenizer, task)?;
    let seq_length = usize::try_from(common.model.seq_length).context("--seq-length")?;

    let mut train = Vec::new();
    if epochs > 0 {
        ensure!(
            !args.task.train_data.is_empty(),
            "give the training data with --train-data (or --epochs 0 to only score --valid-data)"
        );
        for path in &args.task.train_data {
            train.extend(task.read(path, &tokenizer, specials, seq_length, observer)?);
        }
    }
    let mut sets = Vec::new();
    let mut valid = Vec::new();
    for path in &args.task.valid_data {
        let examples = task.read(path, &tokenizer, specials, seq_length, observer)?;
        valid.extend(examples.iter().cloned());
        sets.push((task.dataset_name(path), TaskExamples(Arc::new(examples))));
    }

    let samples = train.len() as u64;
    let iterations_per_epoch = if args.task.keep_last {
        samples.div_ceil(global_batch_size)
    } else {
        samples / global_batch_size
    };
    if epochs > 0 {
        ensure!(
            iterations_per_epoch > 0,
            "the training data has {samples} examples, less than one global batch of {global_batch_size} (--micro-batch-size × data-parallel size); pass --keep-last or a smaller --micro-batch-size"
        );
    }
    if common.training.train_iters.is_some() || common.training.train_samples.is_some() {
        observer.log("note: --train-iters and --train-samples are ignored: finetuning trains --epochs passes over --train-data");
    }
    set_run_length(
        &mut common,
        epochs * iterations_per_epoch,
        global_batch_size,
    );

    if let Some(load) = &common.checkpoint.load {
        refuse_pretraining_checkpoint(load)?;
    }
    // The vocabulary as pretrain_bert sizes it, so its checkpoints fit.
    let vocab_size = build_tokenizer(&common.tokenizer.config()?)?.vocab_size();
    let mut config = args.model.bert_config(vocab_size as i64)?;
    config.binary_head = false;
    config.task_head = Some(task.head());
    let family = FinetuneFamily {
        config,
        train: Arc::new(train),
        valid: Arc::new(valid),
        epochs,
    };
    let mut hooks = EpochEnd {
        sets,
        iterations_per_epoch: iterations_per_epoch.max(1),
        eval_micro_batch_size: args.task.eval_micro_batch_size,
        observer,
        accuracies: Vec::new(),
    };
    let training = train_with_hooks(
        &common,
        serde_json::to_value(args)?,
        &family,
        placement,
        &mut hooks,
    )?;
    Ok(FinetuneSummary {
        task,
        epochs,
        training,
        accuracies: hooks.accuracies,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_sets_are_named_as_megatron_names_them() {
        let name = |task: &str, path: &str| {
            FinetuneTask::parse(task)
                .unwrap()
                .dataset_name(Path::new(path))
        };
        assert_eq!(name("MNLI", "data/MNLI/dev_matched.tsv"), "dev-matched");
        assert_eq!(name("MNLI", "/x/MNLI/dev_mismatched.tsv"), "dev-mismatched");
        assert_eq!(name("QQP", "glue/QQP/dev.tsv"), "dev");
        assert_eq!(name("RACE", "RACE/dev/middle"), "dev-middle");
        assert_eq!(name("RACE", "/data/RACE/test/high/"), "test-high");
    }
}
