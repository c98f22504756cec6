//! Megatron's text-generation loop (spec §6.3) over a KV cache: prompts of different lengths in
//! one batch, the shared prefix processed at once and then one position per step, sampling,
//! stop conditions and log-probabilities of prompt and generated tokens.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::decoder::Decoder;
use super::sampling::{sample, Sampling};
use crate::model::GptModel;

/// Steps between checks whether every row has stopped.
const DONE_CHECK_INTERVAL: i64 = 16;

/// When a row stops before its length budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCondition {
    /// Only at the length budget (a tokenizer without an end-of-document token).
    Never,
    /// On `termination` (the end-of-document token unless told otherwise).
    Token(i64),
    /// On a newline token or a double newline (`stop_on_eol`), GPT-2 ids given.
    EndOfLine { newline: i64, double_newline: i64 },
    /// On two newlines in a row, or the double-newline token (`stop_on_double_eol`).
    DoubleEndOfLine { newline: i64, double_newline: i64 },
}

/// One batch of prompts to continue.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Token ids of every prompt (each non-empty).
    pub prompts: Vec<Vec<i64>>,
    /// New positions after the longest prompt; every row gets the same total length budget.
    pub tokens_to_generate: usize,
    pub sampling: Sampling,
    pub stop: StopCondition,
    /// `(colon, newline)` token ids: never sample the newline right after a colon.
    pub prevent_newline_after_colon: Option<(i64, i64)>,
    pub logprobs: bool,
    /// Pads rows beyond their prompt until they are generated.
    pub pad: i64,
}

/// What came out: every row's tokens (prompt included) up to its length, and with `logprobs`
/// the log-probability of each token after the first under the model (raw logits).
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<Vec<i64>>,
    pub logprobs: Option<Vec<Vec<f32>>>,
}

/// Runs the loop on `model`'s device through `decoder`; sampling draws from that device's
/// default generator.
pub fn generate_tokens(
    model: &GptModel,
    request: &GenerationRequest,
    decoder: &mut Decoder,
) -> Result<Generation> {
    generate_tokens_observed(model, request, decoder, None)
}

/// Sees each token as it is generated: `(row, token)` for every row still going; answering
/// `true` ends that row there (its length includes the token).
pub type TokenObserver<'a> = &'a mut dyn FnMut(usize, i64) -> bool;

/// [`generate_tokens`], telling `observer` every new token (streaming answers).
pub fn generate_tokens_observed(
    model: &GptModel,
    request: &GenerationRequest,
    decoder: &mut Decoder,
    mut observer: Option<TokenObserver>,
) -> Result<Generation> {
    request.sampling.validate()?;
    ensure!(!request.prompts.is_empty(), "no prompts to continue");
    ensure!(
        request.prompts.iter().all(|p| !p.is_empty()),
        "every prompt needs at least one token"
    );
    let device = model.options().device;
    let lengths: Vec<i64> = request.prompts.iter().map(|p| p.len() as i64).collect();
    let (min_len, max_len) = (
        *lengths.iter().min().expect("prompts"),
        *lengths.iter().max().expect("prompts"),
    );
    let total = max_len + request.tokens_to_generate as i64;
    let batch = request.prompts.len() as i64;
    let mut padded = vec![request.pad; (batch * total) as usize];
    for (row, prompt) in request.prompts.iter().enumerate() {
        padded[row * total as usize..][..prompt.len()].copy_from_slice(prompt);
    }
    let tokens = Tensor::from_slice(&padded)
        .view([batch, total])
        .to_device(device);
    let vocab = model.config.vocab_size;
    tch::no_grad(|| {
        if request.tokens_to_generate == 0 {
            return score_prompts(model, &tokens, &lengths, max_len);
        }
        let mut steps = decoder.start(model, batch, total)?;
        let prompt_lengths = Tensor::from_slice(&lengths).to_device(device);
        let mut out_lengths = Tensor::full([batch], total, (Kind::Int64, device));
        let mut done = Tensor::zeros([batch], (Kind::Bool, device));
        let mut logprobs = request
            .logprobs
            .then(|| Tensor::zeros([batch, total - 1], (Kind::Float, device)));
        let mut sampling = request.sampling;
        let mut previous = 0;
        let mut context = min_len;
        while context < total {
            let input = tokens.narrow(1, previous, context - previous);
            // [s, b, V] → [b, s, V] over the true vocabulary (padding rows are never sampled).
            let logits = steps
                .forward(&input)?
                .transpose(0, 1)
                .narrow(2, 0, vocab)
                .to_kind(Kind::Float);
            if let Some((colon, newline)) = request.prevent_newline_after_colon {
                let after_colon = tokens.select(1, context - 1).eq(colon);
                let _ = logits
                    .select(1, -1)
                    .select(1, newline)
                    .masked_fill_(&after_colon, -1e10);
            }
            let new = sample(&logits.select(1, -1), &sampling)?;
            sampling = sampling.decayed();
            let started = prompt_lengths.le(context);
            let current = tokens.select(1, context);
            let chosen = new.where_self(&started, &current);
            tokens.select(1, context).copy_(&chosen);
            if let Some(logprobs) = &mut logprobs {
                let targets = tokens
                    .narrow(1, previous + 1, context - previous)
                    .unsqueeze(2);
                let gathered = logits
                    .log_softmax(2, Kind::Float)
                    .gather(2, &targets, false)
                    .squeeze_dim(2);
                logprobs
                    .narrow(1, previous, context - previous)
                    .copy_(&gathered);
            }
            let mut stopped =
                stopped(&request.stop, &new, &tokens.select(1, context - 1)).logical_and(&started);
            if let Some(observer) = observer.as_mut() {
                let live: Vec<bool> = Vec::try_from(
                    started
                        .logical_and(&done.logical_not())
                        .to_device(Device::Cpu),
                )?;
                let picked: Vec<i64> = Vec::try_from(new.to_device(Device::Cpu))?;
                let ended: Vec<bool> = live
                    .iter()
                    .zip(&picked)
                    .enumerate()
                    .map(|(row, (&live, &token))| live && observer(row, token))
                    .collect();
                stopped = stopped.logical_or(&Tensor::from_slice(&ended).to_device(device));
            }
            let just = stopped.logical_and(&done.logical_not());
            out_lengths = Tensor::full([batch], context + 1, (Kind::Int64, device))
                .where_self(&just, &out_lengths);
            done = done.logical_or(&stopped);
            previous = context;
            context += 1;
            // Reading `done` waits for the device; every few steps the host runs ahead instead
            // (rows past their length keep generating unseen tokens until the check).
            let check = observer.is_some() || (context - min_len) % DONE_CHECK_INTERVAL == 0;
            if check && done.all().int64_value(&[]) != 0 {
                break;
            }
        }
        let out_lengths: Vec<i64> = Vec::try_from(out_lengths.to_device(Device::Cpu))?;
        finish(&tokens, &out_lengths, logprobs.as_ref())
    })
}

/// `tokens_to_generate = 0`: one forward over the prompts, scoring every token after the first.
fn score_prompts(
    model: &GptModel,
    tokens: &Tensor,
    lengths: &[i64],
    max_len: i64,
) -> Result<Generation> {
    let batch = tokens.size()[0];
    let mut cache = model.new_kv_cache(batch, max_len)?;
    let vocab = model.config.vocab_size;
    let logits = model
        .forward_cached(&tokens.narrow(1, 0, max_len), &mut cache)?
        .transpose(0, 1)
        .narrow(2, 0, vocab);
    let targets = tokens.narrow(1, 1, max_len - 1).unsqueeze(2);
    let logprobs = logits
        .narrow(1, 0, max_len - 1)
        .log_softmax(2, Kind::Float)
        .gather(2, &targets, false)
        .squeeze_dim(2);
    finish(tokens, lengths, Some(&logprobs))
}

fn stopped(stop: &StopCondition, new: &Tensor, before: &Tensor) -> Tensor {
    match *stop {
        StopCondition::Never => new.zeros_like().to_kind(Kind::Bool),
        StopCondition::Token(termination) => new.eq(termination),
        StopCondition::EndOfLine {
            newline,
            double_newline,
        } => new.eq(double_newline).logical_or(&new.eq(newline)),
        StopCondition::DoubleEndOfLine {
            newline,
            double_newline,
        } => new
            .eq(double_newline)
            .logical_or(&new.eq(newline).logical_and(&before.eq(newline))),
    }
}

fn finish(tokens: &Tensor, lengths: &[i64], logprobs: Option<&Tensor>) -> Result<Generation> {
    let tokens = tokens.to_device(Device::Cpu);
    let logprobs = logprobs.map(|l| l.to_device(Device::Cpu));
    let mut rows = Vec::with_capacity(lengths.len());
    let mut scores = Vec::with_capacity(lengths.len());
    for (row, &length) in lengths.iter().enumerate() {
        rows.push(Vec::<i64>::try_from(
            tokens.get(row as i64).narrow(0, 0, length),
        )?);
        if let Some(logprobs) = &logprobs {
            scores.push(Vec::<f32>::try_from(logprobs.get(row as i64).narrow(
                0,
                0,
                length - 1,
            ))?);
        }
    }
    Ok(Generation {
        tokens: rows,
        logprobs: logprobs.map(|_| scores),
    })
}
