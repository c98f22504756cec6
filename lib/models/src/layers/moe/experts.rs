//! The routed experts, each an MLP of `--moe-ffn-hidden-size` run over the tokens routed to it
//! in turn (Megatron's `SequentialMLP`, whose state names they keep:
//! `experts.local_experts.<e>.linear_fc1.weight`).

use anyhow::Result;
use tch::Tensor;

use super::dispatch::Permutation;
use crate::layers::mlp::Mlp;
use crate::layers::NamedTensors;

#[derive(Clone)]
pub struct SequentialExperts {
    pub local_experts: Vec<Mlp>,
}

impl SequentialExperts {
    /// Each expert's output over its tokens, in the permutation's order; an expert without
    /// tokens runs on an empty batch, so that its parameters still join the graph.
    pub fn forward(&self, permutation: &Permutation) -> Result<Tensor> {
        let counts = &permutation.tokens_per_expert;
        let tokens = permutation.tokens.split_with_sizes(counts, 0);
        let probs = permutation.probs.split_with_sizes(counts, 0);
        let outputs = self
            .local_experts
            .iter()
            .zip(tokens.iter().zip(&probs))
            .map(|(expert, (tokens, probs))| expert.forward_scaled(tokens, probs))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outputs, 0))
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        let mut local = out.scope("local_experts");
        for (e, expert) in self.local_experts.iter().enumerate() {
            expert.named_tensors(&mut local.scope(&e.to_string()));
        }
    }
}
