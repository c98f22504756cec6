//! One rank's model chunks as a pipeline stage: the family's forward step on a micro-batch, the
//! loss scaled for backward on the last stage, and the float32 gradient accumulation after each
//! backward.

use anyhow::Result;
use tch::Tensor;

use super::family::{LossTotals, ModelFamily, StepOutput};
use super::schedules::PipelineStage;
use crate::optim::MixedPrecisionOptimizer;
use crate::parallel::ParallelState;

pub struct FamilyStage<'a, F: ModelFamily> {
    pub family: &'a F,
    pub chunks: &'a [F::Chunk],
    pub batches: &'a [F::Batch],
    pub parallel: &'a ParallelState,
    /// Accumulates gradients after every backward; `None` in evaluation.
    pub optimizer: Option<&'a mut MixedPrecisionOptimizer>,
    /// The fp16 loss scale the loss is multiplied by before backward.
    pub loss_scale: f64,
    pub totals: LossTotals,
    /// Runs the family's scoring step (forward only) instead of its loss.
    pub scoring: bool,
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
            // Megatron divides each micro-batch's loss by the number of micro-batches before
            // backward.
            StepOutput::Loss(loss) => loss / self.batches.len() as f64 * self.loss_scale,
        })
    }

    fn backward_done(&mut self) -> Result<()> {
        match self.optimizer.as_deref_mut() {
            Some(optimizer) => optimizer.accumulate_grads(),
            None => Ok(()),
        }
    }
}
