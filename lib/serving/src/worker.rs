//! The generation side of the server: the inbox of jobs, and the thread that owns the service
//! and hands every job to it on a thread of its own (the service batches the jobs in flight),
//! skipping those whose client has gone, stopping a generation whose client goes away, and
//! reporting to the metrics.
//!
//! One queue limit, `--max-queued`: it is the service's (requests waiting for room in the
//! batch, answered [`ServiceError::Busy`] beyond it). The inbox holds jobs only until the
//! generation thread takes them, at once once the model is loaded; while it loads, the same
//! limit bounds the inbox, so no request waits that the service would have refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc as events, oneshot};

use super::api::ApiRequest;
use super::metrics::ServerMetrics;
use super::openai::CompletionRequest;
use super::service::{CancelFlag, ClientGone, ServiceError, TextGenerationService};

/// What a handler asks of the generation thread.
pub(super) enum Work {
    Api {
        request: ApiRequest,
        reply: oneshot::Sender<Result<Value, ServiceError>>,
        /// Set when the handler is dropped (its client went away).
        cancel: CancelFlag,
    },
    Completion {
        request: CompletionRequest,
        id: String,
        created: u64,
        /// No `max_tokens` was given (chat): the answer may fill the model's context.
        fill_context: bool,
        events: events::UnboundedSender<Event>,
        /// Set when the handler or its stream is dropped (its client went away).
        cancel: CancelFlag,
    },
}

pub(super) struct Job {
    pub arrived: Instant,
    pub work: Work,
}

impl Job {
    /// Its client is gone (the handler, and with it the receiving end, was dropped).
    fn abandoned(&self) -> bool {
        match &self.work {
            Work::Api { reply, .. } => reply.is_closed(),
            Work::Completion { events, .. } => events.is_closed(),
        }
    }
}

/// What the generation thread tells a completion's handler: text as it is generated, then
/// the whole answer.
pub(super) enum Event {
    Delta(usize, String),
    Done(Result<Value, ServiceError>),
}

/// Why a job was not queued.
pub(super) enum Refused {
    Full,
    Closed,
}

/// Jobs waiting for the generation thread, at most `limit` of them (it takes them at once
/// once the model is loaded).
pub(super) struct Queue {
    sender: Mutex<Option<Sender<Job>>>,
    waiting: AtomicUsize,
    limit: usize,
}

impl Queue {
    pub fn new(limit: usize) -> (Self, Receiver<Job>) {
        let (sender, jobs) = mpsc::channel();
        let queue = Queue {
            sender: Mutex::new(Some(sender)),
            waiting: AtomicUsize::new(0),
            limit: limit.max(1),
        };
        (queue, jobs)
    }

    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.limit {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(Refused::Full);
        }
        let sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        match sender.as_ref().map(|s| s.send(job)) {
            Some(Ok(())) => Ok(()),
            _ => {
                self.waiting.fetch_sub(1, Ordering::SeqCst);
                Err(Refused::Closed)
            }
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// No more jobs: the generation thread ends after those already queued.
    pub fn close(&self) {
        self.sender.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    fn taken(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Jobs handed to the service and not yet answered, for the metrics (counted up and down, so
/// that concurrent jobs add up); the service's own [`megatron_inference::CacheUse`] says which of them
/// wait and how many rows run.
#[derive(Default)]
pub(super) struct Activity {
    pub serving: AtomicUsize,
}

/// Serves `jobs`, each on its own thread, until the queue is closed and every job is answered;
/// then releases the other tensor-parallel ranks.
pub(super) fn work(
    service: &TextGenerationService,
    jobs: Receiver<Job>,
    queue: &Queue,
    activity: &Activity,
    metrics: &ServerMetrics,
) {
    std::thread::scope(|scope| {
        for job in jobs {
            queue.taken();
            if job.abandoned() {
                metrics.cancelled();
                continue;
            }
            let spawned = std::thread::Builder::new()
                .name("generation-request".into())
                .spawn_scoped(scope, move || serve(service, job, activity, metrics));
            if let Err(e) = spawned {
                // Out of threads: the job is dropped, and its handler answers that the
                // server cannot serve it now.
                eprintln!("text_generation_server: cannot start a request's thread: {e}");
            }
        }
    });
    if let Err(e) = service.stop_followers() {
        eprintln!(
            "text_generation_server: releasing the other tensor-parallel ranks failed: {e:#}"
        );
    }
}

/// Runs one job and answers it, counted in `activity` while it runs.
fn serve(service: &TextGenerationService, job: Job, activity: &Activity, metrics: &ServerMetrics) {
    activity.serving.fetch_add(1, Ordering::SeqCst);
    let (prompt_tokens, generated) = match job.work {
        Work::Api {
            request,
            reply,
            cancel,
        } => {
            let outcome = guarded(&mut || service.respond_cancellable(&request, Some(&cancel)));
            if cancel.is_cancelled() {
                metrics.cancelled();
            }
            let counts = outcome
                .as_ref()
                .map(|body| api_token_counts(service, &request, body))
                .unwrap_or_default();
            let _ = reply.send(outcome);
            counts
        }
        Work::Completion {
            mut request,
            id,
            created,
            fill_context,
            events,
            cancel,
        } => {
            let rows = request.prompts.len();
            if fill_context {
                let prompt = request.prompts.first().map(String::as_str).unwrap_or("");
                let length = service
                    .tokenizer()
                    .tokenize(prompt)
                    .map_or(0, |ids| ids.len());
                // At least one: a conversation that fills the context is refused with the
                // service's message rather than answered empty.
                request.max_tokens = service.room_after(length).max(1);
            }
            // With echo the prompts come first; the first token's text follows them.
            let mut before_first = if request.echo { rows } else { 0 };
            let mut first_token = Some(());
            let mut sink = |index: usize, text: &str| -> Result<(), ClientGone> {
                if before_first > 0 {
                    before_first -= 1;
                } else if first_token.take().is_some() {
                    metrics.first_token(job.arrived.elapsed());
                }
                events
                    .send(Event::Delta(index, text.to_string()))
                    .map_err(|_| ClientGone)
            };
            let outcome = guarded(&mut || {
                service.complete_streaming(&request, &id, created, &mut sink, Some(&cancel))
            });
            if events.is_closed() || cancel.is_cancelled() {
                metrics.cancelled();
            }
            let counts = outcome
                .as_ref()
                .map(|body| {
                    let usage = &body["usage"];
                    (
                        usage["prompt_tokens"].as_u64().unwrap_or(0),
                        usage["completion_tokens"].as_u64().unwrap_or(0),
                    )
                })
                .unwrap_or_default();
            let _ = events.send(Event::Done(outcome));
            counts
        }
    };
    metrics.generated(prompt_tokens, generated, job.arrived.elapsed());
    activity.serving.fetch_sub(1, Ordering::SeqCst);
}

/// A panic while serving one request answers it with an error instead of ending the server.
fn guarded(run: &mut dyn FnMut() -> Result<Value, ServiceError>) -> Result<Value, ServiceError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
        .unwrap_or_else(|_| Err(ServiceError::Failed("generation panicked".into())))
}

/// Prompt and generated tokens of an `/api` answer: each row's segments are its tokens, the
/// prompt's (with the `add_BOS` token) first; beams all continue the one prompt.
fn api_token_counts(
    service: &TextGenerationService,
    request: &ApiRequest,
    body: &Value,
) -> (u64, u64) {
    let prompt_lengths: Vec<u64> = request
        .prompts
        .iter()
        .map(|p| {
            let ids = service.tokenizer().tokenize(p).map_or(0, |ids| ids.len());
            (ids + usize::from(request.add_bos)) as u64
        })
        .collect();
    let rows = body["segments"].as_array().map_or(&[][..], Vec::as_slice);
    let generated = rows
        .iter()
        .enumerate()
        .map(|(row, segments)| {
            let prompt = if request.beam_width.is_some() {
                prompt_lengths.first()
            } else {
                prompt_lengths.get(row)
            };
            let all = segments.as_array().map_or(0, Vec::len) as u64;
            all.saturating_sub(prompt.copied().unwrap_or(0))
        })
        .sum();
    (prompt_lengths.iter().sum(), generated)
}
