//! Megatron's text generation (spec §6.3) as continuous batching over a paged KV cache: each
//! prompt a row with its own sampling, random stream, stop condition and log-probabilities
//! (prompt and generated tokens), prefilled in chunks and then decoded one token per step
//! together with every other running row. A Megatron request of several prompts is a group of
//! rows with one length budget.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::causal_lm::CausalLm;
use super::decoder::{DecodeRow, Decoder, PrefillChunk};
use super::in_flight::{Draw, Drawn, DrawnTokens, InFlight};
use super::sampling::{row_seed, LogitAdjust, RowSampling, Sampling};
use super::top_tokens::{listed, most_likely, TopTokens};
use megatron_models::layers::{PagedKvCache, BLOCK_SIZE};

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
    /// The most likely tokens (this many) at every position `logprobs` scores, with theirs
    /// (OpenAI's `top_logprobs`); 0: none.
    pub top_logprobs: usize,
    /// Pads rows beyond their prompt until they are generated.
    pub pad: i64,
    /// OpenAI's penalties and logit bias.
    pub adjust: LogitAdjust,
}

/// What came out: every row's tokens (prompt included) up to its length, with `logprobs` the
/// log-probability of each token after the first under the model (raw logits), and with
/// `top_logprobs` the most likely tokens at each of those positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub tokens: Vec<Vec<i64>>,
    pub logprobs: Option<Vec<Vec<f32>>>,
    pub top_logprobs: Option<Vec<Vec<TopTokens>>>,
}

/// A row's new token as an observer sees it, with the row's log-probabilities so far
/// (prompt included) when it keeps them.
#[derive(Debug, Clone, Copy)]
pub struct NewToken<'a> {
    pub request: u64,
    /// The row's index in its request.
    pub row: usize,
    pub token: i64,
    /// Of every token after the first, the new one last; empty unless the row keeps them.
    pub logprobs: &'a [f32],
    /// The most likely tokens at each of those positions; empty unless the row asks.
    pub top_logprobs: &'a [TopTokens],
}

/// Runs the loop on `model`'s device through `decoder`; the rows' random streams are seeded
/// from libtorch's default CPU generator (`tch::manual_seed`).
pub fn generate_tokens<M: CausalLm + ?Sized>(
    model: &M,
    request: &GenerationRequest,
    decoder: &mut Decoder,
) -> Result<Generation> {
    generate_tokens_observed(model, request, decoder, None)
}

/// Sees each token as it is generated: `(row, token)` for every row still going; answering
/// `true` ends that row there (its length includes the token).
pub type TokenObserver<'a> = &'a mut dyn FnMut(usize, i64) -> bool;

/// [`generate_tokens`], telling `observer` every new token (streaming answers).
pub fn generate_tokens_observed<M: CausalLm + ?Sized>(
    model: &M,
    request: &GenerationRequest,
    decoder: &mut Decoder,
    mut observer: Option<TokenObserver>,
) -> Result<Generation> {
    let seed = Tensor::randint(i64::MAX, [1], (Kind::Int64, Device::Cpu)).int64_value(&[0]);
    let rows = request.rows(seed as u64)?;
    if request.tokens_to_generate == 0 {
        return score_request(model, request);
    }
    let limits = BatchLimits {
        max_batch_size: rows.len(),
        prefill_chunk: DEFAULT_PREFILL_CHUNK,
        max_queued: 1,
    };
    let mut batcher = Batcher::new(limits);
    batcher
        .submit(model, decoder, 0, rows)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut observe = |new: &NewToken| observer.as_mut().is_some_and(|o| o(new.row, new.token));
    loop {
        match batcher.step(model, decoder, &mut observe) {
            Ok(mut finished) => {
                if let Some((_, generation)) = finished.pop() {
                    return Ok(generation);
                }
            }
            Err(e) => {
                // The rows' blocks are lost with the batcher: start the cache afresh.
                decoder.reset();
                return Err(e);
            }
        }
    }
}

impl GenerationRequest {
    /// The rows of Megatron's batched loop, each on its own: every row may reach the longest
    /// prompt plus `tokens_to_generate` positions, and its nucleus has decayed once per step
    /// of the loop before its first token. Row `i` draws from `row_seed(seed, i)`.
    pub fn rows(&self, seed: u64) -> Result<Vec<RowSpec>> {
        self.sampled_rows(seed, 1)
    }

    /// [`Self::rows`] with `samples` rows per prompt (OpenAI's `n` and `best_of`): row
    /// `p · samples + j` is sample `j` of prompt `p` and draws from `row_seed(seed, p · samples
    /// + j)`; samples after the first share the first's prefill and its full KV-cache blocks.
    pub fn sampled_rows(&self, seed: u64, samples: usize) -> Result<Vec<RowSpec>> {
        ensure!(samples >= 1, "a prompt needs at least one sample");
        self.sampling.validate()?;
        ensure!(!self.prompts.is_empty(), "no prompts to continue");
        ensure!(
            self.prompts.iter().all(|p| !p.is_empty()),
            "every prompt needs at least one token"
        );
        let shortest = self.prompts.iter().map(Vec::len).min().unwrap_or(0);
        let longest = self.prompts.iter().map(Vec::len).max().unwrap_or(0);
        Ok(self
            .prompts
            .iter()
            .flat_map(|prompt| std::iter::repeat_n(prompt, samples).enumerate())
            .enumerate()
            .map(|(row, (sample, prompt))| RowSpec {
                prompt: prompt.clone(),
                total: longest + self.tokens_to_generate,
                sampling: self.sampling,
                decays: prompt.len() - shortest,
                seed: row_seed(seed, row),
                stop: self.stop,
                prevent_newline_after_colon: self.prevent_newline_after_colon,
                logprobs: self.logprobs,
                top_logprobs: self.top_logprobs,
                adjust: self.adjust.clone(),
                fork_of: (sample > 0).then(|| row - sample),
            })
            .collect())
    }
}

/// Prompt positions prefilled per step unless told otherwise: long prompts are cut into chunks
/// so that the rows already decoding wait at most one chunk per step.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// One sequence to continue, with everything that decides its tokens.
#[derive(Debug, Clone)]
pub struct RowSpec {
    pub prompt: Vec<i64>,
    /// Positions the row may reach, its prompt included.
    pub total: usize,
    pub sampling: Sampling,
    /// Times its nucleus has decayed before its first token.
    pub decays: usize,
    /// Its random stream.
    pub seed: u64,
    pub stop: StopCondition,
    pub prevent_newline_after_colon: Option<(i64, i64)>,
    pub logprobs: bool,
    /// The most likely tokens (this many) with theirs at every position `logprobs` scores.
    pub top_logprobs: usize,
    /// Added to its logits before each draw.
    pub adjust: LogitAdjust,
    /// The row of its request (before it) whose prefill and full prompt blocks it shares: its
    /// prompt is the same. Its first token is drawn from that row's last prefill logits.
    pub fork_of: Option<usize>,
}

/// How much a [`Batcher`] takes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Rows decoded together at most (a request with more prompts runs alone).
    pub max_batch_size: usize,
    /// Prompt positions prefilled per step (at least one chunk).
    pub prefill_chunk: usize,
    /// Requests that may wait for room; more are refused.
    pub max_queued: usize,
}

/// Why a request was not taken.
#[derive(Debug)]
pub enum Refusal {
    /// The queue is full: try again later.
    Busy(String),
    /// The request can never fit the KV cache or the limits.
    TooLarge(String),
    /// Making the KV cache failed.
    Failed(anyhow::Error),
}

impl Refusal {
    /// The queue of `max_queued` waiting requests is full.
    pub fn busy(max_queued: usize) -> Self {
        Refusal::Busy(format!(
            "the server is busy ({max_queued} requests are waiting); try again later"
        ))
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Busy(text) | Refusal::TooLarge(text) => f.write_str(text),
            Refusal::Failed(e) => write!(f, "{e:#}"),
        }
    }
}

/// What the KV cache holds now, in blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUse {
    pub used_blocks: i64,
    pub total_blocks: i64,
    /// The most blocks ever used at once.
    pub peak_blocks: i64,
    pub running_rows: usize,
    /// The most rows ever decoded together.
    pub peak_rows: usize,
    pub waiting_requests: usize,
    /// Steps run so far.
    pub steps: u64,
    /// Decode steps queued before the tokens of the step before them were read.
    pub steps_ahead: u64,
    /// Prompt positions prefilled so far (a prompt's samples share one prefill).
    pub prefilled_positions: u64,
}

/// Continuous batching: requests wait in a queue, join the running batch at a step boundary
/// when the KV cache has blocks for their rows' whole length, get their prompts prefilled in
/// chunks, decode one token per step together with every other row, and leave — their blocks
/// freed — as soon as their last row stops. Each row samples from its own settings and random
/// stream, so its tokens do not depend on the rows beside it. A decode step is queued on the
/// device and read at the next step, after the step that follows it was queued when it could be
/// (see [`super::in_flight`]) when the decoder's settings allow it
/// ([`super::DecodeSettings::overlap`]).
pub struct Batcher {
    limits: BatchLimits,
    waiting: VecDeque<Waiting>,
    running: Vec<Row>,
    requests: HashMap<u64, Progress>,
    use_: CacheUse,
    /// The decode step queued and not read yet.
    in_flight: Option<InFlight>,
    next_row: u64,
}

struct Waiting {
    id: u64,
    rows: Vec<RowSpec>,
    blocks: i64,
}

struct Row {
    /// Unique among the batcher's rows.
    id: u64,
    request: u64,
    index: usize,
    spec: RowSpec,
    tokens: Vec<i64>,
    /// Positions whose keys and values are in the cache.
    cached: usize,
    blocks: Vec<i64>,
    logprobs: Vec<f32>,
    /// With `spec.top_logprobs`, the most likely tokens where `logprobs` has a value.
    top: Vec<TopTokens>,
    sampling: Sampling,
    draws: u64,
    /// The id of the row whose prefill it waits for, to share its prompt's keys and values.
    forks_from: Option<u64>,
}

/// A request's rows as they finish.
struct Progress {
    rows: Vec<Option<Finished>>,
    remaining: usize,
    logprobs: bool,
    top_logprobs: bool,
}

/// A finished row: its tokens, and their log-probabilities and alternatives when kept.
#[derive(Clone)]
struct Finished {
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    top: Vec<TopTokens>,
}

impl Batcher {
    pub fn new(limits: BatchLimits) -> Self {
        Batcher {
            limits,
            waiting: VecDeque::new(),
            running: Vec::new(),
            requests: HashMap::new(),
            use_: CacheUse::default(),
            in_flight: None,
            next_row: 0,
        }
    }

    /// Queues request `id` (its rows are admitted together), or says why not.
    pub fn submit<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        decoder: &mut Decoder,
        id: u64,
        rows: Vec<RowSpec>,
    ) -> Result<(), Refusal> {
        let positions = model.max_positions() as usize;
        if let Some(row) = rows
            .iter()
            .find(|r| r.total > positions || r.prompt.is_empty())
        {
            return Err(Refusal::TooLarge(format!(
                "a row of {} positions (prompt {}) does not fit the model's {positions}",
                row.total,
                row.prompt.len()
            )));
        }
        if let Some((index, row)) = rows.iter().enumerate().find(|(i, r)| {
            r.fork_of
                .is_some_and(|of| of >= *i || rows[of].prompt != r.prompt)
        }) {
            return Err(Refusal::Failed(anyhow::anyhow!(
                "row {index} forks from {:?}, not an earlier row of the same prompt",
                row.fork_of
            )));
        }
        let blocks: i64 = rows.iter().map(own_blocks).sum();
        let rows_for = self.limits.max_batch_size.max(rows.len()) as i64;
        let cache = decoder
            .cache(model, rows_for, self.running.is_empty())
            .map_err(Refusal::Failed)?;
        self.use_.total_blocks = cache.usable_blocks();
        if blocks > cache.usable_blocks() {
            return Err(Refusal::TooLarge(format!(
                "the request needs {} KV cache positions but the cache holds {} (--kv-cache-gb)",
                blocks * BLOCK_SIZE,
                cache.usable_blocks() * BLOCK_SIZE
            )));
        }
        self.requests.insert(
            id,
            Progress {
                rows: vec![None; rows.len()],
                remaining: rows.len(),
                logprobs: rows.iter().any(|r| r.logprobs),
                top_logprobs: rows.iter().any(|r| r.top_logprobs > 0),
            },
        );
        self.waiting.push_back(Waiting { id, rows, blocks });
        // Taken at once when there is room; otherwise it waits, if the queue has room.
        self.admit(decoder);
        if self.waiting.len() > self.limits.max_queued {
            self.waiting.pop_back();
            self.requests.remove(&id);
            return Err(Refusal::busy(self.limits.max_queued));
        }
        self.refresh_use(decoder);
        Ok(())
    }

    /// Whether there is nothing to run.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn cache_use(&self) -> CacheUse {
        self.use_
    }

    /// Drops request `id`, waiting or running, and frees its blocks; `false` when unknown.
    pub fn cancel(&mut self, decoder: &mut Decoder, id: u64) -> bool {
        let known = self.requests.remove(&id).is_some();
        self.waiting.retain(|w| w.id != id);
        let (gone, kept): (Vec<Row>, Vec<Row>) =
            self.running.drain(..).partition(|r| r.request == id);
        self.running = kept;
        if let Some(cache) = decoder.existing_cache() {
            for row in gone {
                cache.release(row.blocks);
            }
        }
        self.forget_orphaned_step();
        self.refresh_use(decoder);
        known
    }

    /// Drops the queued step once none of its rows is running: nobody reads it.
    fn forget_orphaned_step(&mut self) {
        if self.running.is_empty() {
            self.in_flight = None;
        }
    }

    /// Drops every request (after a failed step) and frees their blocks.
    pub fn clear(&mut self, decoder: &mut Decoder) {
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        for id in ids {
            self.cancel(decoder, id);
        }
    }

    /// Ids of the requests queued or running.
    pub fn request_ids(&self) -> Vec<u64> {
        self.requests.keys().copied().collect()
    }

    fn refresh_use(&mut self, decoder: &mut Decoder) {
        if let Some(cache) = decoder.existing_cache() {
            self.use_.total_blocks = cache.usable_blocks();
            self.use_.used_blocks = cache.usable_blocks() - cache.free_blocks();
            self.use_.peak_blocks = self.use_.peak_blocks.max(self.use_.used_blocks);
        }
        self.use_.running_rows = self.running.len();
        self.use_.peak_rows = self.use_.peak_rows.max(self.running.len());
        self.use_.waiting_requests = self.waiting.len();
    }

    /// Takes waiting requests, in order, while their rows fit the batch and the cache.
    fn admit(&mut self, decoder: &mut Decoder) {
        while self.front_fits(decoder) {
            let cache = decoder.existing_cache().expect("a request fits the cache");
            let waiting = self.waiting.pop_front().expect("a front");
            let first = self.running.len();
            for (index, spec) in waiting.rows.into_iter().enumerate() {
                let mut blocks = Vec::new();
                let mut forks_from = None;
                if let Some(of) = spec.fork_of {
                    // The prompt's full blocks, which its prefill fills and nothing writes
                    // again, are the other row's.
                    let leader = &self.running[first + of];
                    let shared = &leader.blocks[..full_prompt_blocks(&spec)];
                    cache.share(shared);
                    blocks.extend_from_slice(shared);
                    forks_from = Some(leader.id);
                }
                blocks.extend(
                    cache
                        .allocate(own_blocks(&spec))
                        .expect("the request's blocks were counted free"),
                );
                let mut sampling = spec.sampling;
                for _ in 0..spec.decays {
                    sampling = sampling.decayed();
                }
                self.next_row += 1;
                self.running.push(Row {
                    id: self.next_row,
                    request: waiting.id,
                    index,
                    tokens: spec.prompt.clone(),
                    spec,
                    cached: 0,
                    blocks,
                    logprobs: Vec::new(),
                    top: Vec::new(),
                    sampling,
                    draws: 0,
                    forks_from,
                });
            }
        }
    }

    /// One step: reads the decode step queued at the previous one (queuing the next first when
    /// nothing joined, see [`Self::continuing`]); unless it queued the next, admits what fits,
    /// prefills up to a chunk budget of prompt positions and queues a decode step of every row
    /// past its prompt. Returns the requests that finished. `observer` sees every new token
    /// (with the row's log-probabilities when it keeps them); `true` ends that row there.
    pub fn step<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        decoder: &mut Decoder,
        observer: &mut dyn FnMut(&NewToken) -> bool,
    ) -> Result<Vec<(u64, Generation)>> {
        let mut finished = Vec::new();
        if let Some(flight) = self.in_flight.take() {
            if let Some(kept) = self.continuing(&flight, decoder) {
                let blocks: Vec<&[i64]> = kept
                    .iter()
                    .map(|&(i, _)| &self.running[i].blocks[..])
                    .collect();
                let kept: Vec<usize> = kept.iter().map(|&(_, k)| k).collect();
                self.in_flight = Some(flight.queue_next(model, decoder, &kept, &blocks)?);
                self.use_.steps += 1;
                self.use_.steps_ahead += 1;
            }
            let mut ended = Vec::new();
            self.land(flight, observer, &mut ended)?;
            finished = self.retire(ended, decoder);
        }
        if self.in_flight.is_none() && !self.is_idle() {
            finished.extend(self.start_step(model, decoder, observer)?);
        }
        self.forget_orphaned_step();
        self.refresh_use(decoder);
        Ok(finished)
    }

    /// The rows of the step after `flight` when it can be queued before `flight`'s tokens are
    /// read, as (running index, index in `flight`) pairs: nothing joined since (every running
    /// row is in `flight`, so no prompt waits for its prefill), no waiting request fits now,
    /// and none of the rows bans a token after the one `flight` draws or is penalised for it.
    /// It runs them one position on, but for those that reach their length at `flight`; rows
    /// that stop there otherwise (a stop token or sequence) waste their slot of it. `None` also
    /// when no row is left.
    fn continuing(&self, flight: &InFlight, decoder: &mut Decoder) -> Option<Vec<(usize, usize)>> {
        let banning = self.running.iter().any(|row| {
            row.spec.prevent_newline_after_colon.is_some() || row.spec.adjust.penalises()
        });
        if !decoder.overlap() || banning || self.front_fits(decoder) {
            return None;
        }
        // Rows keep their order, so the running rows are the flight's still running, in its
        // order; a row the walk does not find there joined since.
        let mut in_flight = flight.rows.iter().enumerate();
        let mut kept = Vec::new();
        for (i, row) in self.running.iter().enumerate() {
            let (k, _) = in_flight.find(|&(_, &id)| id == row.id)?;
            if row.tokens.len() + 1 < row.spec.total {
                kept.push((i, k));
            }
        }
        (!kept.is_empty()).then_some(kept)
    }

    /// Whether the first waiting request would be admitted now.
    fn front_fits(&self, decoder: &mut Decoder) -> bool {
        let (Some(front), Some(cache)) = (self.waiting.front(), decoder.existing_cache()) else {
            return false;
        };
        let crowded = !self.running.is_empty()
            && self.running.len() + front.rows.len() > self.limits.max_batch_size;
        !crowded && cache.free_blocks() >= front.blocks
    }

    /// Gives `flight`'s tokens to its rows still running, adding those that stop to `ended`.
    fn land(
        &mut self,
        flight: InFlight,
        observer: &mut dyn FnMut(&NewToken) -> bool,
        ended: &mut Vec<usize>,
    ) -> Result<()> {
        let drawn = flight.drawn.read()?;
        let at: HashMap<u64, usize> = self
            .running
            .iter()
            .enumerate()
            .map(|(i, row)| (row.id, i))
            .collect();
        for (k, id) in flight.rows.iter().enumerate() {
            // Rows cancelled since the step was queued are gone.
            let Some(&i) = at.get(id) else {
                continue;
            };
            self.running[i].cached += 1;
            self.accept(i, &drawn, k, observer, ended);
        }
        Ok(())
    }

    /// A step after a read one (or none): admits what fits, prefills up to a chunk budget of
    /// prompt positions, and queues a decode step of every row past its prompt.
    fn start_step<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        decoder: &mut Decoder,
        observer: &mut dyn FnMut(&NewToken) -> bool,
    ) -> Result<Vec<(u64, Generation)>> {
        self.admit(decoder);
        self.use_.steps += 1;
        self.refresh_use(decoder);
        let chunk = self.limits.prefill_chunk.max(1);
        // Rows decoding this step: those whose last token has no keys and values yet (rows
        // finishing their prompt now draw their first token from the prefill).
        let ready: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let row = &self.running[i];
                row.cached >= row.spec.prompt.len() && row.cached + 1 == row.tokens.len()
            })
            .collect();
        let mut ended = Vec::new();
        // First tokens are drawn, and streamed, before the decode step is queued.
        let (mut prefilled, mut logits) =
            tch::no_grad(|| self.prefill_step(model, decoder, chunk))?;
        self.fork(decoder, &mut prefilled, &mut logits);
        if !prefilled.is_empty() {
            self.take_tokens(&prefilled, &logits, observer, &mut ended)?;
        }
        if !ready.is_empty() {
            let rows: Vec<DecodeRow> = ready
                .iter()
                .map(|&i| {
                    let row = &self.running[i];
                    DecodeRow {
                        token: row.tokens[row.cached],
                        position: row.cached as i64,
                        blocks: &row.blocks,
                    }
                })
                .collect();
            let ids = ready.iter().map(|&i| self.running[i].id).collect();
            let draws = ready.iter().map(|&i| self.running[i].draw()).collect();
            self.in_flight = Some(InFlight::queue(model, decoder, ids, &rows, draws)?);
        }
        Ok(self.retire(ended, decoder))
    }

    /// The rows waiting to share the prefill of a row in `prefilled` (running indices, with
    /// their last prefill `logits`) take it: the keys and values of its prompt's last, partly
    /// filled block are copied into theirs (its full blocks they already share), and they join
    /// `prefilled` with the same logits, to draw their first tokens from them.
    fn fork(
        &mut self,
        decoder: &mut Decoder,
        prefilled: &mut Vec<usize>,
        logits: &mut Vec<Tensor>,
    ) {
        for k in 0..prefilled.len() {
            let leader = &self.running[prefilled[k]];
            let (id, length) = (leader.id, leader.spec.prompt.len());
            let partial = (length as i64 % BLOCK_SIZE != 0)
                .then(|| leader.blocks[full_prompt_blocks(&leader.spec)]);
            let (prompt_logprobs, prompt_top) = (leader.logprobs.clone(), leader.top.clone());
            for j in 0..self.running.len() {
                if self.running[j].forks_from != Some(id) {
                    continue;
                }
                let row = &mut self.running[j];
                if let (Some(from), Some(cache)) = (partial, decoder.existing_cache()) {
                    cache.copy_block(from, row.blocks[full_prompt_blocks(&row.spec)]);
                }
                row.forks_from = None;
                row.cached = length;
                if row.spec.logprobs {
                    row.logprobs.clone_from(&prompt_logprobs);
                }
                if row.spec.top_logprobs > 0 {
                    row.top.clone_from(&prompt_top);
                }
                prefilled.push(j);
                logits.push(logits[k].shallow_clone());
            }
        }
    }

    /// Removes the rows `ended` (running indices), freeing their blocks, and returns the
    /// requests whose last row this was.
    fn retire(&mut self, mut ended: Vec<usize>, decoder: &mut Decoder) -> Vec<(u64, Generation)> {
        let mut finished = Vec::new();
        // Highest index first, so the others keep their places while removed; the rest keep
        // their admission order, which is the order their prompts are prefilled in (a later
        // request never overtakes an earlier one's first token).
        ended.sort_unstable_by(|a, b| b.cmp(a));
        for i in ended {
            let row = self.running.remove(i);
            if let Some(cache) = decoder.existing_cache() {
                cache.release(row.blocks);
            }
            let Some(progress) = self.requests.get_mut(&row.request) else {
                continue;
            };
            let (mut logprobs, mut top) = (row.logprobs, row.top);
            logprobs.truncate(row.tokens.len() - 1);
            top.truncate(row.tokens.len() - 1);
            progress.rows[row.index] = Some(Finished {
                tokens: row.tokens,
                logprobs,
                top,
            });
            progress.remaining -= 1;
            if progress.remaining == 0 {
                let progress = self.requests.remove(&row.request).expect("present");
                let rows: Vec<Finished> = progress
                    .rows
                    .into_iter()
                    .map(|r| r.expect("every row finished"))
                    .collect();
                let (mut tokens, mut logprobs, mut top) = (Vec::new(), Vec::new(), Vec::new());
                for row in rows {
                    tokens.push(row.tokens);
                    logprobs.push(row.logprobs);
                    top.push(row.top);
                }
                finished.push((
                    row.request,
                    Generation {
                        tokens,
                        logprobs: progress.logprobs.then_some(logprobs),
                        top_logprobs: progress.top_logprobs.then_some(top),
                    },
                ));
            }
        }
        finished
    }

    /// Prefills up to a chunk budget of prompt positions, in admission order, in one forward:
    /// the rows whose prompt is now complete and their last position's logits (`[1, vocab]`
    /// each, float). Chunks start at multiples of the chunk size, whatever else runs, so a
    /// row's prefill is the same alone and in a batch; the step takes at least one chunk.
    fn prefill_step<M: CausalLm + ?Sized>(
        &mut self,
        model: &M,
        decoder: &mut Decoder,
        chunk: usize,
    ) -> Result<(Vec<usize>, Vec<Tensor>)> {
        let vocab = model.vocab_size();
        let (mut prefilled, mut logits) = (Vec::new(), Vec::new());
        let mut budget = chunk;
        let mut pieces: Vec<(usize, usize)> = Vec::new();
        for (i, row) in self.running.iter().enumerate() {
            let length = row.spec.prompt.len();
            if budget == 0 || row.cached >= length || row.forks_from.is_some() {
                continue;
            }
            let count = (chunk - row.cached % chunk).min(length - row.cached);
            if !pieces.is_empty() && count > budget {
                break;
            }
            budget = budget.saturating_sub(count);
            pieces.push((i, count));
        }
        if pieces.is_empty() {
            return Ok((prefilled, logits));
        }
        let chunks: Vec<PrefillChunk> = pieces
            .iter()
            .map(|&(i, count)| {
                let row = &self.running[i];
                PrefillChunk {
                    tokens: &row.tokens[row.cached..row.cached + count],
                    start: row.cached as i64,
                    blocks: &row.blocks,
                }
            })
            .collect();
        let outs = decoder.prefill(model, &chunks)?;
        for (&(i, count), out) in pieces.iter().zip(outs) {
            let row = &mut self.running[i];
            let length = row.spec.prompt.len();
            let out = out.narrow(1, 0, vocab);
            if row.spec.logprobs || row.spec.top_logprobs > 0 {
                let targets = (length - 1).min(row.cached + count) - row.cached;
                if targets > 0 {
                    let next = &row.tokens[row.cached + 1..row.cached + 1 + targets];
                    let next = Tensor::from_slice(next)
                        .to_device(out.device())
                        .unsqueeze(1);
                    let log_probs = out
                        .narrow(0, 0, targets as i64)
                        .to_kind(Kind::Float)
                        .log_softmax(1, Kind::Float);
                    let scores = log_probs.gather(1, &next, false).squeeze_dim(1);
                    row.logprobs
                        .extend(Vec::<f32>::try_from(scores.to_device(Device::Cpu))?);
                    if row.spec.top_logprobs > 0 {
                        let (values, ids) = most_likely(&log_probs, row.spec.top_logprobs);
                        row.top.extend(listed(
                            &values.to_device(Device::Cpu),
                            &ids.to_device(Device::Cpu),
                            &vec![row.spec.top_logprobs; targets],
                        )?);
                    }
                }
            }
            row.cached += count;
            self.use_.prefilled_positions += count as u64;
            if row.cached == length {
                prefilled.push(i);
                logits.push(
                    out.select(0, count as i64 - 1)
                        .to_kind(Kind::Float)
                        .unsqueeze(0),
                );
            }
        }
        Ok((prefilled, logits))
    }

    /// Draws a token for each of the rows `drawing` from their `logits` (`[n, vocab]` pieces
    /// in that order), shows it to `observer`, and adds the rows that stop to `ended`.
    fn take_tokens(
        &mut self,
        drawing: &[usize],
        logits: &[Tensor],
        observer: &mut dyn FnMut(&NewToken) -> bool,
        ended: &mut Vec<usize>,
    ) -> Result<()> {
        let logits = match logits {
            [one] => one.shallow_clone(),
            _ => Tensor::cat(logits, 0),
        };
        let draws: Vec<Draw> = drawing.iter().map(|&i| self.running[i].draw()).collect();
        let drawn = tch::no_grad(|| Drawn::new(&logits, &draws))?.read()?;
        for (k, &i) in drawing.iter().enumerate() {
            self.accept(i, &drawn, k, observer, ended);
        }
        Ok(())
    }

    /// Appends the `k`th of `drawn`'s tokens (with its log-probability and alternatives when
    /// the row keeps them) to running row `i`, shows it to `observer`, and adds the row to
    /// `ended` when it stops there.
    fn accept(
        &mut self,
        i: usize,
        drawn: &DrawnTokens,
        k: usize,
        observer: &mut dyn FnMut(&NewToken) -> bool,
        ended: &mut Vec<usize>,
    ) {
        let row = &mut self.running[i];
        let token = drawn.tokens[k];
        let before = *row.tokens.last().expect("rows have tokens");
        row.tokens.push(token);
        row.draws += 1;
        row.sampling = row.sampling.decayed();
        if let (true, Some(scores)) = (row.spec.logprobs, &drawn.scores) {
            row.logprobs.push(scores[k]);
        }
        if row.spec.top_logprobs > 0 {
            row.top.push(drawn.top[k].clone());
        }
        let stopped = stops(&row.spec.stop, token, before);
        let told = observer(&NewToken {
            request: row.request,
            row: row.index,
            token,
            logprobs: &row.logprobs,
            top_logprobs: &row.top,
        });
        if stopped || told || row.tokens.len() >= row.spec.total {
            ended.push(i);
        }
    }
}

impl Row {
    /// How the row draws its next token.
    fn draw(&self) -> Draw {
        let banned = self
            .spec
            .prevent_newline_after_colon
            .and_then(|(colon, newline)| (self.tokens.last() == Some(&colon)).then_some(newline));
        Draw {
            sampling: RowSampling {
                sampling: self.sampling,
                seed: self.spec.seed,
                draws: self.draws,
            },
            logprobs: self.spec.logprobs,
            top_logprobs: self.spec.top_logprobs,
            banned,
            adjust: (!self.spec.adjust.is_none()).then(|| {
                Arc::new(
                    self.spec
                        .adjust
                        .deltas(&self.tokens[self.spec.prompt.len()..]),
                )
            }),
        }
    }
}

/// The whole request scored (`tokens_to_generate = 0`).
fn score_request<M: CausalLm + ?Sized>(
    model: &M,
    request: &GenerationRequest,
) -> Result<Generation> {
    let device = model.device();
    let lengths: Vec<i64> = request.prompts.iter().map(|p| p.len() as i64).collect();
    let max_len = *lengths.iter().max().expect("prompts");
    let batch = request.prompts.len() as i64;
    let mut padded = vec![request.pad; (batch * max_len) as usize];
    for (row, prompt) in request.prompts.iter().enumerate() {
        padded[row * max_len as usize..][..prompt.len()].copy_from_slice(prompt);
    }
    let tokens = Tensor::from_slice(&padded)
        .view([batch, max_len])
        .to_device(device);
    tch::no_grad(|| score_prompts(model, &tokens, &lengths, request.top_logprobs))
}

/// The blocks a row's prompt fills whole: those a row forking from it shares.
fn full_prompt_blocks(spec: &RowSpec) -> usize {
    spec.prompt.len() / BLOCK_SIZE as usize
}

/// The blocks a row takes of its own: all it needs, but for those it shares.
fn own_blocks(spec: &RowSpec) -> i64 {
    let all = PagedKvCache::blocks_for(spec.total as i64);
    match spec.fork_of {
        Some(_) => all - full_prompt_blocks(spec) as i64,
        None => all,
    }
}

/// Whether `token` (after `before`) ends its row.
fn stops(stop: &StopCondition, token: i64, before: i64) -> bool {
    match *stop {
        StopCondition::Never => false,
        StopCondition::Token(termination) => token == termination,
        StopCondition::EndOfLine {
            newline,
            double_newline,
        } => token == double_newline || token == newline,
        StopCondition::DoubleEndOfLine {
            newline,
            double_newline,
        } => token == double_newline || (token == newline && before == newline),
    }
}

/// `tokens_to_generate = 0`: one forward over the prompts (`[batch, longest]`, padded), scoring
/// every token after the first, with its `top_logprobs` most likely tokens when asked.
fn score_prompts<M: CausalLm + ?Sized>(
    model: &M,
    tokens: &Tensor,
    lengths: &[i64],
    top_logprobs: usize,
) -> Result<Generation> {
    let (batch, max_len) = (tokens.size()[0], tokens.size()[1]);
    let mut cache = model.new_kv_cache(batch, max_len)?;
    let vocab = model.vocab_size();
    let logits = model
        .forward_cached(tokens, &mut cache)?
        .transpose(0, 1)
        .narrow(2, 0, vocab);
    let targets = tokens.narrow(1, 1, max_len - 1).unsqueeze(2);
    let log_probs = logits.narrow(1, 0, max_len - 1).log_softmax(2, Kind::Float);
    let logprobs = log_probs
        .gather(2, &targets, false)
        .squeeze_dim(2)
        .to_device(Device::Cpu);
    let host = tokens.to_device(Device::Cpu);
    let mut rows = Vec::with_capacity(lengths.len());
    let mut scores = Vec::with_capacity(lengths.len());
    let mut tops = Vec::with_capacity(lengths.len());
    for (row, &length) in lengths.iter().enumerate() {
        let row = row as i64;
        rows.push(Vec::<i64>::try_from(host.get(row).narrow(0, 0, length))?);
        scores.push(Vec::<f32>::try_from(logprobs.get(row).narrow(
            0,
            0,
            length - 1,
        ))?);
        if top_logprobs > 0 && length > 1 {
            let (values, ids) =
                most_likely(&log_probs.get(row).narrow(0, 0, length - 1), top_logprobs);
            tops.push(listed(
                &values.to_device(Device::Cpu),
                &ids.to_device(Device::Cpu),
                &vec![top_logprobs; length as usize - 1],
            )?);
        } else {
            tops.push(Vec::new());
        }
    }
    Ok(Generation {
        tokens: rows,
        logprobs: Some(scores),
        top_logprobs: (top_logprobs > 0).then_some(tops),
    })
}
