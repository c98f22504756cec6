//! Megatron's expert capacity (`--moe-expert-capacity-factor`, `--moe-token-drop-policy`,
//! `--moe-pad-expert-input-to-capacity`): each expert takes at most
//! `ceil(tokens · topk / experts · factor)` of a micro-batch's tokens, the others routed to it
//! are dropped (their output from that expert is zero); with padding every expert takes exactly
//! that many, tokens not routed to it filling its batch with probability zero, so the experts'
//! batch sizes are known without reading the routing.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// `--moe-token-drop-policy`: which of an expert's tokens beyond its capacity are dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropPolicy {
    /// The tokens of the lowest probabilities for the expert.
    Probs,
    /// The tokens at the end of the micro-batch.
    Position,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Capacity {
    /// `--moe-expert-capacity-factor`.
    pub factor: f64,
    pub drop_policy: DropPolicy,
    /// `--moe-pad-expert-input-to-capacity`.
    pub pad_to_capacity: bool,
}

impl Capacity {
    /// The tokens each expert takes of `tokens` routed `topk` ways over `experts` (Megatron's
    /// `get_capacity`), at most all of them.
    pub fn per_expert(&self, tokens: i64, topk: i64, experts: i64) -> i64 {
        let capacity = ((tokens * topk) as f64 / experts as f64 * self.factor).ceil() as i64;
        capacity.clamp(0, tokens)
    }

    /// The routing `probs` and `map` (`[tokens, experts]`) after the capacity: the assignments
    /// each expert keeps, with padding those and the filling tokens (probability zero).
    pub fn apply(&self, probs: &Tensor, map: &Tensor, topk: i64) -> (Tensor, Tensor) {
        let (tokens, experts) = (map.size()[0], map.size()[1]);
        let capacity = self.per_expert(tokens, topk, experts);
        let kept = match self.drop_policy {
            DropPolicy::Probs => {
                // Every expert's `capacity` highest probabilities over the tokens: the routed
                // tokens it keeps and, while it has fewer, tokens of probability zero.
                let (_, rows) = probs.topk(capacity, 0, true, false);
                probs
                    .zeros_like()
                    .scatter_value(0, &rows, 1.0)
                    .to_kind(Kind::Bool)
            }
            DropPolicy::Position => {
                let routed = earliest(
                    map,
                    &Tensor::scalar_tensor(capacity as f64, (Kind::Int64, map.device())),
                );
                if self.pad_to_capacity {
                    let missing = capacity - routed.sum_dim_intlist(0, true, Kind::Int64);
                    routed.logical_or(&earliest(&map.logical_not(), &missing))
                } else {
                    routed
                }
            }
        };
        let map = if self.pad_to_capacity {
            kept
        } else {
            map.logical_and(&kept)
        };
        let probs = probs * map.to_kind(probs.kind());
        (probs, map)
    }
}

/// Of the tokens marked in each column of `marked` `[tokens, experts]` (bool), the first
/// `count` (a scalar or one per column).
fn earliest(marked: &Tensor, count: &Tensor) -> Tensor {
    let rank = marked.cumsum(0, Kind::Int64);
    marked.logical_and(&rank.le_tensor(count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(rows: &[[f32; 3]]) -> (Tensor, Tensor) {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let probs = Tensor::from_slice(&flat).view([rows.len() as i64, 3]);
        let map = probs.gt(0.0);
        (probs, map)
    }

    fn as_rows(map: &Tensor) -> Vec<Vec<bool>> {
        let rows = map.size()[0];
        (0..rows)
            .map(|r| Vec::<bool>::try_from(&map.get(r)).unwrap())
            .collect()
    }

    #[test]
    fn capacity_is_megatrons_ceiling_at_most_the_tokens() {
        let capacity = |factor| Capacity {
            factor,
            drop_policy: DropPolicy::Probs,
            pad_to_capacity: false,
        };
        assert_eq!(capacity(1.0).per_expert(10, 2, 4), 5);
        assert_eq!(capacity(1.1).per_expert(10, 2, 4), 6);
        assert_eq!(capacity(0.5).per_expert(9, 1, 4), 2);
        assert_eq!(capacity(8.0).per_expert(10, 2, 4), 10);
    }

    /// Four tokens top-1 over three experts at factor 1.5: each expert keeps 2. Expert 0 is
    /// chosen by three tokens; "probs" drops its lowest, "position" its last; padding fills
    /// the experts with fewer (expert 2 has one, expert 1 none) with the earliest others.
    #[test]
    fn drop_policies_and_padding() {
        let (probs, map) = routing(&[
            [0.5, 0.0, 0.0],
            [0.9, 0.0, 0.0],
            [0.0, 0.0, 0.7],
            [0.8, 0.0, 0.0],
        ]);
        let apply = |drop_policy, pad_to_capacity| {
            let capacity = Capacity {
                factor: 1.5,
                drop_policy,
                pad_to_capacity,
            };
            capacity.apply(&probs, &map, 1)
        };
        let (by_probs, kept) = apply(DropPolicy::Probs, false);
        assert_eq!(
            as_rows(&kept),
            [
                [false, false, false],
                [true, false, false],
                [false, false, true],
                [true, false, false]
            ]
        );
        assert_eq!(by_probs.get(0).get(0).double_value(&[]), 0.0);
        assert_eq!(by_probs.get(3).get(0).double_value(&[]), 0.8f32 as f64);
        let (_, kept) = apply(DropPolicy::Position, false);
        assert_eq!(
            as_rows(&kept),
            [
                [true, false, false],
                [true, false, false],
                [false, false, true],
                [false, false, false]
            ]
        );
        for policy in [DropPolicy::Probs, DropPolicy::Position] {
            let (padded_probs, padded) = apply(policy, true);
            let per_expert =
                Vec::<i64>::try_from(&padded.sum_dim_intlist(0, false, Kind::Int64)).unwrap();
            assert_eq!(per_expert, [2, 2, 2]);
            let (dropped_probs, _) = apply(policy, false);
            assert!(padded_probs.equal(&dropped_probs));
        }
        let (_, padded) = apply(DropPolicy::Position, true);
        assert_eq!(
            as_rows(&padded),
            [
                [true, true, true],
                [true, true, false],
                [false, false, true],
                [false, false, false]
            ]
        );
    }
}
