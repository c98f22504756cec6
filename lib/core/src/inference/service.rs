//! A validated `/api` request in, Megatron's response out (spec §6.2–6.3): tokenization with
//! `add_BOS`, the length limits, sampling or beam search, and `text`/`segments`/`logprobs`
//! (or `scores`) built from the tokens.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use megatron_data::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

use super::api::ApiRequest;
use super::beam_search::{beam_search, BeamSearchRequest};
use super::decoder::Decoder;
use super::generation::{
    generate_tokens, generate_tokens_observed, GenerationRequest, StopCondition,
};
use super::openai::{completion_body, text_offsets, Choice, CompletionRequest};
use super::sampling::Sampling;
use crate::model::{AttentionMask, GptModel};
use crate::parallel::Communicator;

/// Megatron's `--max-tokens-to-oom` default: prompts × total length per request.
pub const DEFAULT_MAX_TOKENS: usize = 12_000;

/// Why a request produced no response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceError {
    /// The request cannot be served as asked (HTTP 400 with Megatron's message).
    Rejected(String),
    /// Something broke while serving it (HTTP 500).
    Failed(String),
}

/// A streamed answer's client went away: its generation stops at the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone;

/// Receives a completion's text as it is generated: `(choice, text)`.
pub type DeltaSink<'a> = &'a mut dyn FnMut(usize, &str) -> Result<(), ClientGone>;

/// Token ids the request flags refer to, found through the tokenizer (GPT-2: 198, 628, 25).
struct SpecialTokens {
    eod: i64,
    newline: Option<i64>,
    double_newline: Option<i64>,
    colon: Option<i64>,
}

pub struct TextGenerationService {
    /// The KV cache and decode graphs, kept from one request to the next. Declared first so
    /// that it is dropped first: tearing down an NCCL communicator (the model's) waits until
    /// the CUDA graphs that captured its collectives are gone.
    decoder: Mutex<Decoder>,
    model: GptModel,
    tokenizer: Arc<dyn Tokenizer>,
    max_tokens: usize,
    special: SpecialTokens,
    /// With tensor parallelism: the group whose other ranks run every request with rank 0.
    mirror: Option<Arc<dyn Communicator>>,
}

/// What rank 0 tells the other tensor-parallel ranks to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum SharedJob {
    Api(ApiRequest),
    Completion(CompletionRequest),
    Stop,
}

fn single_token(tokenizer: &dyn Tokenizer, text: &str) -> Option<i64> {
    tokenizer
        .tokenize(text)
        .ok()
        .and_then(|ids| ids.first().map(|&id| i64::from(id)))
}

impl TextGenerationService {
    pub fn new(model: GptModel, tokenizer: Arc<dyn Tokenizer>, max_tokens: usize) -> Result<Self> {
        // A larger tokenizer would hand the model ids its embedding table does not have.
        anyhow::ensure!(
            tokenizer.vocab_size() as i64 <= model.config.vocab_size,
            "the tokenizer has {} tokens but the checkpoint's model knows {}: give the \
             tokenizer flags the model was trained with",
            tokenizer.vocab_size(),
            model.config.vocab_size
        );
        let eod = tokenizer
            .eod()
            .map(i64::from)
            .ok_or_else(|| anyhow::anyhow!("the tokenizer has no end-of-document token"))?;
        let special = SpecialTokens {
            eod,
            newline: single_token(tokenizer.as_ref(), "\n"),
            double_newline: single_token(tokenizer.as_ref(), "\n\n"),
            colon: single_token(tokenizer.as_ref(), ":"),
        };
        Ok(TextGenerationService {
            decoder: Mutex::new(Decoder::with_cuda_graphs()),
            model,
            tokenizer,
            max_tokens,
            special,
            mirror: None,
        })
    }

    /// Launches every decode step kernel by kernel instead of replaying CUDA graphs
    /// (`--no-cuda-graphs`), e.g. to compare the two.
    pub fn without_cuda_graphs(mut self) -> Self {
        self.decoder = Mutex::new(Decoder::eager());
        self
    }

    /// Serves with tensor parallelism over `group`: rank 0 calls [`Self::respond`] and
    /// [`Self::complete`], the other ranks [`Self::follow`].
    pub fn with_tensor_parallel(mut self, group: Arc<dyn Communicator>) -> Self {
        self.mirror = (group.size() > 1).then_some(group);
        self
    }

    /// Broadcasts `job` from rank 0 (no-op without tensor parallelism).
    fn announce(&self, job: &SharedJob) -> Result<()> {
        if let Some(group) = &self.mirror {
            share_bytes(
                group.as_ref(),
                self.model.options().device,
                Some(&serde_json::to_vec(job)?),
            )?;
        }
        Ok(())
    }

    /// The other tensor-parallel ranks: runs every request rank 0 announces, until it stops.
    pub fn follow(&self) -> Result<()> {
        let group = self
            .mirror
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("following needs tensor parallelism"))?;
        loop {
            let bytes = share_bytes(group.as_ref(), self.model.options().device, None)?;
            match serde_json::from_slice::<SharedJob>(&bytes)? {
                SharedJob::Api(request) => {
                    let _ = self.run_api(&request);
                }
                SharedJob::Completion(request) => {
                    let _ = self.run_completion(&request, "", 0, &mut |_, _| Ok(()));
                }
                SharedJob::Stop => return Ok(()),
            }
        }
    }

    /// The tokenizer requests are read with.
    pub fn tokenizer(&self) -> &dyn Tokenizer {
        self.tokenizer.as_ref()
    }

    /// The most tokens a completion of a `prompt_tokens` long prompt may ask for: the
    /// model's positions and the request budget (`--max-tokens-to-oom`) left after it.
    pub fn room_after(&self, prompt_tokens: usize) -> usize {
        let positions = self.model.config.max_position_embeddings as usize;
        positions.min(self.max_tokens).saturating_sub(prompt_tokens)
    }

    /// Rank 0, when the server stops: releases the other ranks.
    pub fn stop_followers(&self) -> Result<()> {
        self.announce(&SharedJob::Stop)
    }

    /// Seeds the sampling generators for a request that names a seed.
    fn seed(&self, seed: Option<u64>) -> Result<(), ServiceError> {
        if let Some(seed) = seed {
            crate::rng::manual_seed(self.model.options().device, seed)
                .map_err(|e| ServiceError::Failed(e.to_string()))?;
            tch::manual_seed(seed as i64);
        }
        Ok(())
    }

    /// Every rank must draw the same samples: without a seed in the request rank 0 picks one.
    fn shared_seed(&self, seed: Option<u64>) -> Option<u64> {
        seed.or_else(|| {
            self.mirror.as_ref().map(|_| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_nanos() as u64
            })
        })
    }

    pub fn respond(&self, request: &ApiRequest) -> Result<Value, ServiceError> {
        let request = ApiRequest {
            random_seed: self.shared_seed(request.random_seed),
            ..request.clone()
        };
        self.announce(&SharedJob::Api(request.clone()))
            .map_err(|e| ServiceError::Failed(format!("{e:#}")))?;
        self.run_api(&request)
    }

    fn run_api(&self, request: &ApiRequest) -> Result<Value, ServiceError> {
        let failed = |e: anyhow::Error| ServiceError::Failed(format!("{e:#}"));
        let prompts = self
            .tokenize(&request.prompts, request.add_bos)
            .map_err(failed)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let total = longest.saturating_add(request.tokens_to_generate);
        if total > self.model.config.max_position_embeddings as usize {
            return Err(ServiceError::Rejected(
                "Length of prompt + tokens_to_generate longer than allowed".into(),
            ));
        }
        self.check_top_k(request.top_k)?;
        // Beam search holds every beam's tokens and cache: beams count like prompts.
        let rows = match request.beam_width {
            Some(beam_width) => {
                self.check_beam_width(beam_width)?;
                beam_width
            }
            None => prompts.len(),
        };
        let tokens = rows.saturating_mul(total);
        if tokens > self.max_tokens {
            return Err(ServiceError::Rejected(format!(
                "Too many tokens.  {tokens} is greater than {}",
                self.max_tokens
            )));
        }
        self.seed(request.random_seed)?;
        let colon_newline = match (
            request.prevent_newline_after_colon,
            self.special.colon,
            self.special.newline,
        ) {
            (false, _, _) => None,
            (true, Some(colon), Some(newline)) => Some((colon, newline)),
            (true, _, _) => {
                return Err(ServiceError::Rejected(
                    "prevent_newline_after_colon needs a tokenizer with ':' and newline tokens"
                        .into(),
                ))
            }
        };
        match request.beam_width {
            Some(beam_width) => self.beam(
                request,
                prompts.into_iter().next().unwrap_or_default(),
                beam_width,
                colon_newline,
            ),
            None => self.sample(request, prompts, colon_newline),
        }
    }

    /// An OpenAI completion: `on_delta(choice, text)` receives the text as it is generated
    /// (held back while it may still turn into a stop sequence or an incomplete character).
    /// When it answers [`ClientGone`] the generation stops at the next step (without tensor
    /// parallelism: the other ranks could not know, so there it runs to its end).
    pub fn complete(
        &self,
        request: &CompletionRequest,
        id: &str,
        created: u64,
        on_delta: DeltaSink,
    ) -> Result<Value, ServiceError> {
        let request = CompletionRequest {
            seed: self.shared_seed(request.seed),
            ..request.clone()
        };
        self.announce(&SharedJob::Completion(request.clone()))
            .map_err(|e| ServiceError::Failed(format!("{e:#}")))?;
        self.run_completion(&request, id, created, on_delta)
    }

    fn run_completion(
        &self,
        request: &CompletionRequest,
        id: &str,
        created: u64,
        on_delta: DeltaSink,
    ) -> Result<Value, ServiceError> {
        let failed = |e: anyhow::Error| ServiceError::Failed(format!("{e:#}"));
        let (prompts, prompt_texts) = match &request.prompt_token_ids {
            Some(rows) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(&bad) = rows.iter().flatten().find(|&&id| id as usize >= vocab) {
                    return Err(ServiceError::Rejected(format!(
                        "prompt token id {bad} is outside the vocabulary of {vocab} tokens"
                    )));
                }
                let texts = rows
                    .iter()
                    .map(|ids| self.tokenizer.detokenize(ids))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ServiceError::Rejected(e.to_string()))?;
                let ids = rows
                    .iter()
                    .map(|ids| ids.iter().map(|&id| i64::from(id)).collect())
                    .collect();
                (ids, texts)
            }
            None => (
                self.tokenize(&request.prompts, false).map_err(failed)?,
                request.prompts.clone(),
            ),
        };
        if prompts.iter().any(Vec::is_empty) {
            return Err(ServiceError::Rejected("prompt must not be empty".into()));
        }
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        self.check_top_k(request.top_k)?;
        if longest.saturating_add(request.max_tokens)
            > self.model.config.max_position_embeddings as usize
        {
            return Err(ServiceError::Rejected(format!(
                "prompt ({longest} tokens) + max_tokens ({}) exceed the model's {} positions",
                request.max_tokens, self.model.config.max_position_embeddings
            )));
        }
        if prompts.len() * (longest + request.max_tokens) > self.max_tokens {
            return Err(ServiceError::Rejected(format!(
                "too many tokens: more than {}",
                self.max_tokens
            )));
        }
        self.seed(request.seed)?;
        let cancellable = self.mirror.is_none();
        let mut gone = false;
        if request.echo {
            // A streamed echo starts with the prompt, as the whole answer does.
            for (row, prompt) in prompt_texts.iter().enumerate() {
                gone |= on_delta(row, prompt).is_err();
            }
        }
        let sampling = if request.temperature == 0.0 {
            Sampling::greedy()
        } else {
            let top_p = if request.top_p >= 1.0 {
                0.0
            } else {
                request.top_p
            };
            Sampling {
                temperature: request.temperature,
                top_k: request.top_k,
                top_p,
                top_p_decay: 0.0,
                top_p_bound: 0.0,
            }
        };
        let mut streams: Vec<CompletionStream> = prompts
            .iter()
            .map(|_| CompletionStream::default())
            .collect();
        let mut observer = |row: usize, token: i64| -> bool {
            let stream = &mut streams[row];
            if token == self.special.eod {
                stream.finish = Some("stop");
                return true;
            }
            stream.tokens.push(token);
            let ended = stream.advance(
                self.tokenizer.as_ref(),
                &request.stop,
                request.max_tokens,
                &mut |text| gone |= on_delta(row, text).is_err(),
            );
            ended || (gone && cancellable)
        };
        let generation = GenerationRequest {
            prompts: prompts.clone(),
            tokens_to_generate: request.max_tokens,
            sampling,
            stop: StopCondition::Token(self.special.eod),
            prevent_newline_after_colon: None,
            logprobs: request.logprobs,
            pad: self.special.eod,
        };
        let out = if request.max_tokens == 0 {
            generate_tokens(&self.model, &generation, &mut self.decoder())
        } else {
            generate_tokens_observed(
                &self.model,
                &generation,
                &mut self.decoder(),
                Some(&mut observer),
            )
        }
        .map_err(failed)?;
        let mut choices = Vec::with_capacity(prompts.len());
        let mut completion_tokens = 0;
        for (row, stream) in streams.iter_mut().enumerate() {
            if stream.finish.is_none() && stream.tokens.len() < request.max_tokens {
                stream.finish = Some("stop");
            }
            let text = stream.final_text(self.tokenizer.as_ref(), &request.stop);
            let mut choice = Choice {
                text: if request.echo {
                    format!("{}{text}", prompt_texts[row])
                } else {
                    text
                },
                finish_reason: Some(stream.finish.unwrap_or("length")),
                ..Default::default()
            };
            completion_tokens += stream.tokens.len();
            if let Some(logprobs) = &out.logprobs {
                // With echo the prompt's tokens come first, the very first without a
                // log-probability (nothing precedes it), as OpenAI answers.
                let first = if request.echo { 0 } else { prompts[row].len() };
                let end = prompts[row].len() + stream.tokens.len();
                let shown = &out.tokens[row][first..end];
                choice.tokens = shown
                    .iter()
                    .map(|&t| self.tokenizer.detokenize(&[t as u32]).unwrap_or_default())
                    .collect();
                let ids: Vec<u32> = shown.iter().map(|&t| t as u32).collect();
                choice.text_offset = text_offsets(&ids, |prefix| {
                    self.tokenizer.detokenize(prefix).unwrap_or_default()
                });
                choice.token_logprobs = (first..end)
                    .map(|i| (i > 0).then(|| logprobs[row][i - 1]))
                    .collect();
                if request.top_logprobs > 0 {
                    let (chosen, alternatives) = self
                        .top_alternatives(&out.tokens[row][..end], request.top_logprobs)
                        .map_err(failed)?;
                    // Both from one forward, so a greedy token's value equals the top one
                    // exactly (lm-eval compares them with `==`).
                    choice.token_logprobs = (first..end)
                        .map(|i| (i > 0).then(|| chosen[i - 1]))
                        .collect();
                    choice.top_logprobs = Some(
                        (first..end)
                            .map(|i| {
                                (i > 0).then(|| {
                                    alternatives[i - 1]
                                        .iter()
                                        .map(|&(t, l)| {
                                            (
                                                self.tokenizer
                                                    .detokenize(&[t as u32])
                                                    .unwrap_or_default(),
                                                l,
                                            )
                                        })
                                        .collect()
                                })
                            })
                            .collect(),
                    );
                }
            }
            choices.push(choice);
        }
        let prompt_tokens = prompts.iter().map(Vec::len).sum();
        Ok(completion_body(
            id,
            created,
            &request.model,
            &choices,
            Some((prompt_tokens, completion_tokens)),
        ))
    }

    /// Sampling keeps at most the whole vocabulary.
    fn check_top_k(&self, top_k: i64) -> Result<(), ServiceError> {
        let vocabulary = self.model.config.vocab_size;
        if top_k > vocabulary {
            return Err(ServiceError::Rejected(format!(
                "top_k ({top_k}) must not exceed the vocabulary size ({vocabulary})"
            )));
        }
        Ok(())
    }

    /// Each beam step ranks the best `2 · beam_width` continuations of the first beam's
    /// vocabulary, so at most half the vocabulary can be beams.
    fn check_beam_width(&self, beam_width: usize) -> Result<(), ServiceError> {
        let most = (self.model.config.vocab_size / 2).max(1) as usize;
        if beam_width > most {
            return Err(ServiceError::Rejected(format!(
                "beam_width ({beam_width}) must be at most {most}, half the vocabulary size"
            )));
        }
        Ok(())
    }

    /// For every position after the first of `tokens`, its log-probability and the `n` most
    /// likely tokens there with theirs, over the true vocabulary (one forward over the
    /// sequence; every tensor-parallel rank runs it).
    #[allow(clippy::type_complexity)]
    fn top_alternatives(
        &self,
        tokens: &[i64],
        n: usize,
    ) -> Result<(Vec<f32>, Vec<Vec<(i64, f32)>>)> {
        let device = self.model.options().device;
        let length = tokens.len() as i64;
        let input = Tensor::from_slice(tokens)
            .view([1, length])
            .to_device(device);
        let positions = Tensor::arange(length, (Kind::Int64, device)).unsqueeze(0);
        let logits = tch::no_grad(|| {
            self.model
                .forward_full_logits(&input, &positions, &AttentionMask::Causal)
        })?;
        let log_probs = logits
            .select(1, 0)
            .narrow(1, 0, self.model.config.vocab_size)
            .log_softmax(-1, Kind::Float);
        let targets = input.select(0, 0).narrow(0, 1, length - 1).unsqueeze(1);
        let chosen = log_probs
            .narrow(0, 0, length - 1)
            .gather(1, &targets, false)
            .squeeze_dim(1)
            .to_device(Device::Cpu);
        let chosen: Vec<f32> = Vec::try_from(chosen)?;
        let (values, indices) = log_probs.topk(n as i64, -1, true, true);
        let values = values.narrow(0, 0, length - 1).to_device(Device::Cpu);
        let indices = indices.narrow(0, 0, length - 1).to_device(Device::Cpu);
        let values: Vec<Vec<f32>> = Vec::try_from(values)?;
        let indices: Vec<Vec<i64>> = Vec::try_from(indices)?;
        let alternatives = indices
            .into_iter()
            .zip(values)
            .map(|(ids, logprobs)| ids.into_iter().zip(logprobs).collect())
            .collect();
        Ok((chosen, alternatives))
    }

    /// The decoder; requests run one at a time, so this never waits. After a panic in an
    /// earlier request (a poisoned lock) its cache and graphs are dropped, not trusted.
    fn decoder(&self) -> std::sync::MutexGuard<'_, Decoder> {
        self.decoder.lock().unwrap_or_else(|poisoned| {
            let mut decoder = poisoned.into_inner();
            decoder.reset();
            self.decoder.clear_poison();
            decoder
        })
    }

    /// Token ids of `prompts`, each after an end-of-document token with `add_bos`.
    fn tokenize(&self, prompts: &[String], add_bos: bool) -> Result<Vec<Vec<i64>>> {
        prompts
            .iter()
            .map(|prompt| {
                let bos = add_bos.then_some(self.special.eod);
                let ids = self.tokenizer.tokenize(prompt)?.into_iter().map(i64::from);
                Ok(bos.into_iter().chain(ids).collect())
            })
            .collect()
    }

    fn stop_condition(&self, request: &ApiRequest) -> Result<StopCondition, ServiceError> {
        let lines = || match (self.special.newline, self.special.double_newline) {
            (Some(newline), Some(double_newline)) => Ok((newline, double_newline)),
            _ => Err(ServiceError::Rejected(
                "stop_on_eol and stop_on_double_eol need a tokenizer with newline tokens".into(),
            )),
        };
        Ok(if request.stop_on_double_eol {
            let (newline, double_newline) = lines()?;
            StopCondition::DoubleEndOfLine {
                newline,
                double_newline,
            }
        } else if request.stop_on_eol {
            let (newline, double_newline) = lines()?;
            StopCondition::EndOfLine {
                newline,
                double_newline,
            }
        } else {
            StopCondition::Token(self.special.eod)
        })
    }

    fn sample(
        &self,
        request: &ApiRequest,
        prompts: Vec<Vec<i64>>,
        colon_newline: Option<(i64, i64)>,
    ) -> Result<Value, ServiceError> {
        if prompts.iter().any(Vec::is_empty) {
            return Err(ServiceError::Rejected("a prompt has no tokens".into()));
        }
        let generation = GenerationRequest {
            prompts,
            tokens_to_generate: request.tokens_to_generate,
            sampling: Sampling {
                temperature: request.temperature,
                top_k: request.top_k,
                top_p: request.top_p,
                top_p_decay: request.top_p_decay,
                top_p_bound: request.top_p_bound,
            },
            stop: self.stop_condition(request)?,
            prevent_newline_after_colon: colon_newline,
            logprobs: request.logprobs,
            pad: self.special.eod,
        };
        let out = generate_tokens(&self.model, &generation, &mut self.decoder())
            .map_err(|e| ServiceError::Failed(format!("{e:#}")))?;
        let (text, segments) = self.texts(&out.tokens)?;
        Ok(json!({"text": text, "segments": segments, "logprobs": out.logprobs}))
    }

    fn beam(
        &self,
        request: &ApiRequest,
        prompt: Vec<i64>,
        beam_width: usize,
        colon_newline: Option<(i64, i64)>,
    ) -> Result<Value, ServiceError> {
        let search = BeamSearchRequest {
            prompt,
            tokens_to_generate: request.tokens_to_generate,
            beam_width,
            stop_token: request.stop_token,
            length_penalty: request.length_penalty,
            prevent_newline_after_colon: colon_newline,
        };
        if search.tokens_to_generate == 0 {
            return Err(ServiceError::Rejected(
                "context length + tokens_to_generate too large".into(),
            ));
        }
        let out = beam_search(&self.model, &search)
            .map_err(|e| ServiceError::Failed(format!("{e:#}")))?;
        let (text, segments) = self.texts(&out.tokens)?;
        Ok(json!({"text": text, "segments": segments, "scores": out.scores}))
    }

    /// Each row's text, and its tokens one by one.
    fn texts(&self, rows: &[Vec<i64>]) -> Result<(Vec<String>, Vec<Vec<String>>), ServiceError> {
        let detokenize = |ids: &[u32]| {
            self.tokenizer
                .detokenize(ids)
                .map_err(|e| ServiceError::Failed(e.to_string()))
        };
        let mut texts = Vec::with_capacity(rows.len());
        let mut segments = Vec::with_capacity(rows.len());
        for row in rows {
            let ids: Vec<u32> = row.iter().map(|&t| t as u32).collect();
            texts.push(detokenize(&ids)?);
            segments.push(
                ids.iter()
                    .map(|&id| detokenize(&[id]))
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        Ok((texts, segments))
    }
}

/// A completion being streamed: its tokens, the text already sent, and why it ended.
#[derive(Default)]
struct CompletionStream {
    tokens: Vec<i64>,
    sent: usize,
    finish: Option<&'static str>,
}

impl CompletionStream {
    fn text(&self, tokenizer: &dyn Tokenizer) -> String {
        let ids: Vec<u32> = self.tokens.iter().map(|&t| t as u32).collect();
        tokenizer.detokenize(&ids).unwrap_or_default()
    }

    /// The text up to the first stop sequence, and whether one was found.
    fn cut(text: &str, stop: &[String]) -> (usize, bool) {
        match stop
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            Some(at) => (at, true),
            None => (text.len(), false),
        }
    }

    /// Sends what is certain of the text so far; `true` when the completion has ended.
    fn advance(
        &mut self,
        tokenizer: &dyn Tokenizer,
        stop: &[String],
        max_tokens: usize,
        send: &mut dyn FnMut(&str),
    ) -> bool {
        let text = self.text(tokenizer);
        let (mut end, stopped) = Self::cut(&text, stop);
        let ended = stopped || self.tokens.len() >= max_tokens;
        if !ended {
            // Hold back a possible start of a stop sequence and an unfinished character.
            let held = stop
                .iter()
                .map(|s| {
                    (1..s.len())
                        .rev()
                        .find(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
                        .unwrap_or(0)
                })
                .max()
                .unwrap_or(0);
            end -= held;
            while end > self.sent && text[..end].ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
        }
        if end > self.sent && text.is_char_boundary(end) && text.is_char_boundary(self.sent) {
            send(&text[self.sent..end]);
            self.sent = end;
        }
        if ended {
            self.finish = Some(if stopped { "stop" } else { "length" });
        }
        ended
    }

    fn final_text(&self, tokenizer: &dyn Tokenizer, stop: &[String]) -> String {
        let text = self.text(tokenizer);
        let (end, _) = Self::cut(&text, stop);
        text[..end].to_string()
    }
}

/// Broadcasts bytes from rank 0 of `group` (its length first); the other ranks pass `None`.
fn share_bytes(group: &dyn Communicator, device: Device, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
    let length = Tensor::from_slice(&[bytes.map_or(0, |b| b.len() as i64)]).to_device(device);
    group.broadcast(&length, 0)?;
    let length = length.int64_value(&[0]);
    let payload = match bytes {
        Some(bytes) => Tensor::from_slice(bytes).to_device(device),
        None => Tensor::zeros([length], (Kind::Uint8, device)),
    };
    group.broadcast(&payload, 0)?;
    Ok(Vec::<u8>::try_from(payload.to_device(Device::Cpu))?)
}
