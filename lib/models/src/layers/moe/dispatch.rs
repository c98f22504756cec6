//! Dropless token permutation on one rank: the tokens each expert takes, grouped expert by
//! expert, and their outputs summed back into token order.

use anyhow::Result;
use tch::{Kind, Tensor};

use super::router::Routing;

/// The tokens of a micro-batch regrouped by expert.
pub struct Permutation {
    /// `[assignments]`: the token of each (expert, token) assignment, expert by expert.
    token_indices: Tensor,
    /// `[assignments, h]`: those tokens' hidden states.
    pub tokens: Tensor,
    /// `[assignments]`: the router's probability of each assignment.
    pub probs: Tensor,
    /// How many assignments each expert has (zero allowed).
    pub tokens_per_expert: Vec<i64>,
    num_tokens: i64,
}

impl Permutation {
    /// Groups `tokens` `[t, h]` by the experts `routing` chose for them.
    pub fn new(tokens: &Tensor, routing: &Routing) -> Result<Self> {
        // nonzero lists the [expert, token] pairs of the transposed map in row-major order,
        // i.e. expert by expert and, within an expert, in token order.
        let pairs = routing.map.transpose(0, 1).nonzero();
        let experts = pairs.select(1, 0);
        let token_indices = pairs.select(1, 1);
        let probs = routing
            .probs
            .transpose(0, 1)
            .index(&[Some(&experts), Some(&token_indices)]);
        let counts = routing.map.sum_dim_intlist(0, false, Kind::Int64);
        Ok(Permutation {
            tokens: tokens.index_select(0, &token_indices),
            probs,
            tokens_per_expert: Vec::<i64>::try_from(&counts)?,
            token_indices,
            num_tokens: tokens.size()[0],
        })
    }

    /// Sums the experts' outputs `[assignments, h]` (in this permutation's order) back into
    /// token order, `[t, h]`.
    pub fn unpermute(&self, outputs: &Tensor) -> Tensor {
        let h = outputs.size()[1];
        Tensor::zeros([self.num_tokens, h], (outputs.kind(), outputs.device())).index_add(
            0,
            &self.token_indices,
            outputs,
        )
    }
}
