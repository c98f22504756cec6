//! Decode steps queued on the device ahead of the host. Reading a step's tokens waits for the
//! GPU; while the host then bookkeeps, streams and launches the next step, the GPU idles (at
//! batch 1 that is most of the gap between two steps). So when the next step's rows and inputs
//! are known without its tokens — this step's rows one position on, less those that reach their
//! length — it is queued first, reading the drawn tokens where they lie on the device, and the
//! host reads this step's tokens while the GPU runs it. A row that stopped at the step read
//! otherwise (a stop token or sequence, a client gone) wastes its slot of the queued one, whose
//! token for it is dropped.

use std::sync::Arc;

use anyhow::Result;
use tch::{Kind, Tensor};

use super::causal_lm::CausalLm;
use super::decoder::{DecodeRow, Decoder};
use super::sampling::{sample, RowSampling};
use super::top_tokens::{listed, most_likely, TopTokens};
use megatron_kernels::runtime::{to_device_async, HostCopy};

/// How a row draws one token: its settings and random stream, whether its log-probability is
/// kept and how many of the most likely tokens with theirs, a token it may not draw (the
/// newline right after a colon), and what to add to its logits first (`(token, amount)`:
/// OpenAI's penalties and logit bias).
#[derive(Debug, Clone)]
pub struct Draw {
    pub sampling: RowSampling,
    pub logprobs: bool,
    pub top_logprobs: usize,
    pub banned: Option<i64>,
    pub adjust: Option<Arc<Vec<(i64, f32)>>>,
}

impl Draw {
    /// The row's next draw when nothing bans a token and its adjustment does not depend on
    /// the token drawn: its nucleus decayed once more.
    fn next(&self) -> Draw {
        Draw {
            sampling: RowSampling {
                sampling: self.sampling.sampling.decayed(),
                seed: self.sampling.seed,
                draws: self.sampling.draws + 1,
            },
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
            banned: None,
            adjust: self.adjust.clone(),
        }
    }
}

/// Tokens drawn on the device and, when a row keeps them, their log-probabilities under the
/// raw logits (and the most likely tokens with theirs, for the rows that ask), on their way to
/// the host.
pub struct Drawn {
    tokens: Tensor,
    landing: HostCopy,
    /// How many alternatives each row asks for (0: none).
    top_logprobs: Vec<usize>,
}

/// A step's tokens on the host, one per row: with their log-probabilities when a row keeps
/// them, and each row's most likely tokens (none unless it asked).
pub struct DrawnTokens {
    pub tokens: Vec<i64>,
    pub scores: Option<Vec<f32>>,
    pub top: Vec<TopTokens>,
}

impl Drawn {
    /// Draws one token per row of `logits` (`[rows, vocabulary]`) under `draws`.
    pub fn new(logits: &Tensor, draws: &[Draw]) -> Result<Drawn> {
        let mut logits = logits.shallow_clone();
        let banned: Vec<(i64, i64)> = draws
            .iter()
            .enumerate()
            .filter_map(|(k, d)| d.banned.map(|token| (k as i64, token)))
            .collect();
        if !banned.is_empty() {
            let (rows, columns): (Vec<i64>, Vec<i64>) = banned.into_iter().unzip();
            let at = to_device_async(
                &Tensor::from_slice(&[rows, columns].concat()),
                logits.device(),
            )?;
            let n = at.size()[0] / 2;
            let value = Tensor::from(-1e10f32).to_kind(logits.kind());
            // A decode step's logits may live in a CUDA graph's output buffer: write to a copy.
            logits = logits.index_put(
                &[Some(at.narrow(0, 0, n)), Some(at.narrow(0, n, n))],
                &to_device_async(&value, logits.device())?,
                false,
            );
        }
        let added: Vec<(i64, i64, f32)> = draws
            .iter()
            .enumerate()
            .flat_map(|(k, d)| {
                d.adjust
                    .iter()
                    .flat_map(move |deltas| deltas.iter().map(move |&(t, v)| (k as i64, t, v)))
            })
            .collect();
        if !added.is_empty() {
            let device = logits.device();
            let rows: Vec<i64> = added.iter().map(|a| a.0).collect();
            let columns: Vec<i64> = added.iter().map(|a| a.1).collect();
            let amounts: Vec<f32> = added.iter().map(|a| a.2).collect();
            let at = to_device_async(&Tensor::from_slice(&[rows, columns].concat()), device)?;
            let amounts = to_device_async(&Tensor::from_slice(&amounts), device)?;
            let n = amounts.size()[0];
            // In float32, written to a copy (a graph's output buffer stays as it is).
            logits = logits.to_kind(Kind::Float).index_put(
                &[Some(at.narrow(0, 0, n)), Some(at.narrow(0, n, n))],
                &amounts,
                true,
            );
        }
        let settings: Vec<RowSampling> = draws.iter().map(|d| d.sampling).collect();
        let tokens = sample(&logits, &settings)?;
        let top_logprobs: Vec<usize> = draws.iter().map(|d| d.top_logprobs).collect();
        let log_probs = draws
            .iter()
            .any(|d| d.logprobs || d.top_logprobs > 0)
            .then(|| logits.log_softmax(1, Kind::Float));
        let scores = log_probs.as_ref().map(|log_probs| {
            log_probs
                .gather(1, &tokens.unsqueeze(1), false)
                .squeeze_dim(1)
        });
        // Only the rows that ask pay for their alternatives; a step where none does, nothing.
        let asking: Vec<i64> = (0..draws.len() as i64)
            .filter(|&k| top_logprobs[k as usize] > 0)
            .collect();
        let top = match &log_probs {
            Some(log_probs) if !asking.is_empty() => {
                let rows = if asking.len() == draws.len() {
                    log_probs.shallow_clone()
                } else {
                    let at = to_device_async(&Tensor::from_slice(&asking), log_probs.device())?;
                    log_probs.index_select(0, &at)
                };
                let widest = top_logprobs.iter().copied().max().unwrap_or(0);
                Some(most_likely(&rows, widest))
            }
            _ => None,
        };
        let copies: Vec<&Tensor> = std::iter::once(&tokens)
            .chain(scores.as_ref())
            .chain(top.iter().flat_map(|(values, ids)| [values, ids]))
            .collect();
        let landing = HostCopy::start(&copies)?;
        Ok(Drawn {
            tokens,
            landing,
            top_logprobs,
        })
    }

    /// Waits for the tokens, their log-probabilities and the alternatives on the host.
    pub fn read(self) -> Result<DrawnTokens> {
        let mut copies = self.landing.read()?.into_iter();
        let tokens = Vec::<i64>::try_from(copies.next().expect("the tokens"))?;
        let scores = copies.next().map(Vec::<f32>::try_from).transpose()?;
        let mut top = vec![TopTokens::new(); tokens.len()];
        if let (Some(values), Some(ids)) = (copies.next(), copies.next()) {
            let asking: Vec<usize> = (0..tokens.len())
                .filter(|&k| self.top_logprobs[k] > 0)
                .collect();
            let wanted: Vec<usize> = asking.iter().map(|&k| self.top_logprobs[k]).collect();
            for (k, alternatives) in asking.into_iter().zip(listed(&values, &ids, &wanted)?) {
                top[k] = alternatives;
            }
        }
        Ok(DrawnTokens {
            tokens,
            scores,
            top,
        })
    }
}

/// A decode step queued on the device whose tokens have not been read yet.
pub struct InFlight {
    /// Its rows (by id, in the step's order), with their positions and draws.
    pub rows: Vec<u64>,
    positions: Vec<i64>,
    draws: Vec<Draw>,
    pub drawn: Drawn,
}

impl InFlight {
    /// Queues a decode step of `rows` (ids `ids`), drawing each row's token under `draws`.
    pub fn queue<M: CausalLm + ?Sized>(
        model: &M,
        decoder: &mut Decoder,
        ids: Vec<u64>,
        rows: &[DecodeRow],
        draws: Vec<Draw>,
    ) -> Result<InFlight> {
        Self::queue_reading(model, decoder, ids, rows, draws, None)
    }

    /// Queues the step after this one for its rows `kept` (indices into [`Self::rows`], in
    /// order), whose `blocks` (in that order) hold one position more: its tokens are the ones
    /// this step draws, read on the device.
    pub fn queue_next<M: CausalLm + ?Sized>(
        &self,
        model: &M,
        decoder: &mut Decoder,
        kept: &[usize],
        blocks: &[&[i64]],
    ) -> Result<InFlight> {
        let rows: Vec<DecodeRow> = kept
            .iter()
            .zip(blocks)
            .map(|(&k, blocks)| DecodeRow {
                token: 0,
                position: self.positions[k] + 1,
                blocks,
            })
            .collect();
        let draws = kept.iter().map(|&k| self.draws[k].next()).collect();
        let ids = kept.iter().map(|&k| self.rows[k]).collect();
        let tokens = if kept.len() == self.rows.len() {
            self.drawn.tokens.shallow_clone()
        } else {
            let kept: Vec<i64> = kept.iter().map(|&k| k as i64).collect();
            let at = to_device_async(&Tensor::from_slice(&kept), self.drawn.tokens.device())?;
            self.drawn.tokens.index_select(0, &at)
        };
        Self::queue_reading(model, decoder, ids, &rows, draws, Some(&tokens))
    }

    fn queue_reading<M: CausalLm + ?Sized>(
        model: &M,
        decoder: &mut Decoder,
        ids: Vec<u64>,
        rows: &[DecodeRow],
        draws: Vec<Draw>,
        drawn: Option<&Tensor>,
    ) -> Result<InFlight> {
        tch::no_grad(|| {
            let logits = decoder
                .decode(model, rows, drawn)?
                .narrow(1, 0, model.vocab_size());
            // In the model's dtype: greedy rows take the argmax as it is (float32 would pick
            // the same token), sampling converts.
            let drawn = Drawn::new(&logits, &draws)?;
            Ok(InFlight {
                rows: ids,
                positions: rows.iter().map(|r| r.position).collect(),
                draws,
                drawn,
            })
        })
    }
}
