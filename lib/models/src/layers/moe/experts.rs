//! The routed experts of this rank, each an MLP of `--moe-ffn-hidden-size`, run over the tokens
//! routed to them: one after the other (Megatron's `SequentialMLP`), or with
//! `--moe-grouped-gemm` as one grouped GEMM per linear over all of them ([`grouped_gemm`]).
//! With expert parallelism a rank holds the experts `first..first + count` of the layer; each
//! keeps its global index in its state name
//! (`experts.local_experts.<global e>.linear_fc1.weight`), so every layout of a model names an
//! expert alike (Megatron's per-rank `torch` files number them from 0 on each rank), and both
//! ways of running them keep the same parameters under the same names. The experts' weights of
//! each linear share one storage ([`expert_stack`](super::expert_stack)), which the grouped
//! GEMMs read without copying.

use anyhow::Result;
use tch::Tensor;

use super::dispatch::TokensPerExpert;
use super::expert_stack::GroupOrder;
use super::grouped_gemm::{self, StackedWeights};
use crate::layers::mlp::Mlp;
use crate::layers::NamedTensors;

#[derive(Clone)]
pub struct RoutedExperts {
    /// The global index of the first local expert.
    pub first: i64,
    pub local_experts: Vec<Mlp>,
    /// `--moe-grouped-gemm`: run the experts as grouped GEMMs where libtorch's kernel takes
    /// their operands.
    pub grouped_gemm: bool,
}

impl RoutedExperts {
    /// Each expert's output over its tokens: `tokens` `[assignments, h]` and their router
    /// probabilities `probs` `[assignments]` grouped expert by expert, `counts` per local
    /// expert. An expert without tokens runs on an empty batch, so that its parameters still
    /// join the graph.
    pub fn forward(
        &self,
        tokens: &Tensor,
        probs: &Tensor,
        counts: &TokensPerExpert,
    ) -> Result<Tensor> {
        let grouped = self.grouped_weights(tokens, false)?;
        self.forward_with(grouped.as_ref(), tokens, probs, counts)
    }

    /// [`forward`](Self::forward) as grouped GEMMs over `grouped` when given (the tokens and
    /// counts grouped in its order), else one expert after the other.
    pub(super) fn forward_with(
        &self,
        grouped: Option<&StackedWeights>,
        tokens: &Tensor,
        probs: &Tensor,
        counts: &TokensPerExpert,
    ) -> Result<Tensor> {
        if let Some(weights) = grouped {
            return grouped_gemm::forward(
                &self.local_experts[0],
                weights,
                tokens,
                probs,
                &counts.ends(),
            );
        }
        let counts = counts.host()?;
        let tokens = tokens.split_with_sizes(counts, 0);
        let probs = probs.split_with_sizes(counts, 0);
        let outputs = self
            .local_experts
            .iter()
            .zip(tokens.iter().zip(&probs))
            .map(|(expert, (tokens, probs))| expert.forward_scaled(tokens, probs))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&outputs, 0))
    }

    /// Whether the experts run as grouped GEMMs over `tokens` (`--moe-grouped-gemm`, where
    /// libtorch's kernel takes them).
    pub fn runs_grouped(&self, tokens: &Tensor) -> bool {
        self.grouped_gemm && grouped_gemm::takes(&self.local_experts, tokens)
    }

    /// In which order the grouped GEMMs take the experts over `tokens` after a sorted
    /// permutation (that of their weights in memory), `None` when the experts run one after
    /// the other.
    pub fn grouped_order(&self, tokens: &Tensor) -> Result<Option<GroupOrder>> {
        Ok(self.grouped_weights(tokens, true)?.map(|w| w.order))
    }

    /// The grouped GEMMs' weights when the experts run so over `tokens`, in the order their
    /// weights lie in memory when `any_order` (else ascending), `None` for the per-expert loop.
    pub(super) fn grouped_weights(
        &self,
        tokens: &Tensor,
        any_order: bool,
    ) -> Result<Option<StackedWeights>> {
        if !self.runs_grouped(tokens) {
            return Ok(None);
        }
        StackedWeights::of(&self.local_experts, any_order).map(Some)
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        let mut local = out.scope("local_experts");
        for (e, expert) in self.local_experts.iter().enumerate() {
            expert.named_tensors(&mut local.scope(&(self.first + e as i64).to_string()));
        }
    }
}
