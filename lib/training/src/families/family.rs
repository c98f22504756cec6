//! The seam a model family plugs into the training engine: its model chunks, its batches, its
//! loss and the losses it reports, its FLOPs and its datasets. Everything else — the loop, the
//! schedules, the optimizer, checkpoints, data loading, logging — is the engine's.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use crate::args::PretrainArgs;
use crate::checkpointing::{load_weights, LoadRequest};
use crate::flops::FlopsModel;
use crate::lr_schedule::SchedulerLoadPolicy;
use megatron_models::loader::{DeviceBatch, Splits};
use megatron_models::{ChunkSpec, FamilyModel, ModelOptions, TransformerConfig};
use megatron_parallel::{ParallelState, ReduceOp};

/// What a chunk's forward step produced.
pub enum StepOutput {
    /// Hidden states for the next pipeline stage.
    Hidden(Tensor),
    /// The last stage's loss of one micro-batch, before the engine divides it by the number of
    /// micro-batches and multiplies it by the loss scale.
    Loss(Tensor),
    /// The last stage's token losses of one micro-batch summed over its `tokens` non-masked
    /// tokens: the engine averages it over those tokens (then as [`Loss`](Self::Loss)), or with
    /// `--calculate-per-token-loss` over the tokens of the whole global batch.
    TokenLoss { sum: Tensor, tokens: Tensor },
}

/// A model family (GPT, BERT, ...) as the engine drives it.
pub trait ModelFamily: Sync {
    type Chunk: FamilyModel;
    type Batch: DeviceBatch;

    /// The transformer trunk (hidden size, layers, vocabulary), for the activations exchanged
    /// between stages, the FLOPs and the summary line.
    fn transformer(&self) -> &TransformerConfig;
    fn build_chunk(
        &self,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<Self::Chunk>;
    /// The losses [`forward_step`](Self::forward_step) accumulates, in log-line order.
    fn loss_names(&self) -> &'static [&'static str];
    /// Runs `chunk` on `batch` (or on `input`, the previous stage's hidden states); on the last
    /// stage adds the reported losses to `losses` and returns the loss to backpropagate.
    fn forward_step(
        &self,
        chunk: &Self::Chunk,
        batch: &Self::Batch,
        input: Option<&Tensor>,
        train: bool,
        losses: &mut LossTotals,
    ) -> Result<StepOutput>;
    /// The non-masked tokens `batch`'s [`StepOutput::TokenLoss`] sums over, counted before any
    /// forward so that `--calculate-per-token-loss` knows the global batch's tokens; `None` for
    /// families whose loss is a per-micro-batch mean.
    fn loss_tokens(&self, _batch: &Self::Batch) -> Option<Tensor> {
        None
    }

    /// Whether the family's forward step splits sequences over the context-parallel group
    /// (`--context-parallel-size`); a family that does not refuses a group of more than one.
    fn context_parallel(&self) -> bool {
        false
    }

    /// The train, validation and test data, sized as Megatron sizes them (samples per split).
    fn build_datasets(&self, args: &PretrainArgs, sizes: [u64; 3]) -> Result<Splits<Self::Batch>>;

    /// Like [`forward_step`](Self::forward_step) without a loss: on the last stage adds the
    /// family's scores (for finetuning: correct answers over examples) to `scores`. Families
    /// that are only trained keep this default.
    fn score_step(
        &self,
        _chunk: &Self::Chunk,
        _batch: &Self::Batch,
        _input: Option<&Tensor>,
        _parallel: &ParallelState,
        _scores: &mut LossTotals,
    ) -> Result<StepOutput> {
        bail!("{} models have no scoring pass", self.model_type())
    }

    /// Loads `--pretrained-checkpoint` into freshly built chunks and returns the checkpoint
    /// directory read. By default the checkpoint must hold this very model (architecture and
    /// model-parallel layout); finetuning families take a pretrained trunk instead.
    fn load_pretrained(
        &self,
        root: &Path,
        chunks: &[Self::Chunk],
        parallel: &ParallelState,
    ) -> Result<PathBuf> {
        let request = LoadRequest {
            root,
            finetune: true,
            load_optimizer: false,
            load_rng: false,
            scheduler_policy: SchedulerLoadPolicy::RequireMatch,
        };
        let found = load_weights(&request, self.model_type(), chunks, parallel)?;
        Ok(found
            .with_context(|| {
                format!(
                    "--pretrained-checkpoint {} holds no checkpoint",
                    root.display()
                )
            })?
            .directory)
    }

    /// Megatron's model type, recorded in checkpoints: the chunk's (`GPT`, `BERT`, `T5`).
    fn model_type(&self) -> &'static str {
        Self::Chunk::MODEL_TYPE
    }

    /// Megatron's FLOPs model of the trunk at `seq_length`.
    fn flops(&self, seq_length: i64) -> FlopsModel {
        let config = self.transformer();
        FlopsModel::of_trunk(config, config.num_layers as u64, seq_length)
    }
}

/// Per reported loss, a sum and a count over the micro-batches this rank saw (non-zero only on
/// the last stage); the reported value is Σ sums / Σ counts over the pipeline and data- and
/// context-parallel group. GPT adds (Σ masked token losses, tokens); a per-micro-batch mean adds (mean, 1).
pub struct LossTotals {
    names: &'static [&'static str],
    sums: Vec<Tensor>,
    counts: Vec<Tensor>,
}

impl LossTotals {
    pub fn new(names: &'static [&'static str], device: Device) -> Self {
        let zeros = || -> Vec<Tensor> {
            names
                .iter()
                .map(|_| Tensor::zeros([], (Kind::Float, device)))
                .collect()
        };
        LossTotals {
            names,
            sums: zeros(),
            counts: zeros(),
        }
    }

    /// Adds `sum` over `count` items to the loss at `index` of the family's names.
    pub fn add(&mut self, index: usize, sum: &Tensor, count: &Tensor) {
        self.sums[index] += sum.detach();
        self.counts[index] += count.detach();
    }

    /// Adds another set of totals of the same losses.
    pub fn absorb(&mut self, other: &LossTotals) {
        for i in 0..self.sums.len() {
            self.sums[i] += &other.sums[i];
            self.counts[i] += &other.counts[i];
        }
    }

    /// Every loss over the whole pipeline and data-parallel group, as Megatron reports them;
    /// every rank gets the values.
    pub fn reduce(&self, parallel: &ParallelState) -> Result<Vec<(&'static str, f64)>> {
        self.start_reduce(parallel)?.values()
    }

    /// Every `(name, sum, count)` over the whole pipeline and data-parallel group; every rank
    /// gets the values.
    pub fn reduce_totals(&self, parallel: &ParallelState) -> Result<Vec<(&'static str, f64, f64)>> {
        self.start_reduce(parallel)?.totals()
    }

    /// Launches the reduction of [`reduce`](Self::reduce) without waiting for the device, so a
    /// training step can queue its optimizer before reading the losses.
    pub fn start_reduce(&self, parallel: &ParallelState) -> Result<ReducedLosses> {
        let parts: Vec<&Tensor> = self
            .sums
            .iter()
            .zip(&self.counts)
            .flat_map(|(s, c)| [s, c])
            .collect();
        let both = Tensor::stack(&parts, 0);
        parallel.pipeline.all_reduce(&both, ReduceOp::Sum)?;
        // Context-parallel ranks each hold part of every sequence's tokens.
        parallel
            .data_with_context
            .all_reduce(&both, ReduceOp::Sum)?;
        Ok(ReducedLosses {
            names: self.names,
            both,
        })
    }
}

/// Loss totals reduced on the device, read when needed.
pub struct ReducedLosses {
    names: &'static [&'static str],
    both: Tensor,
}

impl ReducedLosses {
    /// Each loss as Σ sums / Σ counts.
    pub fn values(self) -> Result<Vec<(&'static str, f64)>> {
        Ok(self
            .totals()?
            .into_iter()
            .map(|(name, sum, count)| (name, sum / count.max(1.0)))
            .collect())
    }

    /// Each loss's `(name, sum, count)`.
    pub fn totals(self) -> Result<Vec<(&'static str, f64, f64)>> {
        let values =
            Vec::<f32>::try_from(&self.both.to_device(Device::Cpu)).context("reading the loss")?;
        Ok(self
            .names
            .iter()
            .enumerate()
            .map(|(i, name)| {
                (
                    *name,
                    f64::from(values[2 * i]),
                    f64::from(values[2 * i + 1]),
                )
            })
            .collect())
    }
}
