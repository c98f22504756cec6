//! Megatron's beam search for one prompt (spec §6.3): the best `2·beam` continuations of all
//! beams each step, hypotheses ending in the stop token kept with their length-normalised
//! score, stopping once no live beam can beat the worst kept hypothesis.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::causal_lm::CausalLm;

#[derive(Debug, Clone)]
pub struct BeamSearchRequest {
    pub prompt: Vec<i64>,
    pub tokens_to_generate: usize,
    pub beam_width: usize,
    pub stop_token: i64,
    pub length_penalty: f64,
    /// `(colon, newline)` token ids: never choose the newline right after a colon.
    pub prevent_newline_after_colon: Option<(i64, i64)>,
}

/// Up to `beam_width` hypotheses (prompt included), best first, with their scores.
#[derive(Debug, Clone, PartialEq)]
pub struct BeamSearchResult {
    pub tokens: Vec<Vec<i64>>,
    pub scores: Vec<f64>,
}

/// The best finished hypotheses (Megatron's `BeamHypotheses`).
struct Finished {
    width: usize,
    length_penalty: f64,
    hypotheses: Vec<(f64, Vec<i64>)>,
}

impl Finished {
    fn normalised(&self, sum_logprobs: f64, generated: i64) -> f64 {
        sum_logprobs / (generated as f64).powf(self.length_penalty)
    }

    fn worst(&self) -> f64 {
        self.hypotheses
            .iter()
            .map(|h| h.0)
            .fold(f64::INFINITY, f64::min)
    }

    fn add(&mut self, tokens: Vec<i64>, sum_logprobs: f64, generated: i64) {
        let score = self.normalised(sum_logprobs, generated);
        if self.hypotheses.len() < self.width || score > self.worst() {
            self.hypotheses.push((score, tokens));
            if self.hypotheses.len() > self.width {
                let worst = self
                    .hypotheses
                    .iter()
                    .enumerate()
                    .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
                    .map(|(i, _)| i)
                    .expect("non-empty");
                self.hypotheses.remove(worst);
            }
        }
    }

    fn is_done(&self, best_sum_logprobs: f64, generated: i64) -> bool {
        self.hypotheses.len() >= self.width
            && self.worst() >= self.normalised(best_sum_logprobs, generated)
    }
}

pub fn beam_search<M: CausalLm + ?Sized>(
    model: &M,
    request: &BeamSearchRequest,
) -> Result<BeamSearchResult> {
    let prompt_len = request.prompt.len() as i64;
    ensure!(prompt_len > 0, "the prompt has no tokens");
    let total = (prompt_len + request.tokens_to_generate as i64).min(model.max_positions());
    ensure!(
        prompt_len < total,
        "context length + tokens_to_generate too large"
    );
    let beam = request.beam_width as i64;
    let device = model.device();
    let vocab = model.vocab_size();
    let mut padded = request.prompt.clone();
    padded.resize(total as usize, request.stop_token);
    let mut tokens = Tensor::from_slice(&padded)
        .to_device(device)
        .unsqueeze(0)
        .repeat([beam, 1]);
    let mut scores = Tensor::zeros([beam], (Kind::Float, device));
    let mut finished = Finished {
        width: request.beam_width,
        length_penalty: request.length_penalty,
        hypotheses: Vec::new(),
    };
    tch::no_grad(|| -> Result<BeamSearchResult> {
        let mut cache = model.new_kv_cache(beam, total)?;
        let (mut previous, mut context, mut done) = (0, prompt_len, false);
        while context < total {
            let input = tokens.narrow(1, previous, context - previous);
            let last = model
                .forward_cached(&input, &mut cache)?
                .select(0, -1)
                .narrow(1, 0, vocab)
                .to_kind(Kind::Float);
            if let Some((colon, newline)) = request.prevent_newline_after_colon {
                let after_colon = tokens.select(1, context - 1).eq(colon);
                let _ = last.select(1, newline).masked_fill_(&after_colon, -1e10);
            }
            let candidates = last.log_softmax(1, Kind::Float) + scores.unsqueeze(1);
            // At the first step every beam is the same prompt: only row 0 counts.
            let candidates = if context == prompt_len {
                candidates.narrow(0, 0, 1)
            } else {
                candidates
            };
            let (best_scores, best_indices) =
                candidates.reshape([-1]).topk(2 * beam, 0, true, true);
            let best_scores: Vec<f64> = Vec::try_from(best_scores.to_device(Device::Cpu))?;
            let best_indices: Vec<i64> = Vec::try_from(best_indices.to_device(Device::Cpu))?;
            let rows = tokens.to_device(Device::Cpu);
            let mut next: Vec<(i64, f64, i64)> = Vec::with_capacity(beam as usize);
            for (rank, (&score, &index)) in best_scores.iter().zip(&best_indices).enumerate() {
                let (beam_id, token) = (index / vocab, index % vocab);
                if token == request.stop_token {
                    if rank < beam as usize {
                        let mut hypothesis =
                            Vec::<i64>::try_from(rows.get(beam_id).narrow(0, 0, context))?;
                        hypothesis.push(token);
                        finished.add(hypothesis, score, context + 1 - prompt_len);
                    }
                } else {
                    next.push((token, score, beam_id));
                }
                if next.len() == beam as usize {
                    break;
                }
            }
            let best = best_scores
                .iter()
                .copied()
                .fold(f64::NEG_INFINITY, f64::max);
            if finished.is_done(best, context + 1 - prompt_len) {
                done = true;
                break;
            }
            let beam_ids =
                Tensor::from_slice(&next.iter().map(|n| n.2).collect::<Vec<_>>()).to_device(device);
            tokens = tokens.index_select(0, &beam_ids);
            let words =
                Tensor::from_slice(&next.iter().map(|n| n.0).collect::<Vec<_>>()).to_device(device);
            tokens.select(1, context).copy_(&words);
            scores = Tensor::from_slice(&next.iter().map(|n| n.1 as f32).collect::<Vec<_>>())
                .to_device(device);
            cache.select_rows(&beam_ids);
            previous = context;
            context += 1;
        }
        if !done {
            let rows = tokens.to_device(Device::Cpu);
            let live: Vec<f32> = Vec::try_from(scores.to_device(Device::Cpu))?;
            let length = context.min(total);
            for (row, &score) in live.iter().enumerate() {
                let hypothesis = Vec::<i64>::try_from(rows.get(row as i64).narrow(0, 0, length))?;
                finished.add(hypothesis, score as f64, length - prompt_len);
            }
        }
        let mut hypotheses = finished.hypotheses;
        hypotheses.sort_by(|a, b| b.0.total_cmp(&a.0));
        Ok(BeamSearchResult {
            scores: hypotheses.iter().map(|h| h.0).collect(),
            tokens: hypotheses.into_iter().map(|h| h.1).collect(),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finished_hypotheses_keep_the_best_by_normalised_score() {
        let mut finished = Finished {
            width: 2,
            length_penalty: 1.0,
            hypotheses: Vec::new(),
        };
        finished.add(vec![1], -4.0, 2);
        finished.add(vec![2], -1.0, 1);
        finished.add(vec![3], -3.0, 1);
        let kept: Vec<&Vec<i64>> = finished.hypotheses.iter().map(|h| &h.1).collect();
        assert_eq!(kept, [&vec![1], &vec![2]]);
        // Worst kept: -2.0; a live beam at -6 over 2 tokens (-3) cannot beat it.
        assert!(finished.is_done(-6.0, 2));
        assert!(!finished.is_done(-1.0, 2));
    }
}
