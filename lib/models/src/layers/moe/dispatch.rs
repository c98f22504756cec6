//! Dropless token permutation on one rank: the tokens each expert takes, grouped expert by
//! expert, and their outputs summed back into token order.

use std::cell::OnceCell;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::router::Routing;

/// How many assignments each expert has (zero allowed): counted on the device, read to the
/// host only by what needs host numbers (the per-expert loop, the all-to-all's splits), since
/// reading waits for the device.
pub struct TokensPerExpert {
    /// `[experts]`, int64, on the tokens' device.
    counts: Tensor,
    host: OnceCell<Vec<i64>>,
}

impl TokensPerExpert {
    /// Counts kept on the device.
    pub fn on_device(counts: Tensor) -> Self {
        TokensPerExpert {
            counts: counts.to_kind(Kind::Int64),
            host: OnceCell::new(),
        }
    }

    /// Counts known on the host, copied to `device` for who wants them there.
    pub fn on_host(counts: Vec<i64>, device: tch::Device) -> Self {
        TokensPerExpert {
            counts: Tensor::from_slice(&counts).to_device(device),
            host: OnceCell::from(counts),
        }
    }

    /// The counts on the host (the first call waits for the device).
    pub fn host(&self) -> Result<&[i64]> {
        if let Some(counts) = self.host.get() {
            return Ok(counts);
        }
        let counts = Vec::<i64>::try_from(&self.counts)?;
        Ok(self.host.get_or_init(|| counts))
    }

    /// `[experts]`, int32 on the device: where each expert's rows end (the offsets libtorch's
    /// grouped GEMM takes).
    pub fn ends(&self) -> Tensor {
        self.counts.cumsum(0, Kind::Int)
    }
}

/// The tokens of a micro-batch regrouped by expert.
pub struct Permutation {
    /// `[assignments]`: the token of each (expert, token) assignment, expert by expert.
    token_indices: Tensor,
    /// `[assignments, h]`: those tokens' hidden states.
    pub tokens: Tensor,
    /// `[assignments]`: the router's probability of each assignment.
    pub probs: Tensor,
    pub tokens_per_expert: TokensPerExpert,
    num_tokens: i64,
}

impl Permutation {
    /// Groups `tokens` `[t, h]` by the experts `routing` chose for them, with no wait for the
    /// device: every token has exactly `topk` assignments, so the sizes are known here, and a
    /// stable sort of the assignments' experts orders them expert by expert and, within an
    /// expert, in token order.
    pub fn new(tokens: &Tensor, routing: &Routing) -> Result<Self> {
        let (num_tokens, topk) = routing.indices.size2()?;
        let experts = routing.indices.reshape([-1]);
        let order = experts.argsort_stable(true, 0, false);
        let token_indices = order.floor_divide_scalar(topk);
        let num_experts = routing.map.size()[1];
        let flat = &token_indices * num_experts + experts.index_select(0, &order);
        let probs = routing.probs.reshape([-1]).index_select(0, &flat);
        let counts = routing.map.sum_dim_intlist(0, false, Kind::Int64);
        Ok(Permutation {
            tokens: tokens.index_select(0, &token_indices),
            probs,
            tokens_per_expert: TokensPerExpert::on_device(counts),
            token_indices,
            num_tokens,
        })
    }

    /// Groups `tokens` `[t, h]` by the experts marked in `map` `[t, experts]` (any number per
    /// token, none allowed) with their probabilities `probs` `[t, experts]`; the number of
    /// assignments is read from the device.
    pub fn of_map(tokens: &Tensor, probs: &Tensor, map: &Tensor) -> Result<Self> {
        // nonzero lists the [expert, token] pairs of the transposed map in row-major order,
        // i.e. expert by expert and, within an expert, in token order.
        let pairs = map.transpose(0, 1).nonzero();
        let experts = pairs.select(1, 0);
        let token_indices = pairs.select(1, 1);
        let probs = probs
            .transpose(0, 1)
            .index(&[Some(&experts), Some(&token_indices)]);
        let counts = map.sum_dim_intlist(0, false, Kind::Int64);
        Ok(Permutation {
            tokens: tokens.index_select(0, &token_indices),
            probs,
            tokens_per_expert: TokensPerExpert::on_device(counts),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    /// The sort of the chosen experts gives the permutation of the map's nonzero entries:
    /// the same rows in the same order, the same probabilities and counts.
    #[test]
    fn sorting_the_chosen_experts_equals_listing_the_map() {
        tch::manual_seed(3);
        let (tokens, experts, topk) = (9, 5, 2);
        let hidden = Tensor::randn([tokens, 4], (Kind::Float, Device::Cpu));
        let logits = Tensor::randn([tokens, experts], (Kind::Float, Device::Cpu));
        let (top, indices) = logits.topk(topk, 1, true, true);
        let probs = logits.zeros_like().scatter(1, &indices, &top.softmax(-1, None));
        let map = logits
            .zeros_like()
            .scatter_value(1, &indices, 1.0)
            .to_kind(Kind::Bool);
        let routing = Routing {
            probs: probs.shallow_clone(),
            map: map.shallow_clone(),
            indices,
        };
        let sorted = Permutation::new(&hidden, &routing).unwrap();
        let listed = Permutation::of_map(&hidden, &probs, &map).unwrap();
        assert!(sorted.token_indices.equal(&listed.token_indices));
        assert!(sorted.tokens.equal(&listed.tokens));
        assert!(sorted.probs.equal(&listed.probs));
        let counts = sorted.tokens_per_expert.host().unwrap().to_vec();
        assert_eq!(counts, listed.tokens_per_expert.host().unwrap());
        assert_eq!(counts.iter().sum::<i64>(), tokens * topk);
        let ends = Vec::<i32>::try_from(&sorted.tokens_per_expert.ends()).unwrap();
        let expected: Vec<i32> = counts
            .iter()
            .scan(0, |end, &count| {
                *end += count as i32;
                Some(*end)
            })
            .collect();
        assert_eq!(ends, expected);
        let outputs = sorted.tokens.shallow_clone() * 2.0;
        let back = sorted.unpermute(&outputs);
        assert!(back.allclose(&(&hidden * 2.0 * topk as f64), 1e-6, 1e-6, false));
    }
}
