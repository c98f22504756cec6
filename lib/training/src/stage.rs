//! One rank's model chunks as a pipeline stage: the family's forward step on a micro-batch, the
//! loss scaled for backward on the last stage, and the float32 gradient accumulation after each
//! backward.

use anyhow::Result;
use tch::Tensor;

use super::schedules::PipelineStage;
use crate::families::{LossTotals, ModelFamily, StepOutput};
use megatron_optim::MixedPrecisionOptimizer;
use megatron_parallel::ParallelState;

/// Megatron divides each micro-batch's loss by the number of micro-batches before backward (or
/// with `--calculate-per-token-loss` divides the summed token losses by the global batch's
/// tokens), and multiplies it by the fp16 loss scale.
pub enum LossScaling {
    /// By the micro-batches the stage runs, times this loss scale.
    Host(f64),
    /// By factors held in device scalars, which a CUDA graph reads at each replay: the inverse
    /// of the step's micro-batches (ATen divides by a host scalar through its float32 inverse
    /// too, so both paths give the same bits) and the loss scale.
    Device {
        inverse_microbatches: Tensor,
        loss_scale: Tensor,
    },
    /// `--calculate-per-token-loss`: a micro-batch's summed token losses times
    /// `per_global_token` (the data-parallel size over the global batch's non-masked tokens:
    /// the data-parallel gradient reduction averages, and the sum over ranks is wanted) and the
    /// loss scale.
    PerToken {
        per_global_token: Tensor,
        loss_scale: f64,
    },
}

impl LossScaling {
    fn apply(&self, loss: Tensor, microbatches: usize) -> Tensor {
        match self {
            LossScaling::Host(scale) => loss / microbatches as f64 * *scale,
            LossScaling::Device {
                inverse_microbatches,
                loss_scale,
            } => loss * inverse_microbatches * loss_scale,
            LossScaling::PerToken {
                per_global_token,
                loss_scale,
            } => loss * per_global_token * *loss_scale,
        }
    }
}

pub struct FamilyStage<'a, F: ModelFamily> {
    pub family: &'a F,
    pub chunks: &'a [F::Chunk],
    pub batches: &'a [F::Batch],
    pub parallel: &'a ParallelState,
    /// Accumulates gradients after every backward; `None` in evaluation.
    pub optimizer: Option<&'a mut MixedPrecisionOptimizer>,
    /// What the loss is multiplied by before backward.
    pub loss_scaling: LossScaling,
    pub totals: LossTotals,
    /// Runs the family's scoring step (forward only) instead of its loss.
    pub scoring: bool,
}

impl<F: ModelFamily> FamilyStage<'_, F> {
    /// A micro-batch's summed token losses over its tokens. Under context parallelism each
    /// rank holds part of the tokens: the count is the group's, and the mean is multiplied by
    /// the group's size because the gradient reduction averages over data × context.
    fn token_mean(&self, sum: &Tensor, tokens: &Tensor) -> Result<Tensor> {
        let context = &self.parallel.context;
        if context.size() == 1 {
            return Ok(sum / tokens.clamp_min(1.0));
        }
        let total = tokens.copy();
        context.all_reduce(&total, megatron_parallel::ReduceOp::Sum)?;
        Ok(sum * context.size() as f64 / total.clamp_min(1.0))
    }
}

impl<F: ModelFamily> PipelineStage for FamilyStage<'_, F> {
    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (chunk, batch) = (&self.chunks[chunk], &self.batches[microbatch]);
        let output = if self.scoring {
            self.family
                .score_step(chunk, batch, input, self.parallel, &mut self.totals)?
        } else {
            let train = self.optimizer.is_some();
            self.family
                .forward_step(chunk, batch, input, train, &mut self.totals)?
        };
        Ok(match output {
            StepOutput::Hidden(hidden) => hidden,
            StepOutput::Loss(loss) => self.loss_scaling.apply(loss, self.batches.len()),
            StepOutput::TokenLoss { sum, tokens } => match &self.loss_scaling {
                LossScaling::PerToken { .. } => self.loss_scaling.apply(sum, 1),
                // Megatron divides each micro-batch's loss by its token count.
                _ => {
                    let mean = self.token_mean(&sum, &tokens)?;
                    self.loss_scaling.apply(mean, self.batches.len())
                }
            },
        })
    }

    fn backward_done(&mut self) -> Result<()> {
        match self.optimizer.as_deref_mut() {
            Some(optimizer) => optimizer.accumulate_grads(),
            None => Ok(()),
        }
    }
}
