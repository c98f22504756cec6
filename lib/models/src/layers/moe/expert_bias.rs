//! DeepSeek-V3's auxiliary-loss-free balancing (`--moe-router-enable-expert-bias`): a
//! per-expert bias added to the router's sigmoid scores for the top-k choice only (the chosen
//! experts' probabilities stay the scores), moved after each step towards the experts that got
//! fewer tokens. Megatron keeps it as the router's float32 buffer `expert_bias`, beside
//! `local_tokens_per_expert`, the tokens routed to each expert since the last update.

use tch::{Device, Kind, Tensor};

pub struct ExpertBias {
    /// `[experts]`, float32.
    pub bias: Tensor,
    /// `[experts]`, float32: the assignments of this rank's micro-batches since the last
    /// [`update`](Self::update).
    pub tokens: Tensor,
    /// `--moe-router-bias-update-rate`.
    pub rate: f64,
}

/// Clones share the tensors, as a recomputed block's copy of the router must.
impl Clone for ExpertBias {
    fn clone(&self) -> Self {
        ExpertBias {
            bias: self.bias.shallow_clone(),
            tokens: self.tokens.shallow_clone(),
            rate: self.rate,
        }
    }
}

impl ExpertBias {
    /// A zero bias for `experts` experts, updated at `rate`.
    pub fn new(experts: i64, rate: f64, device: Device) -> Self {
        ExpertBias {
            bias: Tensor::zeros([experts], (Kind::Float, device)),
            tokens: Tensor::zeros([experts], (Kind::Float, device)),
            rate,
        }
    }

    /// The `k` experts of the highest biased `scores` `[tokens, experts]` for each token.
    pub fn choose(&self, scores: &Tensor, k: i64) -> Tensor {
        let biased = scores.to_kind(Kind::Float) + &self.bias;
        biased.topk(k, 1, true, true).1
    }

    /// Adds a micro-batch's assignments `map` `[tokens, experts]` to the count.
    pub fn count(&self, map: &Tensor) {
        tch::no_grad(|| {
            let mut tokens = self.tokens.shallow_clone();
            tokens += map.sum_dim_intlist(0, false, Kind::Float);
        });
    }

    /// Megatron's update from `tokens` `[experts]`, the step's count summed over the ranks
    /// that route the step's tokens: `rate · sign(mean − count)` added to the bias; the
    /// count starts again from zero.
    pub fn update(&self, tokens: &Tensor) {
        tch::no_grad(|| {
            let offset = tokens.mean(Kind::Float) - tokens;
            let mut bias = self.bias.shallow_clone();
            bias += offset.sign() * self.rate;
            let _ = self.tokens.shallow_clone().zero_();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bias_moves_towards_the_experts_with_fewer_tokens() {
        let bias = ExpertBias::new(4, 1e-3, Device::Cpu);
        let map = Tensor::from_slice(&[1u8, 1, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0])
            .view([3, 4])
            .to_kind(Kind::Bool);
        bias.count(&map);
        bias.count(&map);
        assert_eq!(
            Vec::<f32>::try_from(&bias.tokens).unwrap(),
            [6.0, 2.0, 2.0, 0.0]
        );
        // The mean is 2.5: expert 0 has more, the others fewer.
        bias.update(&bias.tokens.copy());
        assert_eq!(
            Vec::<f32>::try_from(&bias.bias).unwrap(),
            [-1e-3, 1e-3, 1e-3, 1e-3]
        );
        assert_eq!(Vec::<f32>::try_from(&bias.tokens).unwrap(), [0.0; 4]);
        // An expert at the mean keeps its bias.
        bias.update(&Tensor::from_slice(&[1.0f32, 1.0, 1.0, 1.0]));
        assert_eq!(
            Vec::<f32>::try_from(&bias.bias).unwrap(),
            [-1e-3, 1e-3, 1e-3, 1e-3]
        );
        let scores = Tensor::from_slice(&[0.5f32, 0.4995, 0.1, 0.2]).view([1, 4]);
        let chosen = Vec::<i64>::try_from(&bias.choose(&scores, 1).view([-1])).unwrap();
        assert_eq!(chosen, [1]);
    }
}
