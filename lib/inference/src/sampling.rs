//! Megatron's sampling of the next token (spec §6.3): `top_k = 1` is greedy; otherwise the
//! logits are divided by the temperature and cut to the top k or to the top-p nucleus (the two
//! are exclusive), and a token is drawn from the softmax.

use anyhow::{bail, Result};
use tch::{Kind, Tensor};

use megatron_kernels::runtime::to_device_async;

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

/// OpenAI's adjustments of a row's logits before it draws: `logit_bias` added to the logits
/// of its tokens, and for every token generated so far (`c` times) `c · frequency_penalty +
/// presence_penalty` taken from its logit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitAdjust {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `(token, bias)`, each token once.
    pub bias: Vec<(i64, f32)>,
}

impl LogitAdjust {
    /// Whether it changes nothing.
    pub fn is_none(&self) -> bool {
        self.presence_penalty == 0.0 && self.frequency_penalty == 0.0 && self.bias.is_empty()
    }

    /// Whether what it adds depends on the tokens generated.
    pub fn penalises(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// What to add to the logits after `generated`: `(token, amount)`, each token once.
    pub fn deltas(&self, generated: &[i64]) -> Vec<(i64, f32)> {
        let mut deltas: std::collections::BTreeMap<i64, f32> = self.bias.iter().copied().collect();
        if self.penalises() {
            let mut counts = std::collections::BTreeMap::<i64, u32>::new();
            for &token in generated {
                *counts.entry(token).or_default() += 1;
            }
            for (token, count) in counts {
                *deltas.entry(token).or_default() -=
                    count as f32 * self.frequency_penalty + self.presence_penalty;
            }
        }
        deltas.into_iter().collect()
    }
}

/// How one row of a batch draws its tokens: its settings and its own random stream, so what it
/// draws does not depend on the rows beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowSampling {
    pub sampling: Sampling,
    /// The row's stream: its `n`-th token is drawn from noise keyed by `(seed, n)`.
    pub seed: u64,
    /// Tokens the row has drawn so far.
    pub draws: u64,
}

/// One token per row of `logits` (`[b, vocabulary]`, any float dtype; sampled in float32)
/// under each row's settings, on their device. A row draws by the Gumbel-max trick: the argmax of its scaled, cut logits
/// plus Gumbel noise made from counter-based hashes of `(seed, draws, token)` — the same
/// distribution as drawing from the softmax, reproducible row by row on any device.
pub fn sample(logits: &Tensor, rows: &[RowSampling]) -> Result<Tensor> {
    let (batch, vocabulary) = logits.size2()?;
    anyhow::ensure!(
        rows.len() as i64 == batch,
        "{} sampling settings for {batch} rows",
        rows.len()
    );
    let greedy_choice = megatron_kernels::ops::argmax::greedy(logits)?;
    if rows.iter().all(|r| r.sampling.top_k == 1) {
        return Ok(greedy_choice);
    }
    let logits = &logits.to_kind(Kind::Float);
    for row in rows {
        if row.sampling.top_k > vocabulary {
            bail!(
                "top_k {} is larger than the vocabulary ({vocabulary})",
                row.sampling.top_k
            );
        }
    }
    let device = logits.device();
    // Every row's settings go to the device in two copies (floats, integers) instead of one
    // per setting.
    let temperatures = rows.iter().map(|r| {
        if r.sampling.top_k == 1 {
            1.0
        } else {
            r.sampling.temperature
        }
    });
    // Rows without a nucleus never exceed a bound above 1.
    let nuclei = rows.iter().map(|r| {
        if r.sampling.top_p > 0.0 {
            r.sampling.top_p
        } else {
            2.0
        }
    });
    let floats: Vec<f64> = temperatures.chain(nuclei).collect();
    // Queued copies: a decode step may still run ahead of them.
    let floats = to_device_async(&Tensor::from_slice(&floats).to_kind(Kind::Float), device)?;
    let ints: Vec<i64> = rows
        .iter()
        .map(|r| (r.sampling.top_k.max(1) - 1).min(vocabulary - 1))
        .chain(rows.iter().map(|r| i64::from(r.sampling.top_k > 1)))
        .chain(rows.iter().map(|r| r.seed as i64))
        .chain(rows.iter().map(|r| r.draws as i64))
        .chain(rows.iter().map(|r| i64::from(r.sampling.top_k == 1)))
        .collect();
    let ints = to_device_async(&Tensor::from_slice(&ints), device)?;
    let column = |values: &Tensor, k: i64| values.narrow(0, k * batch, batch).view([batch, 1]);
    let temperature = column(&floats, 0);
    // Scaling the distance to the largest logit gives the same distribution. A tiny
    // temperature (1e-300 is 0 in single precision) sends the others to -inf; the largest
    // stays 0 instead of 0 / 0 = NaN, so sampling tends to greedy.
    let shifted = logits - logits.amax([-1i64].as_slice(), true);
    let mut scaled = (&shifted / &temperature).masked_fill(&shifted.eq(0.0), 0.0);
    if rows.iter().any(|r| r.sampling.top_k > 1) {
        let (sorted, _) = scaled.sort(-1, true);
        let k = column(&ints, 0);
        let cut = column(&ints, 1).ne(0);
        let threshold = sorted.gather(1, &k, false);
        let below = scaled.lt_tensor(&threshold).logical_and(&cut);
        scaled = scaled.masked_fill(&below, f64::NEG_INFINITY);
    }
    if rows.iter().any(|r| r.sampling.top_p > 0.0) {
        let (sorted, order) = scaled.sort(-1, true);
        let cumulative = sorted.softmax(-1, Kind::Float).cumsum(-1, Kind::Float);
        let p = column(&floats, 1);
        // Drop a token once the tokens before it already exceed p; the first always stays.
        let exceeded = cumulative.gt_tensor(&p);
        let drop_sorted = Tensor::cat(
            &[
                exceeded.narrow(1, 0, 1).zeros_like(),
                exceeded.narrow(1, 0, vocabulary - 1),
            ],
            1,
        );
        let drop = drop_sorted.zeros_like().scatter(1, &order, &drop_sorted);
        scaled = scaled.masked_fill(&drop, f64::NEG_INFINITY);
    }
    let noise = gumbel_noise(&column(&ints, 2), &column(&ints, 3), vocabulary);
    let drawn = (scaled + noise).argmax(-1, false);
    let greedy = column(&ints, 4).view([batch]).ne(0);
    Ok(greedy_choice.where_self(&greedy, &drawn))
}

/// The random stream of row `row` of a request seeded with `seed`.
pub fn row_seed(seed: u64, row: usize) -> u64 {
    let mut z = seed ^ (row as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `[b, vocabulary]` standard Gumbel noise, row `i` keyed by `(seeds[i], draws[i])` (`[b, 1]`
/// int64 on the device): each entry a SplitMix64 hash of its key and column turned into a
/// uniform number in (0, 1).
fn gumbel_noise(seeds: &Tensor, draws: &Tensor, vocabulary: i64) -> Tensor {
    let device = seeds.device();
    // Wrapping 64-bit arithmetic in int64; a logical right shift is an arithmetic one masked.
    let shift = |x: &Tensor, bits: i64| {
        x.bitwise_right_shift_tensor_scalar(bits)
            .bitwise_and((1i64 << (64 - bits)) - 1)
    };
    let mix = |x: Tensor| {
        let x = x.bitwise_xor_tensor(&shift(&x, 30)) * (0xBF58_476D_1CE4_E5B9u64 as i64);
        let x = x.bitwise_xor_tensor(&shift(&x, 27)) * (0x94D0_49BB_1331_11EBu64 as i64);
        x.bitwise_xor_tensor(&shift(&x, 31))
    };
    const GOLDEN: i64 = 0x9E37_79B9_7F4A_7C15u64 as i64;
    let key = mix(mix(seeds + GOLDEN) + draws * GOLDEN);
    let tokens = Tensor::arange(vocabulary, (Kind::Int64, device)).view([1, vocabulary]);
    let bits = shift(&mix(key + (tokens + 1) * GOLDEN), 11);
    let uniform = (bits.to_kind(Kind::Double) + 0.5) / (1u64 << 53) as f64;
    (-(-uniform.log()).log()).to_kind(Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn penalties_count_the_generated_tokens_and_bias_adds() {
        let adjust = LogitAdjust {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            bias: vec![(7, 3.0), (2, -100.0)],
        };
        // Token 5 twice, 7 once: 5 loses 0.5 + 2 · 0.25, 7 gains 3 and loses 0.5 + 0.25.
        assert_eq!(
            adjust.deltas(&[5, 7, 5]),
            vec![(2, -100.0), (5, -1.0), (7, 2.25)]
        );
        assert_eq!(adjust.deltas(&[]), vec![(2, -100.0), (7, 3.0)]);
        assert!(LogitAdjust::default().is_none() && LogitAdjust::default().deltas(&[1]).is_empty());
    }

    fn settings(top_k: i64, top_p: f64) -> Sampling {
        Sampling {
            top_k,
            top_p,
            ..Sampling::greedy()
        }
    }

    /// `n` rows of `sampling`, each its own stream.
    fn rows(sampling: Sampling, n: usize) -> Vec<RowSampling> {
        (0..n)
            .map(|row| RowSampling {
                sampling,
                seed: row_seed(3, row),
                draws: 0,
            })
            .collect()
    }

    fn picks(logits: &Tensor, sampling: Sampling) -> Vec<i64> {
        let n = logits.size()[0] as usize;
        Vec::<i64>::try_from(sample(logits, &rows(sampling, n)).unwrap()).unwrap()
    }

    #[test]
    fn top_k_and_top_p_keep_only_the_head_of_the_distribution() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top-k 2 and top-p 0.7 both keep tokens 0 and 1.
        let logits = Tensor::from_slice(&[0.5f32, 0.3, 0.15, 0.05])
            .log()
            .unsqueeze(0)
            .repeat([400, 1]);
        for sampling in [settings(2, 0.0), settings(0, 0.7)] {
            let picks = picks(&logits, sampling);
            assert!(picks.iter().all(|&t| t < 2), "{sampling:?}: {picks:?}");
            assert!(picks.contains(&0) && picks.contains(&1));
        }
        let plain = picks(&logits, settings(0, 0.0));
        assert!(plain.contains(&3), "plain sampling reaches the tail");
        assert_eq!(picks(&logits.narrow(0, 0, 2), Sampling::greedy()), [0, 0]);
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
                assert_eq!(picks(&logits, sampling), [1; 8], "{sampling:?}");
            }
        }
    }

    #[test]
    fn draws_follow_the_softmax_and_do_not_depend_on_the_other_rows() {
        let probabilities = [0.5f64, 0.3, 0.15, 0.05];
        let logits = Tensor::from_slice(&probabilities)
            .log()
            .to_kind(Kind::Float)
            .unsqueeze(0)
            .repeat([8000, 1]);
        let drawn = picks(&logits, settings(0, 0.0));
        for (token, p) in probabilities.iter().enumerate() {
            let share = drawn.iter().filter(|&&t| t == token as i64).count() as f64 / 8000.0;
            assert!((share - p).abs() < 0.02, "token {token}: {share} vs {p}");
        }
        // Row 5 of a batch of mixed settings draws what it draws alone.
        let mixed: Vec<RowSampling> = (0..8)
            .map(|row| RowSampling {
                sampling: [
                    settings(0, 0.0),
                    settings(2, 0.0),
                    settings(0, 0.9),
                    Sampling::greedy(),
                ][row % 4],
                seed: row_seed(11, row),
                draws: row as u64,
            })
            .collect();
        let batch = logits.narrow(0, 0, 8);
        let together = Vec::<i64>::try_from(sample(&batch, &mixed).unwrap()).unwrap();
        for (row, setting) in mixed.iter().enumerate() {
            let alone = sample(&batch.narrow(0, row as i64, 1), &[*setting]).unwrap();
            assert_eq!(alone.int64_value(&[0]), together[row], "row {row}");
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
