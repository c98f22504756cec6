//! The vocab-parallel word embedding (spec §1.2, §2.1): rank r holds rows `[r·V/t, (r+1)·V/t)`.

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use crate::model::param::{Initializer, Param};
use crate::parallel::{reduce_from_tensor_parallel_region, Communicator};

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

    /// `[b, s]` ids → `[b, s, h]`. Ids outside this rank's rows look up row 0 and are zeroed;
    /// the sum over ranks then holds every row exactly once.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if self.group.size() == 1 {
            return Ok(Tensor::embedding(&self.weight, ids, -1, false, false));
        }
        let rows = self.weight.size()[0];
        let local = ids - self.vocab_start;
        let outside = local.lt(0).logical_or(&local.ge(rows));
        let local = local.masked_fill(&outside, 0);
        let embedded = Tensor::embedding(&self.weight, &local, -1, false, false);
        let embedded = embedded.masked_fill(&outside.unsqueeze(-1), 0.0);
        reduce_from_tensor_parallel_region(&embedded, &self.group)
    }
}
