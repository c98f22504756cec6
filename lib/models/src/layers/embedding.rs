//! The vocab-parallel word embedding (spec §1.2, §2.1): rank r holds rows `[r·V/t, (r+1)·V/t)`.

use std::sync::Arc;

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use crate::param::{Initializer, MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_parallel::{reduce_from_tensor_parallel_region, Communicator};

#[derive(Clone)]
pub struct VocabParallelEmbedding {
    pub weight: Param,
    vocab_start: i64,
    group: Arc<dyn Communicator>,
}

impl VocabParallelEmbedding {
    /// `init` is scoped to `embedding.word_embeddings`.
    pub fn new(
        init: &Initializer,
        padded_vocab: i64,
        hidden: i64,
        std: f64,
        group: Arc<dyn Communicator>,
    ) -> Self {
        let weight = init.normal_partitioned("weight", &[padded_vocab, hidden], std, 0);
        let vocab_start = group.rank() as i64 * padded_vocab / group.size() as i64;
        VocabParallelEmbedding {
            weight,
            vocab_start,
            group,
        }
    }

    /// The whole table when this rank holds it (no tensor parallelism).
    pub fn whole_table(&self) -> Option<&Tensor> {
        (self.group.size() == 1).then(|| self.weight.tensor())
    }

    /// `[b, s]` ids → `[b, s, h]`. Ids outside this rank's rows look up row 0 and are zeroed;
    /// the sum over ranks then holds every row exactly once.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if self.group.size() == 1 {
            return lookup(&self.weight, ids);
        }
        let rows = self.weight.size()[0];
        let local = ids - self.vocab_start;
        let outside = local.lt(0).logical_or(&local.ge(rows));
        let local = local.masked_fill(&outside, 0);
        let embedded = lookup(&self.weight, &local)?;
        let embedded = embedded.masked_fill(&outside.unsqueeze(-1), 0.0);
        reduce_from_tensor_parallel_region(&embedded, &self.group)
    }
}

/// The rows of `weight` at `ids`. On a GPU, when the optimizer gave the weight a float32
/// main-gradient view (gradient-accumulation fusion), backward adds the rows' gradients straight
/// into it; libtorch's backward writes a dense vocabulary-sized gradient in the weight's dtype,
/// which is then added into the buffer and zeroed (about 1.2 GB of memory traffic a micro-batch
/// for GPT-1.3B's 50,304 × 2,048 table). On a CPU libtorch's accumulating `index_put_` is not
/// deterministic, so the plain lookup stays.
fn lookup(weight: &Param, ids: &Tensor) -> Result<Tensor> {
    let main_grad = match weight.main_grad().get() {
        Some(view) if weight.requires_grad() && view.device().is_cuda() => view,
        _ => return Ok(Tensor::embedding(weight, ids, -1, false, false)),
    };
    let function = EmbeddingIntoMainGrad {
        ids: ids.shallow_clone(),
        main_grad,
    };
    let mut outputs =
        autograd::apply(function, &[weight.tensor()]).context("word embedding lookup")?;
    Ok(outputs.remove(0))
}

struct EmbeddingIntoMainGrad {
    ids: Tensor,
    main_grad: MainGrad,
}

impl CustomFunction for EmbeddingIntoMainGrad {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::embedding(
            &inputs[0], &self.ids, -1, false, false,
        )])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        _saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let grad = &grad_outputs[0];
        let hidden = self.main_grad.size()[1];
        let rows = grad.reshape([-1, hidden]).to_kind(Kind::Float);
        // On a GPU accumulating index_put_ sorts the ids and sums repeated rows in a fixed
        // order (deterministic, unlike index_add_'s atomics).
        let _ = self.main_grad.shallow_clone().f_index_put_(
            &[Some(self.ids.reshape([-1]))],
            &rows,
            true,
        )?;
        self.main_grad.accumulated();
        Ok(vec![None])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// On a GPU, with a main-gradient view, two lookups' gradients (repeated ids included) land
    /// in the float32 buffer and equal what libtorch's embedding backward gives, the weight gets
    /// no autograd gradient, and the same inputs give the same bits twice.
    #[test]
    fn on_a_gpu_lookup_gradients_go_to_the_main_gradient() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        let (vocab, hidden) = (64i64, 16i64);
        let table = (Tensor::arange(vocab * hidden, (Kind::Float, device)) * 0.37)
            .sin()
            .view([vocab, hidden])
            .to_kind(Kind::BFloat16);
        let ids = Tensor::from_slice(&[3i64, 7, 3, 63, 0, 7, 7, 12])
            .view([2, 4])
            .to_device(device);
        let weights = (Tensor::arange(8 * hidden, (Kind::Float, device)) * 0.11)
            .cos()
            .view([2, 4, hidden]);
        let run = || {
            let weight = Param::new(table.copy());
            let main = Tensor::zeros([vocab, hidden], (Kind::Float, device));
            weight.main_grad().set(Some(main.shallow_clone()));
            for _ in 0..2 {
                let out = lookup(&weight, &ids).unwrap();
                (out.to_kind(Kind::Float) * &weights)
                    .sum(Kind::Float)
                    .backward();
            }
            assert!(
                !weight.grad().defined(),
                "the weight got an autograd gradient"
            );
            main
        };
        let (first, second) = (run(), run());
        assert!(first.equal(&second), "not deterministic");
        let plain = table.copy().set_requires_grad(true);
        for _ in 0..2 {
            let out = Tensor::embedding(&plain, &ids, -1, false, false);
            (out.to_kind(Kind::Float) * &weights)
                .sum(Kind::Float)
                .backward();
        }
        let want = plain.grad().to_kind(Kind::Float);
        let error = megatron_kernels::ops::relative_error(&first, &want);
        assert!(error < 1e-2, "gradients differ by {error:.3e}");
    }
}
