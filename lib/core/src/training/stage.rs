//! One rank's GPT chunks as a pipeline stage: forward of a micro-batch through a chunk, the
//! loss on the last stage, and the float32 gradient accumulation after each backward.

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use super::schedules::PipelineStage;
use crate::loader::GptBatch;
use crate::model::{cross_entropy, ChunkInput, GptModel};
use crate::optim::MixedPrecisionOptimizer;
use crate::parallel::{ParallelState, ReduceOp};

/// Σ masked token losses and Σ loss tokens over the micro-batches this rank saw (non-zero
/// only on the last stage).
pub struct LossTotals {
    pub loss: Tensor,
    pub tokens: Tensor,
}

impl LossTotals {
    pub fn new(device: tch::Device) -> Self {
        LossTotals {
            loss: Tensor::zeros([], (Kind::Float, device)),
            tokens: Tensor::zeros([], (Kind::Float, device)),
        }
    }

    /// `Σ loss / Σ tokens` over the whole pipeline and data-parallel group, as Megatron reports
    /// `lm loss`; every rank gets the value.
    pub fn reduce(&self, parallel: &ParallelState) -> Result<f64> {
        let both = Tensor::stack(&[&self.loss, &self.tokens], 0);
        parallel.pipeline.all_reduce(&both, ReduceOp::Sum)?;
        parallel.data.all_reduce(&both, ReduceOp::Sum)?;
        let values =
            Vec::<f32>::try_from(&both.to_device(tch::Device::Cpu)).context("reading the loss")?;
        Ok(f64::from(values[0]) / f64::from(values[1]).max(1.0))
    }
}

pub struct GptStage<'a> {
    pub chunks: &'a [GptModel],
    pub batches: &'a [GptBatch],
    pub parallel: &'a ParallelState,
    /// Accumulates gradients after every backward; `None` in evaluation.
    pub optimizer: Option<&'a mut MixedPrecisionOptimizer>,
    /// The fp16 loss scale the loss is multiplied by before backward.
    pub loss_scale: f64,
    pub totals: LossTotals,
}

impl PipelineStage for GptStage<'_> {
    fn forward(
        &mut self,
        chunk: usize,
        microbatch: usize,
        input: Option<&Tensor>,
    ) -> Result<Tensor> {
        let model = &self.chunks[chunk];
        let batch = &self.batches[microbatch];
        let train = self.optimizer.is_some();
        let input = match input {
            Some(hidden) => ChunkInput::Hidden(hidden),
            None => ChunkInput::Tokens {
                tokens: &batch.tokens,
                position_ids: &batch.position_ids,
            },
        };
        let output = model.forward_chunk(input, &batch.mask(), train)?;
        if !model.spec.post_process {
            return Ok(output);
        }
        let losses = cross_entropy(&output, &batch.labels, &self.parallel.tensor)?;
        let masked_sum = (losses * &batch.loss_mask).sum(Kind::Float);
        let tokens = batch.num_tokens();
        self.totals.loss += masked_sum.detach();
        self.totals.tokens += &tokens;
        // Megatron divides each micro-batch's loss by its token count and by the number of
        // micro-batches before backward.
        Ok(masked_sum / tokens.clamp_min(1.0) / self.batches.len() as f64 * self.loss_scale)
    }

    fn backward_done(&mut self) -> Result<()> {
        match self.optimizer.as_deref_mut() {
            Some(optimizer) => optimizer.accumulate_grads(),
            None => Ok(()),
        }
    }
}
