//! The language-model loss: cross entropy over the (vocab-parallel) logits, in float32.

use std::sync::Arc;

use anyhow::Result;
use tch::{Kind, Tensor};

use crate::autograd::{apply, CustomFunction, SavedTensors};
use crate::parallel::{Communicator, ReduceOp};

/// Per-token loss `[b, s]` (float32) from logits `[s, b, V/t]` and labels `[b, s]`.
pub fn cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        // One fused log-softmax pass; the float32 result is what Megatron's upcast computes.
        let log_probs = logits.log_softmax(-1, Kind::Float);
        let target = labels.transpose(0, 1).unsqueeze(-1);
        return Ok(log_probs
            .gather(-1, &target, false)
            .squeeze_dim(-1)
            .neg()
            .transpose(0, 1));
    }
    vocab_parallel_cross_entropy(logits, labels, group)
}

/// Megatron's vocab-parallel cross entropy (spec §2.3): each rank holds a slice of the
/// vocabulary; the max, the target logit and the partition function are reduced across ranks.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    labels: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let target = labels.transpose(0, 1).contiguous();
    let loss = apply(
        VocabParallelCrossEntropy {
            group: group.clone(),
        },
        &[logits, &target],
    )?
    .remove(0);
    Ok(loss.transpose(0, 1))
}

struct VocabParallelCrossEntropy {
    group: Arc<dyn Communicator>,
}

/// The softmax of one token block's logits over the vocabulary split across `group`, with each
/// token's loss: what the vocab-parallel cross entropy and its chunked fusion with the output
/// layer share.
pub(crate) struct VocabSoftmax {
    /// Per-token loss `logsumexp(z) - z[target]`, float32.
    pub loss: Tensor,
    /// This rank's slice of the softmax, float32.
    pub softmax: Tensor,
    /// Each target's index in this rank's slice (0 where it lies on another rank).
    pub local_target: Tensor,
    /// Whether the target lies on another rank.
    pub outside: Tensor,
}

impl VocabSoftmax {
    /// Megatron's vocab-parallel softmax (spec §2.3): the max, the target logit and the
    /// partition function are reduced across ranks.
    pub fn new(logits: &Tensor, target: &Tensor, group: &Arc<dyn Communicator>) -> Result<Self> {
        let local_vocab = *logits
            .size()
            .last()
            .expect("logits have a vocabulary dimension");
        let vocab_start = group.rank() as i64 * local_vocab;
        let z = logits.to_kind(Kind::Float);
        let (max, _) = z.max_dim(-1, true);
        group.all_reduce(&max, ReduceOp::Max)?;
        // A new buffer (`z` may be `logits` itself), exponentiated and normalised in place.
        let mut z = z - max;

        let local_target = target - vocab_start;
        let outside = local_target.lt(0).logical_or(&local_target.ge(local_vocab));
        let local_target = local_target.masked_fill(&outside, 0);
        let target_logit = z
            .gather(-1, &local_target.unsqueeze(-1), false)
            .squeeze_dim(-1)
            .masked_fill(&outside, 0.0);
        group.all_reduce(&target_logit, ReduceOp::Sum)?;

        let exp = z.exp_();
        let sum_exp = exp.sum_dim_intlist(-1, false, Kind::Float);
        group.all_reduce(&sum_exp, ReduceOp::Sum)?;
        let loss = sum_exp.log() - target_logit;
        let mut softmax = exp;
        let _ = softmax.divide_(&sum_exp.unsqueeze(-1));
        Ok(VocabSoftmax {
            loss,
            softmax,
            local_target,
            outside,
        })
    }

    /// `softmax - one_hot(target)`: the gradient of the loss with respect to the logits,
    /// written over the softmax.
    pub fn into_logit_grad(self) -> Tensor {
        let mut grad = self.softmax;
        subtract_one_hot(&mut grad, &self.local_target, &self.outside);
        grad
    }
}

/// Subtracts 1 from each row's target entry of `probs` (none where the target lies on
/// another rank), in place.
fn subtract_one_hot(probs: &mut Tensor, local_target: &Tensor, outside: &Tensor) {
    let minus_inside = outside.to_kind(Kind::Float).unsqueeze(-1) - 1.0;
    let _ = probs.scatter_add_(-1, &local_target.unsqueeze(-1), &minus_inside);
}

impl CustomFunction for VocabParallelCrossEntropy {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let (logits, target) = (&inputs[0], &inputs[1]);
        let softmax = VocabSoftmax::new(logits, target, &self.group)?;
        saved.save(&softmax.softmax);
        saved.save(&softmax.local_target);
        saved.save(&softmax.outside);
        Ok(vec![softmax.loss])
    }

    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (softmax, local_target, outside) = (&saved[0], &saved[1], &saved[2]);
        let mut grad = softmax.copy();
        subtract_one_hot(&mut grad, local_target, outside);
        Ok(vec![Some(grad * grads[0].unsqueeze(-1)), None])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::SingleRank;
    use tch::Device;

    #[test]
    fn vocab_parallel_path_equals_log_softmax_in_value_and_gradient() {
        tch::manual_seed(7);
        let group: Arc<dyn Communicator> = Arc::new(SingleRank);
        let logits = Tensor::randn([3, 2, 11], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let labels = Tensor::from_slice(&[0i64, 5, 10, 3, 3, 7]).view([2, 3]);
        let weights = Tensor::randn([2, 3], (Kind::Float, Device::Cpu));

        let fast = cross_entropy(&logits, &labels, &group).unwrap();
        let fast_grad = Tensor::run_backward(
            &[(&fast * &weights).sum(Kind::Float)],
            &[&logits],
            false,
            false,
        )
        .remove(0);
        let parallel = vocab_parallel_cross_entropy(&logits, &labels, &group).unwrap();
        let parallel_grad = Tensor::run_backward(
            &[(&parallel * &weights).sum(Kind::Float)],
            &[&logits],
            false,
            false,
        )
        .remove(0);

        // Reference by definition: logsumexp(z) - z[label].
        let z = logits.detach().to_kind(Kind::Float).transpose(0, 1);
        let reference =
            z.logsumexp([-1], false) - z.gather(-1, &labels.unsqueeze(-1), false).squeeze_dim(-1);
        assert!(fast.allclose(&reference, 1e-5, 1e-6, false));
        assert!(parallel.allclose(&reference, 1e-5, 1e-6, false));
        assert!(fast_grad.allclose(&parallel_grad, 1e-5, 1e-6, false));
    }
}
