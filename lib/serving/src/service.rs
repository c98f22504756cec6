//! A validated `/api` request in, Megatron's response out (spec §6.2–6.3): tokenization with
//! `add_BOS`, the length limits, sampling or beam search, and `text`/`segments`/`logprobs`
//! (or `scores`) built from the tokens; OpenAI completions likewise.
//!
//! Requests are served together: callers on any thread submit to one scheduler thread that
//! owns the KV cache and runs the [`Batcher`]'s steps, so a request joins the running batch at
//! the next step and leaves when its rows stop. Under tensor parallelism rank 0 tells the other
//! ranks, before every step, which requests joined and which were cancelled; every rank then
//! runs the same step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use anyhow::Result;
use megatron_data::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

use super::api::ApiRequest;
use super::openai::{completion_body, text_offsets, Choice, CompletionRequest};
use megatron_inference::Sampling;
use megatron_inference::{beam_search, BeamSearchRequest};
use megatron_inference::{
    generate_tokens, BatchLimits, Batcher, CacheUse, Generation, GenerationRequest, Refusal,
    RowSpec, StopCondition, DEFAULT_PREFILL_CHUNK,
};
use megatron_inference::{Decoder, KvBudget};
use megatron_models::{AttentionMask, GptModel};
use megatron_parallel::Communicator;

/// Megatron's `--max-tokens-to-oom` default: prompts × total length per request.
pub const DEFAULT_MAX_TOKENS: usize = 12_000;

/// Why a request produced no response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceError {
    /// The request cannot be served as asked (HTTP 400 with Megatron's message).
    Rejected(String),
    /// The queue is full or the service is stopping: try again later (HTTP 503).
    Busy(String),
    /// Something broke while serving it, or it was cancelled (HTTP 500).
    Failed(String),
}

/// Set by a caller to give up a request: its rows leave the batch, and their KV cache blocks
/// are freed, at the next step.
#[derive(Debug, Clone, Default)]
pub struct CancelFlag(Arc<AtomicBool>);

impl CancelFlag {
    pub fn new() -> Self {
        CancelFlag::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// A shared view of a service's [`CacheUse`].
#[derive(Clone)]
pub struct CacheUseReader(Arc<Mutex<CacheUse>>);

impl CacheUseReader {
    pub fn read(&self) -> CacheUse {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What a streaming sink answers when its client has gone away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone;

/// Token ids the request flags refer to, found through the tokenizer (GPT-2: 198, 628, 25).
struct SpecialTokens {
    eod: i64,
    newline: Option<i64>,
    double_newline: Option<i64>,
    colon: Option<i64>,
}

/// How the scheduler batches and where its KV cache may grow.
#[derive(Debug, Clone, Copy)]
struct Settings {
    limits: BatchLimits,
    budget: KvBudget,
    cuda_graphs: bool,
    /// Decode attention through the paged kernel (else gathered windows).
    paged_kernel: bool,
    /// Decode steps of few rows through the fused decode kernels.
    decode_fusion: bool,
    /// The next decode step queued before the last one's tokens are read.
    decode_overlap: bool,
}

/// What the scheduler thread and the callers share: the model and how requests become rows.
struct Core {
    model: GptModel,
    tokenizer: Arc<dyn Tokenizer>,
    max_tokens: usize,
    special: SpecialTokens,
    /// With tensor parallelism: the group whose other ranks run every step with rank 0.
    mirror: Option<Arc<dyn Communicator>>,
    settings: Settings,
    cache_use: Arc<Mutex<CacheUse>>,
}

pub struct TextGenerationService {
    /// Until the first request; then the scheduler thread owns it and hands it back when it
    /// stops.
    core: Mutex<Option<Core>>,
    cache_use: Arc<Mutex<CacheUse>>,
    /// The tokenizer requests are read with (also the core's).
    tokenizer: Arc<dyn Tokenizer>,
    /// Tokens a request may span: the model's positions within `--max-tokens-to-oom`.
    longest_request: usize,
    /// The scheduler thread's inbox, made by the first request.
    inbox: OnceLock<Mutex<Sender<Command>>>,
    scheduler: Mutex<Option<JoinHandle<Core>>>,
    next_id: AtomicU64,
}

/// A request as every tensor-parallel rank runs it.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum SharedJob {
    Api(ApiRequest),
    Completion(CompletionRequest),
}

/// What rank 0 tells the other ranks before each step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Plan {
    submit: Vec<(u64, SharedJob)>,
    cancel: Vec<u64>,
    stop: bool,
}

/// What a completion's caller receives: text as it is generated, then the answer.
enum CompletionEvent {
    Delta(usize, String),
    Done(Result<Value, ServiceError>),
}

/// Where a request's answer goes (rank 0 only).
enum Reply {
    Api(Sender<Result<Value, ServiceError>>),
    Completion(Sender<CompletionEvent>),
}

impl Reply {
    fn send(&self, outcome: Result<Value, ServiceError>) {
        let _ = match self {
            Reply::Api(sender) => sender.send(outcome).map_err(|_| ()),
            Reply::Completion(sender) => {
                sender.send(CompletionEvent::Done(outcome)).map_err(|_| ())
            }
        };
    }
}

/// A request for the scheduler thread.
enum Command {
    Submit {
        id: u64,
        job: SharedJob,
        reply: Reply,
        cancel: Option<CancelFlag>,
    },
    Stop,
}

fn single_token(tokenizer: &dyn Tokenizer, text: &str) -> Option<i64> {
    tokenizer
        .tokenize(text)
        .ok()
        .and_then(|ids| ids.first().map(|&id| i64::from(id)))
}

/// A fresh random seed for a request that names none.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64;
    megatron_inference::row_seed(nanos, COUNTER.fetch_add(1, Ordering::Relaxed) as usize)
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
        let settings = Settings {
            limits: BatchLimits {
                max_batch_size: DEFAULT_MAX_BATCH_SIZE,
                prefill_chunk: DEFAULT_PREFILL_CHUNK,
                max_queued: DEFAULT_MAX_QUEUED,
            },
            budget: KvBudget::default(),
            cuda_graphs: true,
            paged_kernel: true,
            decode_fusion: true,
            decode_overlap: true,
        };
        let cache_use = Arc::new(Mutex::new(CacheUse::default()));
        let longest_request = (model.config.max_position_embeddings as usize).min(max_tokens);
        Ok(TextGenerationService {
            core: Mutex::new(Some(Core {
                model,
                tokenizer: Arc::clone(&tokenizer),
                max_tokens,
                special,
                mirror: None,
                settings,
                cache_use: Arc::clone(&cache_use),
            })),
            cache_use,
            tokenizer,
            longest_request,
            inbox: OnceLock::new(),
            scheduler: Mutex::new(None),
            next_id: AtomicU64::new(0),
        })
    }

    fn core_mut(&mut self) -> &mut Core {
        self.core
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .as_mut()
            .expect("configured before the first request")
    }

    /// The core, while no scheduler thread owns it.
    fn take_core(&self) -> Option<Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn put_core(&self, core: Core) {
        *self.core.lock().unwrap_or_else(|p| p.into_inner()) = Some(core);
    }

    /// Launches every decode step kernel by kernel instead of replaying CUDA graphs
    /// (`--no-cuda-graphs`), e.g. to compare the two.
    pub fn without_cuda_graphs(mut self) -> Self {
        self.core_mut().settings.cuda_graphs = false;
        self
    }

    /// Decodes with gathered attention windows instead of the paged decode kernel
    /// (`--no-paged-attention`), e.g. to compare the two.
    pub fn without_paged_attention(mut self) -> Self {
        self.core_mut().settings.paged_kernel = false;
        self
    }

    /// Runs decode steps through libtorch's linear layers and separate norm, bias, GeLU and
    /// residual kernels instead of the fused decode kernels (`--no-decode-fusion`), e.g. to
    /// compare the two.
    pub fn without_decode_fusion(mut self) -> Self {
        self.core_mut().settings.decode_fusion = false;
        self
    }

    /// Reads each decode step's tokens before queuing the next step (`--no-decode-overlap`),
    /// instead of queuing the next one first when it runs the same rows, e.g. to compare the
    /// two.
    pub fn without_decode_overlap(mut self) -> Self {
        self.core_mut().settings.decode_overlap = false;
        self
    }

    /// How many rows run together, how much prompt is prefilled per step and how many
    /// requests may wait (`--max-batch-size 1` serves one request at a time).
    pub fn with_limits(mut self, limits: BatchLimits) -> Self {
        self.core_mut().settings.limits = limits;
        self
    }

    /// The memory the KV cache may take (`--kv-cache-gb`).
    pub fn with_kv_budget(mut self, budget: KvBudget) -> Self {
        self.core_mut().settings.budget = budget;
        self
    }

    /// Serves with tensor parallelism over `group`: rank 0 calls [`Self::respond`] and
    /// [`Self::complete`], the other ranks [`Self::follow`].
    pub fn with_tensor_parallel(mut self, group: Arc<dyn Communicator>) -> Self {
        self.core_mut().mirror = (group.size() > 1).then_some(group);
        self
    }

    /// The KV cache's blocks and the rows and requests in the scheduler, after the last step.
    pub fn cache_use(&self) -> CacheUse {
        self.cache_use_reader().read()
    }

    /// Reads [`Self::cache_use`] from anywhere, for as long as the reader lives (the
    /// server's `/metrics`, which outlives no service but cannot borrow it).
    pub fn cache_use_reader(&self) -> CacheUseReader {
        CacheUseReader(Arc::clone(&self.cache_use))
    }

    /// The tokenizer requests are read with.
    pub fn tokenizer(&self) -> &dyn Tokenizer {
        self.tokenizer.as_ref()
    }

    /// The most tokens a completion of a `prompt_tokens` long prompt may ask for: the
    /// model's positions and the request budget (`--max-tokens-to-oom`) left after it.
    pub fn room_after(&self, prompt_tokens: usize) -> usize {
        self.longest_request.saturating_sub(prompt_tokens)
    }

    /// The other tensor-parallel ranks: runs every step rank 0 announces, until it stops.
    pub fn follow(&self) -> Result<()> {
        let core = self
            .take_core()
            .ok_or_else(|| anyhow::anyhow!("this service is already serving"))?;
        let followed = if core.mirror.is_some() {
            Scheduler::new(&core).follow()
        } else {
            Err(anyhow::anyhow!("following needs tensor parallelism"))
        };
        self.put_core(core);
        followed
    }

    /// Rank 0, when the server stops: finishes the scheduler and releases the other ranks.
    pub fn stop_followers(&self) -> Result<()> {
        self.shut_down();
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(core) = core.as_ref().filter(|c| c.mirror.is_some()) {
            if self.inbox.get().is_none() {
                // No request ever started the scheduler: tell the other ranks directly.
                share_plan(
                    core,
                    Some(&Plan {
                        stop: true,
                        ..Plan::default()
                    }),
                )?;
            }
        }
        Ok(())
    }

    fn shut_down(&self) {
        let handle = self
            .scheduler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(handle) = handle {
            if let Some(inbox) = self.inbox.get() {
                let _ = inbox
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .send(Command::Stop);
            }
            if let Ok(core) = handle.join() {
                self.put_core(core);
            }
        }
    }

    /// Starts the scheduler thread now (else the first request does): it makes the KV cache
    /// and captures the decode graphs before it takes requests.
    pub fn start(&self) {
        self.inbox();
    }

    /// The scheduler thread's inbox, the thread started the first time.
    fn inbox(&self) -> &Mutex<Sender<Command>> {
        self.inbox.get_or_init(|| {
            let (sender, receiver) = mpsc::channel();
            if let Some(core) = self.take_core() {
                let handle = std::thread::Builder::new()
                    .name("generation-scheduler".into())
                    .spawn(move || {
                        Scheduler::new(&core).lead(receiver);
                        core
                    })
                    .expect("the scheduler thread starts");
                *self.scheduler.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
            }
            Mutex::new(sender)
        })
    }

    /// Hands `job` to the scheduler thread, starting it the first time.
    fn submit(
        &self,
        job: SharedJob,
        reply: Reply,
        cancel: Option<CancelFlag>,
    ) -> Result<(), ServiceError> {
        let inbox = self.inbox();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        inbox
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .send(Command::Submit {
                id,
                job,
                reply,
                cancel,
            })
            .map_err(|_| ServiceError::Busy("the server is shutting down".into()))
    }

    pub fn respond(&self, request: &ApiRequest) -> Result<Value, ServiceError> {
        self.respond_cancellable(request, None)
    }

    /// [`Self::respond`], given up when `cancel` is set.
    pub fn respond_cancellable(
        &self,
        request: &ApiRequest,
        cancel: Option<&CancelFlag>,
    ) -> Result<Value, ServiceError> {
        let request = ApiRequest {
            random_seed: Some(request.random_seed.unwrap_or_else(fresh_seed)),
            ..request.clone()
        };
        let (reply, answer) = mpsc::channel();
        self.submit(SharedJob::Api(request), Reply::Api(reply), cancel.cloned())?;
        answer
            .recv()
            .unwrap_or_else(|_| Err(ServiceError::Busy("the server is shutting down".into())))
    }

    /// An OpenAI completion: `on_delta(choice, text)` receives the text as it is generated
    /// (held back while it may still turn into a stop sequence or an incomplete character).
    pub fn complete(
        &self,
        request: &CompletionRequest,
        id: &str,
        created: u64,
        on_delta: &mut dyn FnMut(usize, &str),
    ) -> Result<Value, ServiceError> {
        self.complete_streaming(
            request,
            id,
            created,
            &mut |choice, text| {
                on_delta(choice, text);
                Ok(())
            },
            None,
        )
    }

    /// [`Self::complete`] whose sink may report that its client has gone: the request is then
    /// cancelled (as when `cancel` is set) and its KV cache blocks freed at the next step.
    pub fn complete_streaming(
        &self,
        request: &CompletionRequest,
        id: &str,
        created: u64,
        on_delta: &mut dyn FnMut(usize, &str) -> Result<(), ClientGone>,
        cancel: Option<&CancelFlag>,
    ) -> Result<Value, ServiceError> {
        let request = CompletionRequest {
            seed: Some(request.seed.unwrap_or_else(fresh_seed)),
            ..request.clone()
        };
        let cancel = cancel.cloned().unwrap_or_default();
        let (events, received) = mpsc::channel();
        self.submit(
            SharedJob::Completion(request),
            Reply::Completion(events),
            Some(cancel.clone()),
        )?;
        loop {
            match received.recv() {
                Ok(CompletionEvent::Delta(choice, text)) => {
                    if on_delta(choice, &text).is_err() {
                        cancel.cancel();
                    }
                }
                Ok(CompletionEvent::Done(outcome)) => {
                    return outcome.map(|mut body| {
                        body["id"] = Value::String(id.to_string());
                        body["created"] = json!(created);
                        body
                    })
                }
                Err(_) => return Err(ServiceError::Busy("the server is shutting down".into())),
            }
        }
    }
}

impl Drop for TextGenerationService {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Rows decoded together by default (`--max-batch-size`).
pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;
/// Requests that may wait for room by default (`--max-queued`).
pub const DEFAULT_MAX_QUEUED: usize = 256;

/// Broadcasts `plan` from rank 0 (`Some`), or receives it on the other ranks (`None`).
fn share_plan(core: &Core, plan: Option<&Plan>) -> Result<Plan> {
    let group = core.mirror.as_ref().expect("tensor parallelism");
    let bytes = plan.map(serde_json::to_vec).transpose()?;
    let received = share_bytes(
        group.as_ref(),
        core.model.options().device,
        bytes.as_deref(),
    )?;
    Ok(serde_json::from_slice(&received)?)
}

/// A request being served: how its answer is built, and (on rank 0) where it goes.
struct Active {
    job: Prepared,
    reply: Option<Reply>,
    cancel: Option<CancelFlag>,
}

/// A request turned into what runs.
enum Prepared {
    /// Megatron's `/api`: rows batched with the others.
    Api,
    /// An OpenAI completion: rows batched with the others, streamed as they go.
    Completion(Box<CompletionState>),
}

/// A completion while its rows run: the prompts and each choice's stream.
struct CompletionState {
    request: CompletionRequest,
    prompts: Vec<Vec<i64>>,
    prompt_texts: Vec<String>,
    streams: Vec<CompletionStream>,
    /// The caller stopped listening (rank 0).
    gone: bool,
}

/// What a request needs once validated.
enum Start {
    /// Rows for the batcher.
    Rows(Prepared, Vec<RowSpec>),
    /// Answered at once, outside the batch (beam search, prompt scoring).
    Now(Result<Value, ServiceError>),
}

/// The scheduler: the batcher and the decoder (declared first, dropped before the model: tearing
/// down an NCCL communicator waits until the CUDA graphs that captured its collectives are
/// gone), and the requests in flight.
struct Scheduler<'a> {
    decoder: Decoder,
    batcher: Batcher,
    core: &'a Core,
    active: HashMap<u64, Active>,
}

impl<'a> Scheduler<'a> {
    fn new(core: &'a Core) -> Self {
        let settings = core.settings;
        let mut decoder = if settings.cuda_graphs {
            Decoder::with_cuda_graphs()
        } else {
            Decoder::eager()
        };
        if !settings.paged_kernel {
            decoder = decoder.with_gathered_attention();
        }
        if !settings.decode_fusion {
            decoder = decoder.without_decode_fusion();
        }
        let batcher = Batcher::new(settings.limits);
        Scheduler {
            decoder: decoder.with_budget(settings.budget),
            batcher: if settings.decode_overlap {
                batcher
            } else {
                batcher.without_overlap()
            },
            core,
            active: HashMap::new(),
        }
    }

    /// Rank 0: takes requests from `inbox`, tells the other ranks each step's plan, runs it.
    fn lead(mut self, inbox: Receiver<Command>) {
        if let Device::Cuda(index) = self.core.model.options().device {
            let _ = megatron_kernels::runtime::set_cuda_device(index);
        }
        self.warm_up();
        let mut stopping = false;
        let mut pending: Vec<(u64, Reply, Option<CancelFlag>)> = Vec::new();
        loop {
            let mut plan = Plan::default();
            let mut take = |command: Command, plan: &mut Plan| match command {
                Command::Submit {
                    id,
                    job,
                    reply,
                    cancel,
                } => {
                    plan.submit.push((id, job));
                    pending.push((id, reply, cancel));
                }
                Command::Stop => plan.stop = true,
            };
            if self.batcher.is_idle() && !stopping {
                match inbox.recv() {
                    Ok(command) => take(command, &mut plan),
                    Err(_) => plan.stop = true,
                }
            }
            while let Ok(command) = inbox.try_recv() {
                take(command, &mut plan);
            }
            stopping |= plan.stop;
            for (&id, active) in &self.active {
                let gone = matches!(&active.job, Prepared::Completion(state) if state.gone);
                if gone || active.cancel.as_ref().is_some_and(CancelFlag::is_cancelled) {
                    plan.cancel.push(id);
                }
            }
            // Stop once the requests in flight are done.
            plan.stop = stopping && self.batcher.is_idle() && plan.submit.is_empty();
            if self.core.mirror.is_some() {
                if let Err(e) = share_plan(self.core, Some(&plan)) {
                    eprintln!("text_generation_server: telling the other ranks failed: {e:#}");
                }
            }
            let mut replies: HashMap<u64, (Reply, Option<CancelFlag>)> = pending
                .drain(..)
                .map(|(id, reply, cancel)| (id, (reply, cancel)))
                .collect();
            if self.run(plan, &mut replies) {
                return;
            }
        }
    }

    /// The other ranks: runs each plan rank 0 announces until it says stop.
    fn follow(mut self) -> Result<()> {
        self.warm_up();
        loop {
            let plan = share_plan(self.core, None)?;
            if self.run(plan, &mut HashMap::new()) {
                return Ok(());
            }
        }
    }

    /// Makes the KV cache and captures the decode graphs before the first request (every rank
    /// does, in the same order); a failure is reported and left to the first request.
    fn warm_up(&mut self) {
        let started = std::time::Instant::now();
        let rows = self.core.settings.limits.max_batch_size as i64;
        match self.decoder.warm_up(&self.core.model, rows) {
            Ok(0) => {}
            Ok(graphs) => eprintln!(
                "text_generation_server: captured {graphs} decode graphs (batch buckets up to {}, \
                 {} attention, {}) in {:.1} s",
                megatron_inference::bucket(rows),
                if self.decoder.paged_attention() {
                    "paged decode"
                } else {
                    "gathered"
                },
                if self.decoder.decode_fusion() {
                    "fused decode kernels"
                } else {
                    "unfused layers"
                },
                started.elapsed().as_secs_f64()
            ),
            Err(e) => eprintln!("text_generation_server: warming up the decoder failed: {e:#}"),
        }
    }

    /// Applies `plan` and runs one step; `true` when the plan says stop.
    fn run(&mut self, plan: Plan, replies: &mut HashMap<u64, (Reply, Option<CancelFlag>)>) -> bool {
        let cancelled: Vec<Active> = plan
            .cancel
            .iter()
            .filter_map(|&id| {
                self.batcher.cancel(&mut self.decoder, id);
                self.active.remove(&id)
            })
            .collect();
        // Their blocks are free before their callers hear of it.
        self.publish();
        for active in cancelled {
            if let Some(reply) = active.reply {
                reply.send(Err(ServiceError::Failed(
                    "the request was cancelled".into(),
                )));
            }
        }
        for (id, job) in plan.submit {
            let (reply, cancel) = match replies.remove(&id) {
                Some((reply, cancel)) => (Some(reply), cancel),
                None => (None, None),
            };
            self.start(id, job, reply, cancel);
        }
        if plan.stop {
            return true;
        }
        if !self.batcher.is_idle() {
            self.step();
        }
        self.publish();
        false
    }

    /// Shows the cache's use to [`TextGenerationService::cache_use`].
    fn publish(&self) {
        *self
            .core
            .cache_use
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = self.batcher.cache_use();
    }

    /// Validates a request and queues its rows, or answers it.
    fn start(&mut self, id: u64, job: SharedJob, reply: Option<Reply>, cancel: Option<CancelFlag>) {
        let prepared = guarded(|| match &job {
            SharedJob::Api(request) => self.core.prepare_api(request),
            SharedJob::Completion(request) => self.core.prepare_completion(request, reply.as_ref()),
        });
        let (job, rows) = match prepared {
            Ok(Start::Rows(job, rows)) => (job, rows),
            Ok(Start::Now(outcome)) => {
                if let Some(reply) = reply {
                    reply.send(outcome);
                }
                return;
            }
            Err(e) => {
                if let Some(reply) = reply {
                    reply.send(Err(e));
                }
                return;
            }
        };
        match self
            .batcher
            .submit(&self.core.model, &mut self.decoder, id, rows)
        {
            Ok(()) => {
                self.active.insert(id, Active { job, reply, cancel });
            }
            Err(refusal) => {
                let error = match refusal {
                    Refusal::Busy(text) => ServiceError::Busy(text),
                    Refusal::TooLarge(text) => ServiceError::Rejected(text),
                    Refusal::Failed(e) => ServiceError::Failed(format!("{e:#}")),
                };
                if let Some(reply) = reply {
                    reply.send(Err(error));
                }
            }
        }
    }

    /// One batcher step: streams the new tokens and answers the finished requests. A failed
    /// step fails every request in flight and starts the cache afresh.
    fn step(&mut self) {
        let core = self.core;
        let active = &mut self.active;
        let batcher = &mut self.batcher;
        let decoder = &mut self.decoder;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batcher.step(
                &core.model,
                decoder,
                &mut |id, row, token| match active.get_mut(&id) {
                    Some(Active {
                        job: Prepared::Completion(state),
                        reply,
                        ..
                    }) => core.observe(state, reply.as_ref(), row, token),
                    _ => false,
                },
            )
        }));
        let finished = match outcome {
            Ok(Ok(finished)) => finished,
            Ok(Err(e)) => return self.fail_all(format!("{e:#}")),
            Err(_) => return self.fail_all("generation panicked".into()),
        };
        // The finished rows' blocks are free before their callers hear of it.
        self.publish();
        for (id, generation) in finished {
            let Some(active) = self.active.remove(&id) else {
                continue;
            };
            let outcome = guarded(|| match active.job {
                Prepared::Api => self.core.finish_api(generation),
                Prepared::Completion(state) => self.core.finish_completion(*state, generation),
            });
            if let Some(reply) = active.reply {
                reply.send(outcome);
            }
        }
    }

    fn fail_all(&mut self, message: String) {
        self.batcher.clear(&mut self.decoder);
        self.decoder.reset();
        for (_, active) in self.active.drain() {
            if let Some(reply) = active.reply {
                reply.send(Err(ServiceError::Failed(message.clone())));
            }
        }
    }
}

/// Runs `body`, a panic turned into a failure.
fn guarded<T>(body: impl FnOnce() -> Result<T, ServiceError>) -> Result<T, ServiceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
        .unwrap_or_else(|_| Err(ServiceError::Failed("generation panicked".into())))
}

impl Core {
    /// Megatron's checks in Megatron's order, then the rows to batch (or, for beam search and
    /// `tokens_to_generate = 0`, the answer).
    fn prepare_api(&self, request: &ApiRequest) -> Result<Start, ServiceError> {
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
        if request.tokens_to_generate == 0 {
            let scored = self.score(&generation);
            return Ok(Start::Now(scored.and_then(|out| self.finish_api(out))));
        }
        let rows = generation
            .rows(request.random_seed.unwrap_or(0))
            .map_err(|e| ServiceError::Rejected(format!("{e:#}")))?;
        Ok(Start::Rows(Prepared::Api, rows))
    }

    /// One forward scoring the prompts (no new tokens).
    fn score(&self, generation: &GenerationRequest) -> Result<Generation, ServiceError> {
        generate_tokens(&self.model, generation, &mut Decoder::eager())
            .map_err(|e| ServiceError::Failed(format!("{e:#}")))
    }

    /// Megatron's answer: every row's text, its tokens one by one and their log-probabilities.
    fn finish_api(&self, out: Generation) -> Result<Value, ServiceError> {
        let (text, segments) = self.texts(&out.tokens)?;
        Ok(json!({"text": text, "segments": segments, "logprobs": out.logprobs}))
    }

    /// OpenAI's checks, the echoed prompts sent, then the rows to batch (or, for
    /// `max_tokens = 0`, the answer).
    fn prepare_completion(
        &self,
        request: &CompletionRequest,
        reply: Option<&Reply>,
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
        if request.echo {
            // A streamed echo starts with the prompt, as the whole answer does.
            if let Some(Reply::Completion(events)) = reply {
                for (row, prompt) in prompt_texts.iter().enumerate() {
                    let _ = events.send(CompletionEvent::Delta(row, prompt.clone()));
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
            logprobs: request.logprobs,
            pad: self.special.eod,
        };
        let state = CompletionState {
            request: request.clone(),
            streams: prompts
                .iter()
                .map(|_| CompletionStream::default())
                .collect(),
            prompts,
            prompt_texts,
            gone: false,
        };
        if request.max_tokens == 0 {
            let scored = self.score(&generation);
            return Ok(Start::Now(
                scored.and_then(|out| self.finish_completion(state, out)),
            ));
        }
        let rows = generation
            .rows(request.seed.unwrap_or(0))
            .map_err(|e| ServiceError::Rejected(format!("{e:#}")))?;
        Ok(Start::Rows(Prepared::Completion(Box::new(state)), rows))
    }

    /// A completion's new token: streams what is certain of its text; `true` ends the row (the
    /// end-of-document token, a stop sequence or `max_tokens`).
    fn observe(
        &self,
        state: &mut CompletionState,
        reply: Option<&Reply>,
        row: usize,
        token: i64,
    ) -> bool {
        let stream = &mut state.streams[row];
        if token == self.special.eod {
            stream.finish = Some("stop");
            return true;
        }
        stream.tokens.push(token);
        let mut gone = false;
        let ended = stream.advance(
            self.tokenizer.as_ref(),
            &state.request.stop,
            state.request.max_tokens,
            &mut |text| {
                if let Some(Reply::Completion(events)) = reply {
                    gone |= events
                        .send(CompletionEvent::Delta(row, text.to_string()))
                        .is_err();
                }
            },
        );
        state.gone |= gone;
        ended
    }

    /// The completion's answer from its streams and the generated tokens (`id` and `created`
    /// are filled in by the caller).
    fn finish_completion(
        &self,
        mut state: CompletionState,
        out: Generation,
    ) -> Result<Value, ServiceError> {
        let failed = |e: anyhow::Error| ServiceError::Failed(format!("{e:#}"));
        let request = &state.request;
        let prompts = &state.prompts;
        let prompt_texts = &state.prompt_texts;
        let mut choices = Vec::with_capacity(prompts.len());
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
            "",
            0,
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
}

/// A completion being streamed: its tokens, the text already sent, and why it ended.
#[derive(Default)]
struct CompletionStream {
    tokens: Vec<i64>,
    sent: usize,
    finish: Option<&'static str>,
    /// The text of the first `settled` tokens, which did not end inside a character: each
    /// step detokenizes only the tokens after them (and a few before, for context), so a
    /// row's streaming costs the same at its 500th token as at its first.
    settled_text: String,
    settled: usize,
}

/// Tokens before the new ones detokenized with them: tokenizers that drop a word's leading
/// space at the start of a text (SentencePiece) see the word in its place.
const DETOKENIZE_CONTEXT: usize = 4;

impl CompletionStream {
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

    /// Sends what is certain of the text so far; `true` when the completion has ended.
    fn advance(
        &mut self,
        tokenizer: &dyn Tokenizer,
        stop: &[String],
        max_tokens: usize,
        send: &mut dyn FnMut(&str),
    ) -> bool {
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

fn detokenize(tokenizer: &dyn Tokenizer, tokens: &[i64]) -> String {
    let ids: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
    tokenizer.detokenize(&ids).unwrap_or_default()
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
        let mut stream = CompletionStream::default();
        let mut streamed = String::new();
        for (n, &id) in ids.iter().enumerate() {
            stream.tokens.push(i64::from(id));
            let so_far = stream.text_so_far(&Bytes);
            assert_eq!(so_far, stream.text(&Bytes), "after {} tokens", n + 1);
            // Only the last few tokens are detokenized again.
            assert!(stream.settled + 4 >= stream.tokens.len());
            if stream.advance(&Bytes, &stop, usize::MAX, &mut |t| streamed.push_str(t)) {
                break;
            }
        }
        assert_eq!(streamed, "héllo wörld ✓ — “");
        assert_eq!(stream.final_text(&Bytes, &stop), streamed);
    }
}
