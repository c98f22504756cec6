//! Dropless token permutation on one rank: the tokens each expert takes, grouped expert by
//! expert, and their outputs summed back into token order.

use std::cell::OnceCell;

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

use super::expert_stack::GroupOrder;
use super::router::{Assignments, Routing};

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
    /// Groups `tokens` `[t, h]` by the experts `routing` chose for them, the experts in
    /// `order` (descending only for dropless routing); dropless or padded to the expert
    /// capacity, with no wait for the device.
    pub fn new(tokens: &Tensor, routing: &Routing, order: GroupOrder) -> Result<Self> {
        match (&routing.assignments, order) {
            (Assignments::TopK(indices), _) => Self::sorted(tokens, routing, indices, order),
            (_, GroupOrder::Descending) => {
                bail!("only dropless routing groups the experts in descending order")
            }
            (Assignments::Padded(capacity), _) => Self::padded(tokens, routing, *capacity),
            (Assignments::Dropped, _) => Self::of_map(tokens, &routing.probs, &routing.map),
        }
    }

    /// Every token has exactly `topk` assignments, `indices` `[t, topk]`, so the sizes are
    /// known here, and a stable sort of the assignments' experts orders them expert by expert
    /// (in `order`) and, within an expert, in token order.
    fn sorted(
        tokens: &Tensor,
        routing: &Routing,
        indices: &Tensor,
        order: GroupOrder,
    ) -> Result<Self> {
        let (num_tokens, topk) = indices.size2()?;
        let num_experts = routing.map.size()[1];
        let experts = indices.reshape([-1]);
        let keys = match order {
            GroupOrder::Ascending => experts.shallow_clone(),
            GroupOrder::Descending => experts.neg() + (num_experts - 1),
        };
        let sorted = keys.argsort_stable(true, 0, false);
        let token_indices = sorted.floor_divide_scalar(topk);
        let flat = &token_indices * num_experts + experts.index_select(0, &sorted);
        let probs = routing.probs.reshape([-1]).index_select(0, &flat);
        let counts = routing.map.sum_dim_intlist(0, false, Kind::Int64);
        let counts = match order {
            GroupOrder::Ascending => counts,
            GroupOrder::Descending => counts.flip([0]),
        };
        Ok(Permutation {
            tokens: tokens.index_select(0, &token_indices),
            probs,
            tokens_per_expert: TokensPerExpert::on_device(counts),
            token_indices,
            num_tokens,
        })
    }

    /// Every expert has exactly `capacity` tokens in the map: a stable sort of each expert's
    /// column puts its tokens first, in token order.
    fn padded(tokens: &Tensor, routing: &Routing, capacity: i64) -> Result<Self> {
        let (num_tokens, num_experts) = routing.map.size2()?;
        let by_expert = routing
            .map
            .transpose(0, 1)
            .logical_not()
            .to_kind(Kind::Int)
            .argsort_stable(true, 1, false)
            .narrow(1, 0, capacity);
        let token_indices = by_expert.reshape([-1]);
        let experts = Tensor::arange(num_experts, (Kind::Int64, tokens.device()))
            .unsqueeze(1)
            .expand([num_experts, capacity], false)
            .reshape([-1]);
        let flat = &token_indices * num_experts + experts;
        Ok(Permutation {
            tokens: tokens.index_select(0, &token_indices),
            probs: routing.probs.reshape([-1]).index_select(0, &flat),
            tokens_per_expert: TokensPerExpert::on_host(
                vec![capacity; num_experts as usize],
                tokens.device(),
            ),
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
        let probs = logits
            .zeros_like()
            .scatter(1, &indices, &top.softmax(-1, None));
        let map = logits
            .zeros_like()
            .scatter_value(1, &indices, 1.0)
            .to_kind(Kind::Bool);
        let routing = Routing {
            probs: probs.shallow_clone(),
            map: map.shallow_clone(),
            assignments: Assignments::TopK(indices),
        };
        let sorted = Permutation::new(&hidden, &routing, GroupOrder::Ascending).unwrap();
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

    /// In descending order the groups are the ascending ones reversed, each expert's tokens
    /// still in token order, and the outputs come back to the same tokens.
    #[test]
    fn descending_groups_are_the_ascending_ones_reversed() {
        tch::manual_seed(5);
        let (tokens, experts, topk) = (11, 4, 2);
        let hidden = Tensor::randn([tokens, 3], (Kind::Float, Device::Cpu));
        let logits = Tensor::randn([tokens, experts], (Kind::Float, Device::Cpu));
        let (top, indices) = logits.topk(topk, 1, true, true);
        let routing = Routing {
            probs: logits
                .zeros_like()
                .scatter(1, &indices, &top.softmax(-1, None)),
            map: logits
                .zeros_like()
                .scatter_value(1, &indices, 1.0)
                .to_kind(Kind::Bool),
            assignments: Assignments::TopK(indices),
        };
        let up = Permutation::new(&hidden, &routing, GroupOrder::Ascending).unwrap();
        let down = Permutation::new(&hidden, &routing, GroupOrder::Descending).unwrap();
        let up_counts = up.tokens_per_expert.host().unwrap().to_vec();
        let down_counts = down.tokens_per_expert.host().unwrap().to_vec();
        assert_eq!(
            down_counts,
            up_counts.iter().rev().copied().collect::<Vec<_>>()
        );
        let groups = |p: &Permutation, counts: &[i64]| -> Vec<(Tensor, Tensor)> {
            p.token_indices
                .split_with_sizes(counts, 0)
                .into_iter()
                .zip(p.probs.split_with_sizes(counts, 0))
                .collect()
        };
        let mut reversed = groups(&down, &down_counts);
        reversed.reverse();
        for ((a_tokens, a_probs), (b_tokens, b_probs)) in
            groups(&up, &up_counts).iter().zip(&reversed)
        {
            assert!(a_tokens.equal(b_tokens));
            assert!(a_probs.equal(b_probs));
        }
        let scaled = |p: &Permutation| p.unpermute(&(&p.tokens * &p.probs.unsqueeze(1)));
        assert!(scaled(&up).allclose(&scaled(&down), 1e-6, 1e-6, false));
    }

    /// A map padded to the capacity (every expert exactly `capacity` tokens) is permuted by
    /// sorting each expert's column as listing the map's entries does.
    #[test]
    fn a_padded_map_is_sorted_as_it_is_listed() {
        use crate::layers::moe::capacity::{Capacity, DropPolicy};
        tch::manual_seed(4);
        let (tokens, experts, topk) = (10, 4, 2);
        let hidden = Tensor::randn([tokens, 3], (Kind::Float, Device::Cpu));
        let logits = Tensor::randn([tokens, experts], (Kind::Float, Device::Cpu));
        let (top, indices) = logits.topk(topk, 1, true, true);
        let probs = logits
            .zeros_like()
            .scatter(1, &indices, &top.softmax(-1, None));
        let map = probs.gt(0.0);
        let capacity = Capacity {
            factor: 0.8,
            drop_policy: DropPolicy::Position,
            pad_to_capacity: true,
        };
        let (probs, map) = capacity.apply(&probs, &map, topk);
        let per_expert = capacity.per_expert(tokens, topk, experts);
        let routing = Routing {
            probs: probs.shallow_clone(),
            map: map.shallow_clone(),
            assignments: Assignments::Padded(per_expert),
        };
        let sorted = Permutation::new(&hidden, &routing, GroupOrder::Ascending).unwrap();
        let listed = Permutation::of_map(&hidden, &probs, &map).unwrap();
        assert!(sorted.token_indices.equal(&listed.token_indices));
        assert!(sorted.probs.equal(&listed.probs));
        assert_eq!(
            sorted.tokens_per_expert.host().unwrap(),
            listed.tokens_per_expert.host().unwrap()
        );
        assert_eq!(sorted.tokens_per_expert.host().unwrap(), [per_expert; 4]);
    }
}
