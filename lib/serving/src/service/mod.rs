//! The text generation service: a validated `/api` request or OpenAI completion in, Megatron's
//! or OpenAI's answer out, every request batched with the others by one scheduler thread.
//!
//! Callers submit to the scheduler's one queue ([`queue`]) and receive the answer, and a
//! completion's text as it is generated, on a channel; the scheduler ([`scheduler`]) runs the
//! batch's steps and answers. The HTTP server's handlers submit and await
//! ([`TextGenerationService::serve`] runs the scheduler on the server's generation thread);
//! [`TextGenerationService::respond`] and [`TextGenerationService::complete`] submit from any
//! thread and wait, the scheduler then on a thread of the service's own.

pub(crate) mod queue;
mod scheduler;
mod served_model;
pub(crate) mod tensor_parallel;
mod workload;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

use anyhow::Result;
use megatron_data::tokenizer::Tokenizer;
use megatron_inference::{CacheUse, CausalLm};
use megatron_models::GptModel;
use megatron_parallel::Communicator;
use serde_json::Value;
use tokio::sync::{mpsc as events, oneshot};

use crate::api::ApiRequest;
use crate::metrics::ServerMetrics;
use crate::openai::CompletionRequest;
use crate::settings::ServingSettings;
use queue::{Event, Inbox, Refused, Reply, RequestQueue, Submission};
use scheduler::Scheduler;
use served_model::ServedModel;
use tensor_parallel::SharedJob;
pub(crate) use workload::Workload;

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

/// What a streaming sink answers when its client has gone away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientGone;

/// Serves requests on a model of any family the inference engine runs ([`CausalLm`]).
pub struct TextGenerationService<M = GptModel> {
    /// Until a scheduler takes it; the scheduler hands it back when it stops.
    served: Mutex<Option<ServedModel<M>>>,
    workload: Arc<Workload>,
    /// The queue of [`Self::respond`] and [`Self::complete`], made by the first of them with
    /// the scheduler thread that serves it.
    own_queue: OnceLock<RequestQueue>,
    own_scheduler: Mutex<Option<JoinHandle<()>>>,
}

impl<M: CausalLm> TextGenerationService<M> {
    /// Serves `model` with `tokenizer` (the one it was trained with) as `settings` say.
    pub fn new(model: M, tokenizer: Arc<dyn Tokenizer>, settings: ServingSettings) -> Result<Self> {
        let served = ServedModel::new(model, tokenizer, settings)?;
        Ok(TextGenerationService {
            workload: served.workload.clone(),
            served: Mutex::new(Some(served)),
            own_queue: OnceLock::new(),
            own_scheduler: Mutex::new(None),
        })
    }

    /// Serves with tensor parallelism over `group`: rank 0 serves requests, the other ranks
    /// [`Self::follow`].
    pub fn with_tensor_parallel(mut self, group: Arc<dyn Communicator>) -> Self {
        if let Some(served) = self.served.get_mut().unwrap_or_else(|p| p.into_inner()) {
            served.mirror = (group.size() > 1).then_some(group);
        }
        self
    }

    /// The KV cache's blocks and the rows and requests in the scheduler, after the last step.
    pub fn cache_use(&self) -> CacheUse {
        self.workload.cache_use()
    }

    /// What the scheduler is doing, for as long as the caller keeps it (the server's
    /// `/metrics`).
    pub(crate) fn workload(&self) -> Arc<Workload> {
        self.workload.clone()
    }

    /// The server's generation thread (rank 0): makes the KV cache and captures the decode
    /// graphs (their failure returned), calls `ready`, then serves the requests `inbox`
    /// receives, reporting to `metrics`, until its queue is closed and every request taken is
    /// answered; then releases the other tensor-parallel ranks.
    pub(crate) fn serve(
        &self,
        inbox: Inbox,
        metrics: &ServerMetrics,
        ready: impl FnOnce(),
    ) -> Result<()> {
        let served = self.take_served().ok_or_else(already_serving)?;
        let served_out = Scheduler::new(&served, Some(metrics)).lead(&inbox, ready);
        self.put_served(served);
        served_out
    }

    /// The other tensor-parallel ranks: runs every step rank 0 announces, until it stops.
    pub fn follow(&self) -> Result<()> {
        let served = self.take_served().ok_or_else(already_serving)?;
        let followed = Scheduler::new(&served, None).follow();
        self.put_served(served);
        followed
    }
}

impl<M: CausalLm + Send + 'static> TextGenerationService<M> {
    /// Megatron's answer to `request`, waiting for it (not from an async runtime's thread).
    pub fn respond(&self, request: &ApiRequest) -> Result<Value, ServiceError> {
        self.respond_cancellable(request, None)
    }

    /// [`Self::respond`], given up when `cancel` is set.
    pub fn respond_cancellable(
        &self,
        request: &ApiRequest,
        cancel: Option<&CancelFlag>,
    ) -> Result<Value, ServiceError> {
        let (reply, answer) = oneshot::channel();
        self.submit(
            SharedJob::Api(request.clone()),
            Reply::Api(reply),
            cancel.cloned().unwrap_or_default(),
        )?;
        answer
            .blocking_recv()
            .unwrap_or_else(|_| Err(shutting_down()))
    }

    /// An OpenAI completion with this `id` and `created` time: `on_delta(choice, text)`
    /// receives the text as it is generated (held back while it may still turn into a stop
    /// sequence or an incomplete character). Waits for the answer (not from an async
    /// runtime's thread).
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
        let cancel = cancel.cloned().unwrap_or_default();
        let (events, mut received) = events::unbounded_channel();
        let reply = Reply::Completion {
            events,
            id: id.to_string(),
            created,
        };
        self.submit(
            SharedJob::Completion(request.clone()),
            reply,
            cancel.clone(),
        )?;
        loop {
            match received.blocking_recv() {
                Some(Event::Delta(choice, text, _)) => {
                    if on_delta(choice, &text).is_err() {
                        cancel.cancel();
                    }
                }
                Some(Event::Done(outcome)) => return outcome,
                None => return Err(shutting_down()),
            }
        }
    }

    /// Hands `job` to the service's own scheduler, starting it the first time.
    fn submit(&self, job: SharedJob, reply: Reply, cancel: CancelFlag) -> Result<(), ServiceError> {
        let submission = Submission::new(job, false, reply, cancel);
        self.own_queue()
            .submit(submission)
            .map_err(|refused| match refused {
                Refused::Full(text) => ServiceError::Busy(text),
                Refused::Closed => shutting_down(),
            })
    }

    /// The service's own queue, its scheduler thread started the first time.
    fn own_queue(&self) -> &RequestQueue {
        self.own_queue.get_or_init(|| {
            let (queue, inbox) = RequestQueue::new(1);
            // The scheduler starts now: its batcher's limit holds from the first request.
            inbox.open();
            if let Some(served) = self.take_served() {
                let handle = std::thread::Builder::new()
                    .name("generation-scheduler".into())
                    .spawn(move || {
                        if let Err(e) = Scheduler::new(&served, None).lead(&inbox, || {}) {
                            // Nothing can be served: every request is answered why.
                            let message = format!("{e:#}");
                            while let Some(submission) = inbox.wait() {
                                submission.fail(ServiceError::Failed(message.clone()));
                            }
                        }
                    })
                    .expect("the scheduler thread starts");
                *self.own_scheduler.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
            }
            queue
        })
    }
}

impl<M> TextGenerationService<M> {
    /// The served model, while no scheduler holds it.
    fn take_served(&self) -> Option<ServedModel<M>> {
        self.served.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn put_served(&self, served: ServedModel<M>) {
        *self.served.lock().unwrap_or_else(|p| p.into_inner()) = Some(served);
    }
}

impl<M> Drop for TextGenerationService<M> {
    /// Stops the service's own scheduler after the requests it holds.
    fn drop(&mut self) {
        if let Some(queue) = self.own_queue.get() {
            queue.close();
        }
        let handle = self
            .own_scheduler
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

fn already_serving() -> anyhow::Error {
    anyhow::anyhow!("this service is already serving")
}

fn shutting_down() -> ServiceError {
    ServiceError::Busy("the server is shutting down".into())
}
