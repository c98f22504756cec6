//! BERT finetuning on the training engine (`eval_tasks --task RACE|MNLI|QQP`, spec §7.4–7.6):
//! the BERT trunk with a classification or multiple-choice head, the cross entropy over classes
//! (or over a question's choices) reported as `lm loss`, correct answers as its score, the
//! task's examples as its datasets, and a pretrained BERT's trunk as its starting point.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Reduction, Tensor};

use super::family::{LossTotals, ModelFamily, StepOutput};
use crate::args::PretrainArgs;
use crate::checkpointing::config_differences;
use megatron_models::bert::{
    BertChunkOutput, BertConfig, BertInput, BertModel, CycledExamples, EpochOrder, TaskBatch,
    TaskExample,
};
use megatron_models::chunk::join_names;
use megatron_models::loader::{SampleSource, Splits};
use megatron_models::{ChunkSpec, FamilyModel, ModelOptions, TransformerConfig};
use megatron_parallel::ParallelState;
use megatron_store::{find_checkpoint, merge_model_parallel_ranks, split_for_tensor_parallel};

pub struct FinetuneFamily {
    /// A BERT with a task head.
    pub config: BertConfig,
    /// The training examples, read in a fresh order every epoch.
    pub train: Arc<Vec<TaskExample>>,
    /// Every validation example, for the validation loss.
    pub valid: Arc<Vec<TaskExample>>,
    pub epochs: u64,
}

const LOSS: &[&str] = &["lm loss"];

/// Tensors a starting checkpoint may have and a finetuning model drops when it has no such
/// parameter: the pretraining heads, and another task's head (a model finetuned on MNLI starting
/// RACE).
fn other_head(name: &str) -> bool {
    [
        "lm_head.",
        "output_layer.",
        "binary_head.",
        "classification_head.",
        "multichoice_head.",
    ]
    .iter()
    .any(|prefix| name.starts_with(prefix))
}

/// What a finetuning chunk produced.
enum TaskForward {
    /// The task head's logits as `[examples, classes or choices]`.
    Logits(Tensor),
    /// Hidden states for the next pipeline stage.
    Hidden(Tensor),
}

impl FinetuneFamily {
    fn run(
        &self,
        chunk: &BertModel,
        batch: &TaskBatch,
        input: Option<&Tensor>,
        train: bool,
    ) -> Result<TaskForward> {
        let input = match input {
            Some(hidden) => BertInput::Hidden(hidden),
            None => BertInput::Tokens {
                tokens: &batch.tokens,
                tokentypes: Some(&batch.types),
            },
        };
        Ok(
            match chunk.forward_chunk(input, &batch.padding_mask, train)? {
                BertChunkOutput::Hidden(hidden) => TaskForward::Hidden(hidden),
                BertChunkOutput::Task(logits) => TaskForward::Logits(
                    logits
                        .to_kind(Kind::Float)
                        .view([batch.labels.size()[0], -1]),
                ),
                BertChunkOutput::Heads(_) => bail!("finetuning needs a BERT with a task head"),
            },
        )
    }

    /// Copies a pretrained BERT's trunk into `chunk`: every trunk tensor must be there with its
    /// shape; the pretraining heads and other tasks' heads are dropped; the pooler and
    /// token-type embeddings (absent from checkpoints trained with `--bert-no-binary-head`) and
    /// the task head (unless the checkpoint has one of the same shape) keep their
    /// initialisation. Returns the names left at initialisation.
    fn load_trunk(
        &self,
        chunk: &BertModel,
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Vec<String>> {
        let head = self
            .config
            .task_head
            .context("finetuning needs a task head")?
            .tensor_prefix();
        let parameters = chunk.named_parameters();
        let may_start_fresh = |name: &str| {
            name.starts_with("pooler.")
                || name.starts_with(head)
                || name == "embedding.tokentype_embeddings.weight"
        };
        let mut unexpected: Vec<&String> = tensors
            .keys()
            .filter(|k| !other_head(k) && !parameters.iter().any(|p| &p.name == *k))
            .collect();
        if !unexpected.is_empty() {
            unexpected.sort();
            bail!(
                "tensors that are not part of a BERT trunk: {}",
                join_names(&unexpected)
            );
        }
        let missing: Vec<&String> = parameters
            .iter()
            .map(|p| &p.name)
            .filter(|n| !tensors.contains_key(*n) && !may_start_fresh(n))
            .collect();
        if !missing.is_empty() {
            bail!(
                "missing tensors of the BERT trunk: {}",
                join_names(&missing)
            );
        }
        let mut fresh = Vec::new();
        tch::no_grad(|| -> Result<()> {
            for parameter in &parameters {
                let name = &parameter.name;
                let source = match tensors.get(name) {
                    // Another classification task's head has another number of classes.
                    Some(source)
                        if name.starts_with(head) && source.size() != parameter.tensor.size() =>
                    {
                        None
                    }
                    found => found,
                };
                let Some(source) = source else {
                    fresh.push(name.clone());
                    continue;
                };
                ensure!(
                    source.size() == parameter.tensor.size(),
                    "tensor {name}: shape {:?} in the checkpoint but the model expects {:?}",
                    source.size(),
                    parameter.tensor.size()
                );
                parameter.tensor.shallow_clone().copy_(source);
            }
            Ok(())
        })?;
        Ok(fresh)
    }
}

impl ModelFamily for FinetuneFamily {
    type Chunk = BertModel;
    type Batch = TaskBatch;

    fn transformer(&self) -> &TransformerConfig {
        &self.config.transformer
    }

    fn build_chunk(
        &self,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<BertModel> {
        BertModel::new_chunk(self.config.clone(), options, parallel, spec)
    }

    fn loss_names(&self) -> &'static [&'static str] {
        LOSS
    }

    /// Cross entropy over the classes (or a question's choices), the mean over the
    /// micro-batch, reported as `lm loss` like Megatron's finetuning.
    fn forward_step(
        &self,
        chunk: &BertModel,
        batch: &TaskBatch,
        input: Option<&Tensor>,
        train: bool,
        losses: &mut LossTotals,
    ) -> Result<StepOutput> {
        let logits = match self.run(chunk, batch, input, train)? {
            TaskForward::Logits(logits) => logits,
            TaskForward::Hidden(hidden) => return Ok(StepOutput::Hidden(hidden)),
        };
        let loss =
            logits.cross_entropy_loss::<&Tensor>(&batch.labels, None, Reduction::Mean, -100, 0.0);
        losses.add(0, &loss, &Tensor::ones([], (Kind::Float, loss.device())));
        Ok(StepOutput::Loss(loss))
    }

    /// Correct answers (the argmax is the label) over examples.
    fn score_step(
        &self,
        chunk: &BertModel,
        batch: &TaskBatch,
        input: Option<&Tensor>,
        _parallel: &ParallelState,
        scores: &mut LossTotals,
    ) -> Result<StepOutput> {
        let logits = match self.run(chunk, batch, input, false)? {
            TaskForward::Logits(logits) => logits,
            TaskForward::Hidden(hidden) => return Ok(StepOutput::Hidden(hidden)),
        };
        let correct = logits
            .argmax(-1, false)
            .eq_tensor(&batch.labels)
            .sum(Kind::Float);
        let examples = Tensor::from(logits.size()[0] as f32).to_device(logits.device());
        scores.add(0, &correct, &examples);
        // A forward-only schedule backpropagates nothing: the returned value is not used.
        Ok(StepOutput::Loss(correct))
    }

    fn build_datasets(&self, args: &PretrainArgs, sizes: [u64; 3]) -> Result<Splits<TaskBatch>> {
        let train = (sizes[0] > 0 && !self.train.is_empty()).then(|| {
            Arc::new(EpochOrder::new(
                self.train.clone(),
                sizes[0] / self.epochs.max(1),
                self.epochs,
                args.training.seed,
            )) as Arc<dyn SampleSource<Batch = TaskBatch>>
        });
        let valid = (sizes[1] > 0 && !self.valid.is_empty()).then(|| {
            Arc::new(CycledExamples {
                examples: self.valid.clone(),
                len: sizes[1],
            }) as Arc<dyn SampleSource<Batch = TaskBatch>>
        });
        Ok(Splits {
            train,
            valid,
            test: None,
        })
    }

    /// A `pretrain_bert` checkpoint of any tensor- and pipeline-parallel layout: its ranks
    /// merged, cut for this rank, and its trunk loaded (see [`FinetuneFamily::load_trunk`]).
    fn load_pretrained(
        &self,
        root: &Path,
        chunks: &[BertModel],
        parallel: &ParallelState,
    ) -> Result<PathBuf> {
        let found = find_checkpoint(root)?.with_context(|| {
            format!(
                "--pretrained-checkpoint {} holds no checkpoint",
                root.display()
            )
        })?;
        let directory = found.directory.clone();
        let model_type = &found.metadata.model_type;
        ensure!(
            model_type == BertModel::MODEL_TYPE,
            "--pretrained-checkpoint {} holds a {model_type} model; finetuning starts from a BERT (pretrain_bert)",
            directory.display()
        );
        let saved: TransformerConfig = serde_json::from_value(found.metadata.model.clone())
            .with_context(|| format!("{}: model metadata", directory.display()))?;
        let (saved_json, ours_json) = (
            serde_json::to_value(&saved)?,
            serde_json::to_value(&self.config.transformer)?,
        );
        if saved_json != ours_json {
            bail!(
                "--pretrained-checkpoint {} has a different BERT trunk: {}",
                directory.display(),
                config_differences(&saved_json, &ours_json)
            );
        }
        let [chunk] = chunks else {
            bail!("finetuning runs without pipeline parallelism");
        };
        let merged = merge_model_parallel_ranks(&found, Device::Cpu)?;
        let (rank, size) = (
            parallel.tensor_parallel_rank(),
            parallel.tensor_parallel_size(),
        );
        let tensors = if size > 1 {
            split_for_tensor_parallel(&merged, &self.config.transformer, rank, size)
        } else {
            merged
        };
        let fresh = self
            .load_trunk(chunk, &tensors)
            .with_context(|| format!("loading {}", directory.display()))?;
        if parallel.rank == 0 && !fresh.is_empty() {
            let fresh: Vec<&String> = fresh.iter().collect();
            println!(
                "> not in the pretrained checkpoint, freshly initialised: {}",
                join_names(&fresh)
            );
        }
        Ok(directory)
    }
}
