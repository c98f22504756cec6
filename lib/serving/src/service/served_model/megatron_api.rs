//! Megatron's `PUT /api` (spec §6.2–6.3): its checks in its order and with its messages,
//! `add_BOS`, the stop conditions, beam search, and the answer's `text`, `segments` and
//! `logprobs` (or `scores`) built from the tokens.

use megatron_inference::{
    beam_search, BeamSearchRequest, CausalLm, Generation, GenerationRequest, LogitAdjust, Sampling,
    StopCondition,
};
use serde_json::json;

use super::{Prepared, ServedModel, Start};
use crate::api::ApiRequest;
use crate::service::queue::{Answer, Usage};
use crate::service::ServiceError;

impl<M: CausalLm> ServedModel<M> {
    /// Megatron's checks in Megatron's order, then the rows to batch (or, for beam search and
    /// `tokens_to_generate = 0`, the answer).
    pub fn prepare_api(&self, request: &ApiRequest) -> Result<Start, ServiceError> {
        let failed = |e: anyhow::Error| ServiceError::Failed(format!("{e:#}"));
        let prompts = self
            .tokenize(&request.prompts, request.add_bos)
            .map_err(failed)?;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let total = longest.saturating_add(request.tokens_to_generate);
        if total > self.longest_sequence() {
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
        if tokens > self.settings.max_tokens {
            return Err(ServiceError::Rejected(format!(
                "Too many tokens.  {tokens} is greater than {}",
                self.settings.max_tokens
            )));
        }
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
        if let Some(beam_width) = request.beam_width {
            let prompt = prompts.into_iter().next().unwrap_or_default();
            return Ok(Start::Now(self.beam(
                request,
                prompt,
                beam_width,
                colon_newline,
            )));
        }
        if prompts.iter().any(Vec::is_empty) {
            return Err(ServiceError::Rejected("a prompt has no tokens".into()));
        }
        let prompt_tokens = prompts.iter().map(Vec::len).sum();
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
            top_logprobs: 0,
            pad: self.special.eod,
            adjust: LogitAdjust::default(),
        };
        self.start(
            Prepared::Api { prompt_tokens },
            &generation,
            request.random_seed,
        )
    }

    /// Megatron's answer: every row's text, its tokens one by one and their log-probabilities;
    /// the rows continued prompts of `prompt_tokens` tokens in all.
    pub fn finish_api(
        &self,
        out: Generation,
        prompt_tokens: usize,
    ) -> Result<Answer, ServiceError> {
        let (text, segments) = self.texts(&out.tokens)?;
        let all: usize = out.tokens.iter().map(Vec::len).sum();
        Ok(Answer {
            body: json!({"text": text, "segments": segments, "logprobs": out.logprobs}),
            usage: Usage {
                prompt: prompt_tokens as u64,
                generated: all.saturating_sub(prompt_tokens) as u64,
            },
        })
    }

    /// Each beam step ranks the best `2 · beam_width` continuations of the first beam's
    /// vocabulary, so at most half the vocabulary can be beams.
    fn check_beam_width(&self, beam_width: usize) -> Result<(), ServiceError> {
        let most = (self.model.vocab_size() / 2).max(1) as usize;
        if beam_width > most {
            return Err(ServiceError::Rejected(format!(
                "beam_width ({beam_width}) must be at most {most}, half the vocabulary size"
            )));
        }
        Ok(())
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

    fn beam(
        &self,
        request: &ApiRequest,
        prompt: Vec<i64>,
        beam_width: usize,
        colon_newline: Option<(i64, i64)>,
    ) -> Result<Answer, ServiceError> {
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
        let prompt = search.prompt.len();
        let generated = out
            .tokens
            .iter()
            .map(|t| t.len().saturating_sub(prompt))
            .sum::<usize>();
        Ok(Answer {
            body: json!({"text": text, "segments": segments, "scores": out.scores}),
            usage: Usage {
                prompt: prompt as u64,
                generated: generated as u64,
            },
        })
    }
}
