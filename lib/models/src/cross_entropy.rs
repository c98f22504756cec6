//! The language-model loss: cross entropy over the (vocab-parallel) logits, in float32.

use std::sync::Arc;

use anyhow::Result;
use tch::{Kind, Tensor};

use megatron_kernels::autograd::{apply, CustomFunction, SavedTensors};
use megatron_parallel::{Communicator, ReduceOp};

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

impl CustomFunction for VocabParallelCrossEntropy {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let (logits, target) = (&inputs[0], &inputs[1]);
        let local_vocab = *logits
            .size()
            .last()
            .expect("logits have a vocabulary dimension");
        let vocab_start = self.group.rank() as i64 * local_vocab;
        let z = logits.to_kind(Kind::Float);
        let (max, _) = z.max_dim(-1, true);
        self.group.all_reduce(&max, ReduceOp::Max)?;
        let z = z - max;

        let local_target = target - vocab_start;
        let outside = local_target.lt(0).logical_or(&local_target.ge(local_vocab));
        let local_target = local_target.masked_fill(&outside, 0);
        let target_logit = z
            .gather(-1, &local_target.unsqueeze(-1), false)
            .squeeze_dim(-1)
            .masked_fill(&outside, 0.0);
        self.group.all_reduce(&target_logit, ReduceOp::Sum)?;

        let exp = z.exp();
        let sum_exp = exp.sum_dim_intlist(-1, false, Kind::Float);
        self.group.all_reduce(&sum_exp, ReduceOp::Sum)?;
        let loss = sum_exp.log() - target_logit;

        let softmax = exp / sum_exp.unsqueeze(-1);
        saved.save(&softmax);
        saved.save(&local_target);
        saved.save(&outside);
        Ok(vec![loss])
    }

    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (softmax, local_target, outside) = (&saved[0], &saved[1], &saved[2]);
        let inside = outside.logical_not().to_kind(Kind::Float).unsqueeze(-1);
        let one_hot = softmax
            .zeros_like()
            .scatter(-1, &local_target.unsqueeze(-1), &inside);
        let grad = (softmax - one_hot) * grads[0].unsqueeze(-1);
        Ok(vec![Some(grad), None])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_parallel::SingleRank;
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

/// Vocab-parallel logits `[s, b, V/t]` of rank `rank` with the columns past the first `scored`
/// of the vocabulary set to a large negative value (finite, so a rank's maximum stays finite).
pub fn mask_extra_vocabulary(logits: Tensor, scored: i64, rank: usize) -> Tensor {
    let local = *logits
        .size()
        .last()
        .expect("logits have a vocabulary dimension");
    let start = rank as i64 * local;
    let keep = (scored - start).clamp(0, local);
    if keep == local {
        return logits;
    }
    let columns = Tensor::arange(local, (Kind::Int64, logits.device())).ge(keep);
    logits.masked_fill(&columns, -1e30)
}
