//! OpenAI's completions over the batch: the checks, echoed prompts, text streamed as it is
//! generated (held back while it may still turn into a stop sequence or an incomplete
//! character), and the answer with its choices, finish reasons, log-probabilities and usage.

use megatron_data::tokenizer::Tokenizer;
use megatron_inference::{
    CausalLm, Generation, GenerationRequest, LogitAdjust, NewToken, Sampling, StopCondition,
    TopTokens,
};

use super::{Prepared, ServedModel, Start};
use crate::metrics::ServerMetrics;
use crate::openai::{completion_body, text_offsets, Choice, CompletionRequest, TokenLogprobs};
use crate::service::queue::{Answer, Caller, Usage};
use crate::service::ServiceError;

/// A completion while its rows run (one per sample of each prompt): each row's prompt and
/// stream.
pub(crate) struct CompletionState {
    request: CompletionRequest,
    prompts: Vec<Vec<i64>>,
    prompt_texts: Vec<String>,
    streams: Vec<ChoiceStream>,
}

impl<M: CausalLm> ServedModel<M> {
    /// OpenAI's checks, the echoed prompts sent, then the rows to batch (or, for
    /// `max_tokens = 0`, the answer).
    pub fn prepare_completion(
        &self,
        request: &CompletionRequest,
        caller: Option<&Caller>,
    ) -> Result<Start, ServiceError> {
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
        let vocab = self.tokenizer.vocab_size();
        if let Some((bad, _)) = request
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= vocab)
        {
            return Err(ServiceError::Rejected(format!(
                "logit_bias key \"{bad}\" is not a token id of the vocabulary of {vocab} tokens"
            )));
        }
        let (limit, limited_by) = self.sequence_limit();
        if longest.saturating_add(request.max_tokens) > limit {
            return Err(ServiceError::Rejected(format!(
                "prompt ({longest} tokens) + max_tokens ({}) exceed {limited_by}",
                request.max_tokens,
            )));
        }
        let samples = request.best_of.max(1);
        if prompts.len() * samples * (longest + request.max_tokens) > self.settings.max_tokens {
            return Err(ServiceError::Rejected(format!(
                "too many tokens: more than {}",
                self.settings.max_tokens
            )));
        }
        // One row per sample of each prompt, in the order of the choices.
        let (row_prompts, row_texts) = (
            per_sample(&prompts, samples),
            per_sample(&prompt_texts, samples),
        );
        if request.echo && !request.logprobs {
            // A streamed echo starts with the prompt, as the whole answer does (with
            // log-probabilities, once its prefill has scored it: see `observe`).
            if let Some(caller) = caller {
                for (row, prompt) in row_texts.iter().enumerate() {
                    caller.echo(row, prompt, None);
                }
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
        let generation = GenerationRequest {
            prompts: prompts.clone(),
            tokens_to_generate: request.max_tokens,
            sampling,
            stop: StopCondition::Token(self.special.eod),
            prevent_newline_after_colon: None,
            // The best of several samples is the likeliest.
            logprobs: request.logprobs || request.best_of > request.n,
            top_logprobs: request.top_logprobs,
            pad: self.special.eod,
            adjust: LogitAdjust {
                presence_penalty: request.presence_penalty as f32,
                frequency_penalty: request.frequency_penalty as f32,
                bias: request
                    .logit_bias
                    .iter()
                    .map(|&(id, amount)| (i64::from(id), amount as f32))
                    .collect(),
            },
        };
        let state = CompletionState {
            request: request.clone(),
            streams: row_prompts
                .iter()
                .map(|_| ChoiceStream::default())
                .collect(),
            prompts: row_prompts,
            prompt_texts: row_texts,
        };
        self.start_sampled(
            Prepared::Completion(Box::new(state)),
            &generation,
            request.seed,
            samples,
        )
    }

    /// A completion's new token (with the row's log-probabilities when the request keeps
    /// them): streams what is certain of its text, and with a streamed request's
    /// log-probabilities the tokens that text completes (before a row's first, an echoed
    /// prompt with its own); `true` ends the row (the end-of-document token, a stop sequence
    /// or `max_tokens`).
    pub fn observe(
        &self,
        state: &mut CompletionState,
        caller: Option<&mut Caller>,
        new: &NewToken,
        metrics: Option<&ServerMetrics>,
    ) -> bool {
        let tokenizer = self.tokenizer.as_ref();
        let request = &state.request;
        let row = new.row;
        let stream = &mut state.streams[row];
        let carries = request.stream && request.logprobs;
        if carries && request.echo && !stream.echoed {
            stream.echoed = true;
            if let Some(caller) = caller.as_deref() {
                let prompt = &state.prompts[row];
                let scores = (0..prompt.len())
                    .map(|i| (i > 0).then(|| (new.logprobs[i - 1], new.top_logprobs.get(i - 1))));
                let echoed = token_logprobs(tokenizer, prompt, 0, scores, request.top_logprobs > 0);
                caller.echo(row, &state.prompt_texts[row], Some(echoed));
            }
        }
        if new.token == self.special.eod {
            stream.finish = Some("stop");
            return true;
        }
        stream.tokens.push(new.token);
        stream.logprobs.extend(new.logprobs.last());
        stream.top.extend(new.top_logprobs.last().cloned());
        let (text, ended) = stream.advance(tokenizer, &request.stop, request.max_tokens);
        if let (Some(text), Some(caller)) = (text, caller) {
            let carried = carries
                .then(|| stream.release(tokenizer, &state.prompts[row], request.top_logprobs > 0));
            caller.stream(row, &text, carried, metrics);
        }
        ended
    }

    /// The completion's answer from its streams and the generated tokens (`id` and `created`
    /// are filled in where it is sent).
    pub fn finish_completion(
        &self,
        mut state: CompletionState,
        out: Generation,
    ) -> Result<Answer, ServiceError> {
        let request = &state.request;
        let prompts = &state.prompts;
        let prompt_texts = &state.prompt_texts;
        let mut choices = Vec::with_capacity(prompts.len());
        let mut scores = Vec::with_capacity(prompts.len());
        let mut completion_tokens = 0;
        for (row, stream) in state.streams.iter_mut().enumerate() {
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
            // The generated tokens' log-probabilities summed: what ranks best_of's samples.
            let generated = prompts[row].len() - 1..prompts[row].len() - 1 + stream.tokens.len();
            scores.push(out.logprobs.as_ref().map_or(0.0, |logprobs| {
                logprobs[row][generated]
                    .iter()
                    .map(|&l| f64::from(l))
                    .sum::<f64>()
            }));
            if let (true, Some(logprobs)) = (request.logprobs, &out.logprobs) {
                // With echo the prompt's tokens come first, the very first without a
                // log-probability (nothing precedes it), as OpenAI answers; offsets count
                // into the prompt and completion together, as Megatron's (and OpenAI's)
                // answer, so without echo the first generated token starts at the prompt's
                // length.
                let first = if request.echo { 0 } else { prompts[row].len() };
                let end = prompts[row].len() + stream.tokens.len();
                let top = out.top_logprobs.as_ref().map(|top| &top[row]);
                let scores = (first..end).map(|i| {
                    (i > 0).then(|| (logprobs[row][i - 1], top.and_then(|top| top.get(i - 1))))
                });
                choice.logprobs = token_logprobs(
                    self.tokenizer.as_ref(),
                    &out.tokens[row][..end],
                    first,
                    scores,
                    request.top_logprobs > 0,
                );
            }
            choices.push(choice);
        }
        let samples = request.best_of.max(1);
        let choices = best_choices(choices, &scores, samples, request.n);
        // Every sample of a prompt read it once.
        let prompt_tokens = prompts.iter().step_by(samples).map(Vec::len).sum();
        Ok(Answer {
            body: completion_body(
                "",
                0,
                &request.model,
                &choices,
                Some((prompt_tokens, completion_tokens)),
            ),
            usage: Usage {
                prompt: prompt_tokens as u64,
                generated: completion_tokens as u64,
            },
        })
    }
}

/// A choice of a completion being streamed: its tokens, the text already sent, and why it
/// ended.
#[derive(Default)]
struct ChoiceStream {
    tokens: Vec<i64>,
    /// The tokens' log-probabilities, when the request keeps them.
    logprobs: Vec<f32>,
    /// The most likely tokens at each, when the request asks for them.
    top: Vec<TopTokens>,
    /// The echoed prompt (with its log-probabilities) has been sent.
    echoed: bool,
    /// Tokens whose log-probabilities have been streamed.
    released: usize,
    sent: usize,
    finish: Option<&'static str>,
    /// The text of the first `settled` tokens, which did not end inside a character: each
    /// step detokenizes only the tokens after them (and a few before, for context), so a
    /// row's streaming costs the same at its 500th token as at its first.
    settled_text: String,
    settled: usize,
}

/// Of each prompt's `samples` choices (in a row), the `n` of highest `scores`, best first
/// (all, in order, when `n` is `samples`).
fn best_choices(choices: Vec<Choice>, scores: &[f64], samples: usize, n: usize) -> Vec<Choice> {
    if n >= samples {
        return choices;
    }
    let mut rows: Vec<(usize, Choice)> = choices.into_iter().enumerate().collect();
    let mut best = Vec::new();
    while !rows.is_empty() {
        let mut prompt: Vec<(usize, Choice)> = rows.drain(..samples.min(rows.len())).collect();
        prompt.sort_by(|(a, _), (b, _)| scores[*b].total_cmp(&scores[*a]));
        best.extend(prompt.into_iter().take(n).map(|(_, choice)| choice));
    }
    best
}

/// Each of `items` `samples` times in a row.
fn per_sample<T: Clone>(items: &[T], samples: usize) -> Vec<T> {
    items
        .iter()
        .flat_map(|item| std::iter::repeat_n(item, samples).cloned())
        .collect()
}

/// Tokens before the new ones detokenized with them: tokenizers that drop a word's leading
/// space at the start of a text (SentencePiece) see the word in its place.
const DETOKENIZE_CONTEXT: usize = 4;

impl ChoiceStream {
    fn text(&self, tokenizer: &dyn Tokenizer) -> String {
        detokenize(tokenizer, &self.tokens)
    }

    /// The text of every token so far, detokenizing only the tokens since the last settled
    /// text; the whole text again when the tokenizer's text of the tail does not extend that
    /// of its context (a tokenizer whose output is not a concatenation).
    fn text_so_far(&mut self, tokenizer: &dyn Tokenizer) -> String {
        let anchor = self.settled.saturating_sub(DETOKENIZE_CONTEXT);
        let context = detokenize(tokenizer, &self.tokens[anchor..self.settled]);
        let tail = detokenize(tokenizer, &self.tokens[anchor..]);
        let text = match tail.strip_prefix(&context) {
            Some(new) => format!("{}{new}", self.settled_text),
            None => self.text(tokenizer),
        };
        if !text.ends_with('\u{FFFD}') {
            self.settled_text.clone_from(&text);
            self.settled = self.tokens.len();
        }
        text
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

    /// What is certain of the text so far and not yet sent, and whether the completion has
    /// ended.
    fn advance(
        &mut self,
        tokenizer: &dyn Tokenizer,
        stop: &[String],
        max_tokens: usize,
    ) -> (Option<String>, bool) {
        let text = self.text_so_far(tokenizer);
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
        let mut sent = None;
        if end > self.sent && text.is_char_boundary(end) && text.is_char_boundary(self.sent) {
            sent = Some(text[self.sent..end].to_string());
            self.sent = end;
        }
        if ended {
            self.finish = Some(if stopped { "stop" } else { "length" });
        }
        (sent, ended)
    }

    /// The tokens not yet streamed whose text has now been sent whole, with their
    /// log-probabilities (and alternatives, `with_top`) and their offsets into the prompt and
    /// completion together (as the whole answer counts them, in characters).
    fn release(
        &mut self,
        tokenizer: &dyn Tokenizer,
        prompt: &[i64],
        with_top: bool,
    ) -> TokenLogprobs {
        // The most tokens whose text is whole (no character left unfinished) and sent; a
        // token holding part of a character goes with the chunk that completes it.
        let Some(whole) = (self.released + 1..=self.tokens.len()).rev().find(|&k| {
            let through = detokenize(tokenizer, &self.tokens[..k]);
            through.len() <= self.sent && !through.ends_with('\u{FFFD}')
        }) else {
            return TokenLogprobs {
                top_logprobs: with_top.then(Vec::new),
                ..Default::default()
            };
        };
        let sequence: Vec<i64> = prompt
            .iter()
            .chain(&self.tokens[..whole])
            .copied()
            .collect();
        let scores = (self.released..whole).map(|k| Some((self.logprobs[k], self.top.get(k))));
        let carried = token_logprobs(
            tokenizer,
            &sequence,
            prompt.len() + self.released,
            scores,
            with_top,
        );
        self.released = whole;
        carried
    }

    fn final_text(&self, tokenizer: &dyn Tokenizer, stop: &[String]) -> String {
        let text = self.text(tokenizer);
        let (end, _) = Self::cut(&text, stop);
        text[..end].to_string()
    }
}

/// `sequence[from..]` (ids of prompt and completion) in the legacy completions' format, given
/// each of those tokens' log-probability and most likely tokens (`None` for a sequence's first
/// token, which has no context); with `with_top`, the alternatives as texts.
fn token_logprobs<'a>(
    tokenizer: &dyn Tokenizer,
    sequence: &[i64],
    from: usize,
    scores: impl Iterator<Item = Option<(f32, Option<&'a TopTokens>)>>,
    with_top: bool,
) -> TokenLogprobs {
    let ids: Vec<u32> = sequence.iter().map(|&t| t as u32).collect();
    let text = |ids: &[u32]| tokenizer.detokenize(ids).unwrap_or_default();
    let mut run = TokenLogprobs {
        text_offset: text_offsets(&ids, from, text),
        top_logprobs: with_top.then(Vec::new),
        ..Default::default()
    };
    for (i, score) in (from..ids.len()).zip(scores) {
        run.tokens.push(text(&ids[i..=i]));
        run.token_logprobs.push(score.map(|(logprob, _)| logprob));
        if let Some(top) = &mut run.top_logprobs {
            top.push(
                score
                    .and_then(|(_, alternatives)| alternatives)
                    .map(|alternatives| {
                        alternatives
                            .iter()
                            .map(|&(id, logprob)| (text(&[id as u32]), logprob))
                            .collect()
                    }),
            );
        }
    }
    run
}

fn detokenize(tokenizer: &dyn Tokenizer, tokens: &[i64]) -> String {
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    tokenizer.detokenize(&ids).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_data::tokenizer::TokenizerError;

    /// A byte-level tokenizer (id = byte), like GPT-2's BPE at its finest: a character of
    /// several bytes spans several tokens, its text U+FFFD until the last one arrives.
    struct Bytes;

    impl Tokenizer for Bytes {
        fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
            out.extend(text.bytes().map(u32::from));
            Ok(())
        }
        fn vocab_size(&self) -> usize {
            256
        }
        fn eod(&self) -> Option<u32> {
            None
        }
        fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
            let bytes: Vec<u8> = ids.iter().map(|&id| id as u8).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }
    }

    #[test]
    fn streamed_text_is_the_text_of_all_tokens_detokenized_a_few_at_a_time() {
        let text = "héllo wörld ✓ — “quoted” 😀 end";
        let ids = Bytes.tokenize(text).unwrap();
        let stop = vec!["qu".to_string()];
        let mut stream = ChoiceStream::default();
        let mut streamed = String::new();
        for (n, &id) in ids.iter().enumerate() {
            stream.tokens.push(i64::from(id));
            let so_far = stream.text_so_far(&Bytes);
            assert_eq!(so_far, stream.text(&Bytes), "after {} tokens", n + 1);
            // Only the last few tokens are detokenized again.
            assert!(stream.settled + 4 >= stream.tokens.len());
            let (sent, ended) = stream.advance(&Bytes, &stop, usize::MAX);
            streamed.push_str(&sent.unwrap_or_default());
            if ended {
                break;
            }
        }
        assert_eq!(streamed, "héllo wörld ✓ — “");
        assert_eq!(stream.final_text(&Bytes, &stop), streamed);
    }

    #[test]
    fn streamed_chunks_carry_the_tokens_their_text_completes() {
        let prompt: Vec<i64> = "ab ".bytes().map(i64::from).collect();
        let ids: Vec<i64> = "héllo “wörld”".bytes().map(i64::from).collect();
        let mut stream = ChoiceStream::default();
        let mut carried = TokenLogprobs::default();
        for (n, &id) in ids.iter().enumerate() {
            stream.tokens.push(id);
            stream.logprobs.push(-(n as f32));
            stream
                .top
                .push(vec![(i64::from(b'x'), -0.5), (id, -(n as f32))]);
            let before = stream.released;
            let (sent, _) = stream.advance(&Bytes, &[], usize::MAX);
            let Some(text) = sent else {
                continue;
            };
            let chunk = stream.release(&Bytes, &prompt, true);
            // A chunk carries exactly the tokens whose bytes are its text.
            let bytes: Vec<u8> = ids[before..stream.released]
                .iter()
                .map(|&b| b as u8)
                .collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text);
            let top = chunk.top_logprobs.unwrap();
            assert_eq!(top.len(), chunk.tokens.len());
            carried.tokens.extend(chunk.tokens);
            carried.token_logprobs.extend(chunk.token_logprobs);
            carried.text_offset.extend(chunk.text_offset);
            carried
                .top_logprobs
                .get_or_insert_with(Vec::new)
                .extend(top);
        }
        assert_eq!(stream.released, ids.len());
        let all: Vec<Option<f32>> = (0..ids.len()).map(|n| Some(-(n as f32))).collect();
        assert_eq!(carried.token_logprobs, all);
        // Each token's alternatives, as texts, stay with it.
        for (n, alternatives) in carried.top_logprobs.unwrap().into_iter().enumerate() {
            let own = Bytes.detokenize(&[ids[n] as u32]).unwrap();
            assert_eq!(
                alternatives,
                Some(vec![("x".into(), -0.5), (own, -(n as f32))])
            );
        }
        // The offsets the whole answer gives its tokens.
        let sequence: Vec<u32> = prompt.iter().chain(&ids).map(|&t| t as u32).collect();
        let offsets = text_offsets(&sequence, prompt.len(), |prefix| {
            Bytes.detokenize(prefix).unwrap()
        });
        assert_eq!(carried.text_offset, offsets);
    }
}
