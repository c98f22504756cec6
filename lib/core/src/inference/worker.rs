//! The generation side of the server: a bounded queue of jobs and the one thread that owns the
//! model and serves them in turn, skipping those whose client has gone, stopping a completion
//! whose client goes away, and reporting to the metrics.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Mutex;
use std::time::Instant;

use serde_json::Value;
use tokio::sync::{mpsc as events, oneshot};

use super::api::ApiRequest;
use super::metrics::ServerMetrics;
use super::openai::CompletionRequest;
use super::service::{ClientGone, ServiceError, TextGenerationService};

/// What a handler asks of the generation thread.
pub(super) enum Work {
    Api {
        request: ApiRequest,
        reply: oneshot::Sender<Result<Value, ServiceError>>,
    },
    Completion {
        request: CompletionRequest,
        id: String,
        created: u64,
        /// No `max_tokens` was given (chat): the answer may fill the model's context.
        fill_context: bool,
        events: events::UnboundedSender<Event>,
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

/// Jobs waiting for the generation thread, at most `limit` of them.
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

/// What the generation thread is doing, for the metrics (counted up and down, so that
/// concurrent jobs add up).
#[derive(Default)]
pub(super) struct Activity {
    pub running: AtomicUsize,
    pub batch_size: AtomicUsize,
}

/// Serves `jobs` until the queue is closed, then releases the other tensor-parallel ranks.
pub(super) fn work(
    service: &TextGenerationService,
    jobs: Receiver<Job>,
    queue: &Queue,
    activity: &Activity,
    metrics: &ServerMetrics,
) {
    for job in jobs {
        queue.taken();
        if job.abandoned() {
            metrics.cancelled();
            continue;
        }
        serve(service, job, activity, metrics);
    }
    if let Err(e) = service.stop_followers() {
        eprintln!(
            "text_generation_server: releasing the other tensor-parallel ranks failed: {e:#}"
        );
    }
}

/// Runs one job and answers it, counted in `activity` while it runs.
fn serve(service: &TextGenerationService, job: Job, activity: &Activity, metrics: &ServerMetrics) {
    let rows = match &job.work {
        Work::Api { request, .. } => request.beam_width.unwrap_or(request.prompts.len()),
        Work::Completion { request, .. } => request.prompts.len(),
    };
    activity.running.fetch_add(1, Ordering::SeqCst);
    activity.batch_size.fetch_add(rows, Ordering::SeqCst);
    let (prompt_tokens, generated) = match job.work {
        Work::Api { request, reply } => {
            let outcome = guarded(&mut || service.respond(&request));
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
        } => {
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
            let outcome = guarded(&mut || service.complete(&request, &id, created, &mut sink));
            if events.is_closed() {
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
    activity.running.fetch_sub(1, Ordering::SeqCst);
    activity.batch_size.fetch_sub(rows, Ordering::SeqCst);
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
