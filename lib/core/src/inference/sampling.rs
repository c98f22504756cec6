//! Megatron's sampling of the next token (spec §6.3): `top_k = 1` is greedy; otherwise the
//! logits are divided by the temperature and cut to the top k or to the top-p nucleus (the two
//! are exclusive), and a token is drawn from the softmax.

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    pub temperature: f64,
    /// Keep the k most likely tokens (0: off, 1: greedy).
    pub top_k: i64,
    /// Keep the smallest set of tokens whose probability reaches p (0: off).
    pub top_p: f64,
    /// After each token `top_p ← max(top_p · decay, bound)` (0: off).
    pub top_p_decay: f64,
    pub top_p_bound: f64,
}

impl Sampling {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        Sampling {
            temperature: 1.0,
            top_k: 1,
            top_p: 0.0,
            top_p_decay: 0.0,
            top_p_bound: 0.0,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.top_k > 0 && self.top_p > 0.0 {
            bail!("cannot set both top-k and top-p samplings.");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            bail!("top_p must be less than or equal to 1.0");
        }
        if self.top_k < 0 {
            bail!("top_k must be equal to or greater than 0");
        }
        if self.top_k != 1 && !(self.temperature > 0.0) {
            bail!(
                "temperature must be a positive number, got {}",
                self.temperature
            );
        }
        Ok(())
    }

    /// The settings for the next token: the nucleus shrinks by `top_p_decay`, not below
    /// `top_p_bound`.
    pub fn decayed(self) -> Self {
        if self.top_p > 0.0 && self.top_p_decay > 0.0 {
            Sampling {
                top_p: (self.top_p * self.top_p_decay).max(self.top_p_bound.max(0.0)),
                ..self
            }
        } else {
            self
        }
    }
}

/// One token per row of `logits` (`[b, vocabulary]`), on their device.
pub fn sample(logits: &Tensor, sampling: &Sampling) -> Result<Tensor> {
    if sampling.top_k == 1 {
        return Ok(logits.argmax(-1, false));
    }
    let mut logits = if sampling.temperature != 1.0 {
        // Scaling the distance to the largest logit gives the same distribution. A tiny
        // temperature (1e-300 is 0 in single precision) sends the others to -inf; the largest
        // stays 0 instead of 0 / 0 = NaN, so sampling tends to greedy.
        let shifted = logits - logits.amax([-1i64].as_slice(), true);
        (&shifted / sampling.temperature).masked_fill(&shifted.eq(0.0), 0.0)
    } else {
        logits.shallow_clone()
    };
    let vocabulary = logits.size()[1];
    if sampling.top_k > 1 {
        if sampling.top_k > vocabulary {
            bail!(
                "top_k {} is larger than the vocabulary ({vocabulary})",
                sampling.top_k
            );
        }
        let (kept, _) = logits.topk(sampling.top_k, -1, true, true);
        let threshold = kept.narrow(1, sampling.top_k - 1, 1);
        logits = logits.masked_fill(&logits.lt_tensor(&threshold), f64::NEG_INFINITY);
    } else if sampling.top_p > 0.0 {
        let (sorted, order) = logits.sort(-1, true);
        let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        // Drop a token once the tokens before it already exceed p; the first always stays.
        let exceeded = cumulative.gt(sampling.top_p);
        let drop_sorted = Tensor::cat(
            &[
                exceeded.narrow(1, 0, 1).zeros_like(),
                exceeded.narrow(1, 0, vocabulary - 1),
            ],
            1,
        );
        let drop = drop_sorted.zeros_like().scatter(1, &order, &drop_sorted);
        logits = logits.masked_fill(&drop, f64::NEG_INFINITY);
    }
    Ok(logits
        .softmax(-1, Kind::Float)
        .multinomial(1, false)
        .squeeze_dim(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(top_k: i64, top_p: f64) -> Sampling {
        Sampling {
            top_k,
            top_p,
            ..Sampling::greedy()
        }
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_head_of_the_distribution() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top-k 2 and top-p 0.7 both keep tokens 0 and 1.
        let logits = Tensor::from_slice(&[0.5f32, 0.3, 0.15, 0.05])
            .log()
            .unsqueeze(0)
            .repeat([400, 1]);
        tch::manual_seed(3);
        for sampling in [settings(2, 0.0), settings(0, 0.7)] {
            let picks = Vec::<i64>::try_from(sample(&logits, &sampling).unwrap()).unwrap();
            assert!(picks.iter().all(|&t| t < 2), "{sampling:?}: {picks:?}");
            assert!(picks.contains(&0) && picks.contains(&1));
        }
        let plain = Vec::<i64>::try_from(sample(&logits, &settings(0, 0.0)).unwrap()).unwrap();
        assert!(plain.contains(&3), "plain sampling reaches the tail");
        assert_eq!(
            Vec::<i64>::try_from(sample(&logits.narrow(0, 0, 2), &Sampling::greedy()).unwrap())
                .unwrap(),
            [0, 0]
        );
        assert!(settings(2, 0.5).validate().is_err());
    }

    #[test]
    fn a_tiny_temperature_samples_the_most_likely_token() {
        let logits = Tensor::from_slice(&[1.0f32, 3.0, 2.0, -1.0])
            .unsqueeze(0)
            .repeat([8, 1]);
        for top_k in [0, 2] {
            for top_p in [0.0, 0.5] {
                if top_k > 0 && top_p > 0.0 {
                    continue;
                }
                let sampling = Sampling {
                    temperature: 1e-300,
                    ..settings(top_k, top_p)
                };
                let picks = Vec::<i64>::try_from(sample(&logits, &sampling).unwrap()).unwrap();
                assert_eq!(picks, [1; 8], "{sampling:?}");
            }
        }
    }

    #[test]
    fn top_p_decays_down_to_its_bound() {
        let s = Sampling {
            top_p: 0.9,
            top_p_decay: 0.5,
            top_p_bound: 0.3,
            ..settings(0, 0.9)
        };
        assert_eq!(s.decayed().top_p, 0.45);
        assert_eq!(s.decayed().decayed().top_p, 0.3);
        assert_eq!(settings(0, 0.9).decayed().top_p, 0.9);
    }
}
