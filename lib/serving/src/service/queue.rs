//! The one queue between callers and the scheduler. A caller (an HTTP handler, or a thread in
//! [`super::TextGenerationService::respond`]) submits a request with the channel its answer goes
//! to and a flag to give it up; the scheduler takes what arrived at each step boundary and
//! answers through the channel, so no thread waits per request.
//!
//! `--max-queued` is the batcher's limit on requests waiting for room in the batch (answered
//! busy beyond it). While the model loads nothing takes requests yet, and the same limit bounds
//! the queue itself, so that no request waits that the batcher would refuse.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use megatron_inference::Refusal;
use serde_json::{json, Value};
use tokio::sync::{mpsc as events, oneshot};

use super::tensor_parallel::SharedJob;
use super::{CancelFlag, ServiceError};
use crate::metrics::ServerMetrics;
use crate::openai::TokenLogprobs;

/// A request as its caller submits it.
pub(crate) struct Submission {
    pub job: SharedJob,
    /// A completion without `max_tokens` (chat): its answer may fill the model's context.
    pub fill_context: bool,
    pub reply: Reply,
    /// Set by the caller to give the request up.
    pub cancel: CancelFlag,
    pub arrived: Instant,
}

impl Submission {
    /// `job`, arriving now.
    pub fn new(job: SharedJob, fill_context: bool, reply: Reply, cancel: CancelFlag) -> Self {
        Submission {
            job,
            fill_context,
            reply,
            cancel,
            arrived: Instant::now(),
        }
    }

    /// Answers it with `error` without serving it.
    pub fn fail(self, error: ServiceError) {
        Caller::new(self.reply, self.cancel, self.arrived).answer(Err(error), None);
    }
}

/// Where a request's answer goes.
pub(crate) enum Reply {
    /// Megatron's `/api`: the whole answer at once.
    Api(oneshot::Sender<Result<Value, ServiceError>>),
    /// An OpenAI completion: text as it is generated, then the answer, given this `id` and
    /// `created` time.
    Completion {
        events: events::UnboundedSender<Event>,
        id: String,
        created: u64,
    },
}

/// What a completion's caller receives: text as it is generated (with the tokens it carries,
/// when a streamed request asked for log-probabilities), then the whole answer.
pub(crate) enum Event {
    Delta(usize, String, Option<TokenLogprobs>),
    Done(Result<Value, ServiceError>),
}

/// Why a request was not queued.
pub(crate) enum Refused {
    /// The queue is full (while the model loads): the busy message.
    Full(String),
    /// The queue is closed: the server is stopping.
    Closed,
}

/// What the queue's two ends share.
struct QueueState {
    /// Requests submitted and not yet taken.
    unclaimed: AtomicUsize,
    /// The most unclaimed requests while nothing takes them.
    limit: usize,
    /// No scheduler takes requests yet.
    loading: AtomicBool,
}

/// The callers' end of the queue.
pub(crate) struct RequestQueue {
    sender: Mutex<Option<Sender<Submission>>>,
    state: Arc<QueueState>,
}

/// The scheduler's end of the queue.
pub(crate) struct Inbox {
    receiver: Receiver<Submission>,
    state: Arc<QueueState>,
}

impl RequestQueue {
    /// A queue that holds at most `limit` (at least 1) requests until a scheduler takes them.
    pub fn new(limit: usize) -> (Self, Inbox) {
        let (sender, receiver) = mpsc::channel();
        let state = Arc::new(QueueState {
            unclaimed: AtomicUsize::new(0),
            limit: limit.max(1),
            loading: AtomicBool::new(true),
        });
        let queue = RequestQueue {
            sender: Mutex::new(Some(sender)),
            state: state.clone(),
        };
        (queue, Inbox { receiver, state })
    }

    pub fn submit(&self, submission: Submission) -> Result<(), Refused> {
        let state = &self.state;
        let before = state.unclaimed.fetch_add(1, Ordering::SeqCst);
        if before >= state.limit && state.loading.load(Ordering::SeqCst) {
            state.unclaimed.fetch_sub(1, Ordering::SeqCst);
            return Err(Refused::Full(Refusal::busy(state.limit).to_string()));
        }
        let sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        if sender.as_ref().is_some_and(|s| s.send(submission).is_ok()) {
            return Ok(());
        }
        state.unclaimed.fetch_sub(1, Ordering::SeqCst);
        Err(Refused::Closed)
    }

    /// Requests submitted and not yet taken by the scheduler.
    pub fn waiting(&self) -> usize {
        self.state.unclaimed.load(Ordering::SeqCst)
    }

    /// No more requests: the scheduler stops once it has answered those it holds.
    pub fn close(&self) {
        self.sender.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

impl Inbox {
    /// The scheduler takes requests from now on: its batcher's limit holds instead of the
    /// queue's.
    pub fn open(&self) {
        self.state.loading.store(false, Ordering::SeqCst);
    }

    /// The next request, waiting for one; `None` once the queue is closed and empty.
    pub fn wait(&self) -> Option<Submission> {
        self.receiver.recv().ok().inspect(|_| self.taken())
    }

    /// The next request if one is there.
    pub fn try_take(&self) -> Option<Submission> {
        self.receiver.try_recv().ok().inspect(|_| self.taken())
    }

    fn taken(&self) {
        self.state.unclaimed.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Rank 0's end of a request being served: where its answer and text go, when it arrived,
/// and whether its caller has given it up.
pub(crate) struct Caller {
    reply: Reply,
    cancel: CancelFlag,
    arrived: Instant,
    /// Some of the generated text has been sent.
    streamed: bool,
}

impl Caller {
    pub fn new(reply: Reply, cancel: CancelFlag, arrived: Instant) -> Self {
        Caller {
            reply,
            cancel,
            arrived,
            streamed: false,
        }
    }

    /// The caller gave the request up, or stopped listening (its client went away).
    pub fn gone(&self) -> bool {
        self.cancel.is_cancelled()
            || match &self.reply {
                Reply::Api(sender) => sender.is_closed(),
                Reply::Completion { events, .. } => events.is_closed(),
            }
    }

    /// Sends a completion's prompt, echoed before its text, with its tokens when a streamed
    /// request asked for log-probabilities.
    pub fn echo(&self, row: usize, prompt: &str, logprobs: Option<TokenLogprobs>) {
        if let Reply::Completion { events, .. } = &self.reply {
            let _ = events.send(Event::Delta(row, prompt.to_string(), logprobs));
        }
    }

    /// Sends generated text of a completion's `row`, with the tokens it carries when asked;
    /// the first sent is its time to first token.
    pub fn stream(
        &mut self,
        row: usize,
        text: &str,
        logprobs: Option<TokenLogprobs>,
        metrics: Option<&ServerMetrics>,
    ) {
        let Reply::Completion { events, .. } = &self.reply else {
            return;
        };
        if !self.streamed {
            self.streamed = true;
            if let Some(metrics) = metrics {
                metrics.first_token(self.arrived.elapsed());
            }
        }
        let _ = events.send(Event::Delta(row, text.to_string(), logprobs));
    }

    /// Sends the answer, counted in `metrics` with the tokens it took (none when it failed).
    pub fn answer(self, outcome: Result<Answer, ServiceError>, metrics: Option<&ServerMetrics>) {
        if let Some(metrics) = metrics {
            let usage = outcome.as_ref().map(|a| a.usage).unwrap_or_default();
            metrics.generated(usage.prompt, usage.generated, self.arrived.elapsed());
        }
        let outcome = outcome.map(|answer| answer.body);
        match self.reply {
            Reply::Api(sender) => {
                let _ = sender.send(outcome);
            }
            Reply::Completion {
                events,
                id,
                created,
            } => {
                let outcome = outcome.map(|mut body| {
                    body["id"] = Value::String(id);
                    body["created"] = json!(created);
                    body
                });
                let _ = events.send(Event::Done(outcome));
            }
        }
    }

    /// Answers a request its caller gave up while it ran, counted as cancelled.
    pub fn cancelled(self, metrics: Option<&ServerMetrics>) {
        if let Some(metrics) = metrics {
            metrics.cancelled();
        }
        self.answer(Err(cancelled()), metrics);
    }

    /// Answers a request its caller gave up before it started, counted as cancelled (it
    /// served nothing).
    pub fn abandoned(self, metrics: Option<&ServerMetrics>) {
        if let Some(metrics) = metrics {
            metrics.cancelled();
        }
        self.answer(Err(cancelled()), None);
    }
}

fn cancelled() -> ServiceError {
    ServiceError::Failed("the request was cancelled".into())
}

/// An answer, and the tokens it took for the metrics.
pub(crate) struct Answer {
    pub body: Value,
    pub usage: Usage,
}

/// Prompt tokens a request read and tokens it generated.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Usage {
    pub prompt: u64,
    pub generated: u64,
}
