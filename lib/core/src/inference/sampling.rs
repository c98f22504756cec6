//! Autoregressive sampling: greedy, temperature, top-k and top-p (Megatron's text-generation
//! semantics: top-k and top-p exclusive, logits of padded vocabulary rows never sampled).

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use crate::model::{AttentionMask, GptModel};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// `true`: always the most likely token.
    pub greedy: bool,
    pub temperature: f64,
    /// Keep the k most likely tokens (0: off).
    pub top_k: i64,
    /// Keep the smallest set of tokens whose probability reaches p (0: off).
    pub top_p: f64,
}

impl Sampling {
    pub fn validate(&self) -> Result<()> {
        if self.top_k > 0 && self.top_p > 0.0 {
            bail!("top-k and top-p sampling are exclusive");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            bail!("top-p must be in [0, 1], got {}", self.top_p);
        }
        if !self.greedy && self.temperature <= 0.0 {
            bail!("temperature must be positive, got {}", self.temperature);
        }
        Ok(())
    }
}

/// Extends `prompt` by up to `tokens_to_generate` tokens, stopping after `stop_token`; the
/// context is cut to the model's maximum length from the left. Uses the default generator of
/// the model's device (seed it for reproducible samples).
pub fn generate(
    model: &GptModel,
    prompt: &[i64],
    tokens_to_generate: usize,
    sampling: Sampling,
    stop_token: Option<i64>,
) -> Result<Vec<i64>> {
    sampling.validate()?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let device = model.options().device;
    let true_vocab = model.config.vocab_size;
    let window = model.config.max_position_embeddings as usize;
    let mut tokens = prompt.to_vec();
    tch::no_grad(|| -> Result<()> {
        for _ in 0..tokens_to_generate {
            let context = &tokens[tokens.len().saturating_sub(window)..];
            let input = Tensor::from_slice(context).to_device(device).unsqueeze(0);
            let positions =
                Tensor::arange(context.len() as i64, (Kind::Int64, device)).unsqueeze(0);
            let logits = model.forward_full_logits(&input, &positions, &AttentionMask::Causal)?;
            let last = logits
                .get(-1)
                .get(0)
                .narrow(0, 0, true_vocab)
                .to_kind(Kind::Float);
            let next = pick(&last, sampling);
            tokens.push(next);
            if Some(next) == stop_token {
                break;
            }
        }
        Ok(())
    })?;
    Ok(tokens)
}

fn pick(logits: &Tensor, sampling: Sampling) -> i64 {
    if sampling.greedy {
        return logits.argmax(0, false).int64_value(&[]);
    }
    let mut logits = logits / sampling.temperature;
    if sampling.top_k > 0 {
        let k = sampling.top_k.min(logits.size()[0]);
        let (kept, _) = logits.topk(k, 0, true, true);
        let threshold = kept.get(k - 1);
        logits = logits.masked_fill(&logits.lt_tensor(&threshold), f64::NEG_INFINITY);
    } else if sampling.top_p > 0.0 {
        let (sorted, order) = logits.sort(0, true);
        let cumulative = sorted.softmax(0, Kind::Float).cumsum(0, Kind::Float);
        // Drop a token once the tokens before it already reach p; the first always stays.
        let drop_sorted = (cumulative - sorted.softmax(0, Kind::Float)).gt(sampling.top_p);
        let drop = drop_sorted.zeros_like().scatter(0, &order, &drop_sorted);
        logits = logits.masked_fill(&drop, f64::NEG_INFINITY);
    }
    logits
        .softmax(0, Kind::Float)
        .to_device(Device::Cpu)
        .multinomial(1, false)
        .int64_value(&[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_and_top_p_keep_only_the_head_of_the_distribution() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top-k 2 and top-p 0.7 both keep tokens 0 and 1.
        let logits = Tensor::from_slice(&[0.5f32, 0.3, 0.15, 0.05]).log();
        tch::manual_seed(3);
        for sampling in [
            Sampling {
                greedy: false,
                temperature: 1.0,
                top_k: 2,
                top_p: 0.0,
            },
            Sampling {
                greedy: false,
                temperature: 1.0,
                top_k: 0,
                top_p: 0.7,
            },
        ] {
            let picks: Vec<i64> = (0..200).map(|_| pick(&logits, sampling)).collect();
            assert!(picks.iter().all(|&t| t < 2), "{sampling:?}: {picks:?}");
            assert!(picks.contains(&0) && picks.contains(&1));
        }
        let greedy = Sampling {
            greedy: true,
            temperature: 1.0,
            top_k: 0,
            top_p: 0.0,
        };
        assert_eq!(pick(&logits, greedy), 0);
        assert!(Sampling {
            greedy: false,
            temperature: 1.0,
            top_k: 2,
            top_p: 0.5
        }
        .validate()
        .is_err());
    }
}
