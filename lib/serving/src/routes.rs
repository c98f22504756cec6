//! The server's endpoints: Megatron's `PUT /api`, OpenAI's `POST /v1/completions`,
//! `POST /v1/chat/completions` (streamed as server-sent events on request) and
//! `GET /v1/models`, and `GET /metrics` and `GET /health` for operators. Bodies are read
//! within a time and size limit; a generation request is submitted straight to the scheduler's
//! queue and its handler awaits the answer (or streams its events), refused with 503 and
//! `Retry-After` when the queue is full or the server is stopping. A client that goes away
//! cancels its request.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::header::{CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use hyper::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc as events, oneshot};

use super::api::ApiRequest;
use super::chat::{chat_body, chat_chunk, chat_logprobs, ChatRequest, ChatTemplate};
use super::metrics::{Gauges, ServerMetrics};
use super::openai::{delta_body, CompletionRequest, TokenLogprobs};
use super::options::ServerOptions;
use super::service::queue::{Event, Refused, Reply, RequestQueue, Submission};
use super::service::tensor_parallel::SharedJob;
use super::service::{CancelFlag, ServiceError, Workload};

pub(super) type ResponseBody = UnsyncBoxBody<Bytes, Infallible>;

/// Seconds a client is asked to wait when the queue is full.
const RETRY_WHEN_BUSY: u64 = 1;
/// Seconds a client is asked to wait while the server loads its model or stops.
const RETRY_WHEN_UNAVAILABLE: u64 = 5;

/// What the connections share with each other and the generation thread.
pub(super) struct Shared {
    pub options: ServerOptions,
    /// The scheduler's queue.
    pub queue: RequestQueue,
    /// What the scheduler is doing, once the model is loaded.
    pub workload: OnceLock<Arc<Workload>>,
    pub metrics: ServerMetrics,
    pub chat: ChatTemplate,
    /// The model is loaded.
    pub ready: AtomicBool,
    /// SIGTERM arrived: new generation requests are refused, those in flight finish.
    pub draining: AtomicBool,
    /// Generation requests admitted whose answer is not yet complete.
    pub in_flight: AtomicUsize,
    pub connections: AtomicUsize,
    pub started: u64,
}

impl Shared {
    fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// An admitted generation request, counted until its answer is complete (a streamed one's
/// body holds it), so that a stopping server waits for it.
pub(super) struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: &Arc<Shared>) -> Self {
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        InFlight(shared.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Cancels its request when dropped: held by the handler (or its streamed body) until the
/// answer is complete, so that a client going away frees the request's rows and KV cache.
/// Once the answer is complete the service has forgotten the request and the flag does nothing.
struct CancelOnDrop(CancelFlag);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// How an endpoint words its errors: Megatron answers the message as a JSON string, OpenAI's
/// endpoints with their error object.
#[derive(Clone, Copy)]
enum Style {
    Megatron,
    OpenAi,
}

fn full(bytes: impl Into<Bytes>) -> ResponseBody {
    Full::new(bytes.into()).boxed_unsync()
}

fn respond(status: u16, content_type: &str, body: ResponseBody) -> Response<ResponseBody> {
    let mut response = Response::new(body);
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    response.headers_mut().insert(
        CONTENT_TYPE,
        content_type.parse().expect("a valid content type"),
    );
    response
}

fn json_response(status: u16, body: &Value) -> Response<ResponseBody> {
    respond(
        status,
        "application/json",
        full(serde_json::to_vec(body).expect("JSON values serialise")),
    )
}

fn error(style: Style, status: u16, text: &str) -> Response<ResponseBody> {
    match style {
        Style::Megatron => json_response(status, &Value::String(text.to_string())),
        Style::OpenAi => {
            let kind = if status < 500 {
                "invalid_request_error"
            } else {
                "server_error"
            };
            json_response(
                status,
                &json!({"error": {"message": text, "type": kind, "param": null, "code": null}}),
            )
        }
    }
}

/// 503 with `Retry-After`; a stopping server also closes the connection.
fn unavailable(
    style: Style,
    shared: &Shared,
    text: &str,
    retry_after: u64,
) -> Response<ResponseBody> {
    let mut response = error(style, 503, text);
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, retry_after.into());
    if shared.draining() {
        headers.insert(CONNECTION, "close".parse().expect("a valid header"));
    }
    response
}

fn stopping(style: Style, shared: &Shared) -> Response<ResponseBody> {
    unavailable(
        style,
        shared,
        "the server is shutting down; try again later",
        RETRY_WHEN_UNAVAILABLE,
    )
}

fn service_error(style: Style, shared: &Shared, failure: ServiceError) -> Response<ResponseBody> {
    match failure {
        ServiceError::Rejected(text) => error(style, 400, &text),
        ServiceError::Busy(text) => unavailable(style, shared, &text, RETRY_WHEN_BUSY),
        ServiceError::Failed(text) => error(style, 500, &text),
    }
}

/// The routes, each with its label in the metrics.
const ENDPOINTS: [&str; 7] = [
    "/api",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/{id}",
    "/metrics",
    "/health",
];

/// The route a path names: ours, or the spelling Megatron's servers answer to (`/completions`,
/// `/chat/completions`, `/v1/health`), counted under our route in the metrics.
fn endpoint_of(path: &str) -> &'static str {
    let path = match path {
        "/completions" => "/v1/completions",
        "/chat/completions" => "/v1/chat/completions",
        "/v1/health" => "/health",
        path if path
            .strip_prefix("/v1/models/")
            .is_some_and(|id| !id.is_empty()) =>
        {
            "/v1/models/{id}"
        }
        path => path,
    };
    ENDPOINTS
        .iter()
        .copied()
        .find(|e| *e == path)
        .unwrap_or("other")
}

/// Counts its request's client as gone when dropped before [`Self::answered`]: hyper drops a
/// handler whose connection closed.
struct Unanswered<'a> {
    metrics: &'a ServerMetrics,
    endpoint: &'static str,
    answered: bool,
}

impl Unanswered<'_> {
    fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.metrics.disconnected(self.endpoint);
        }
    }
}

pub(super) async fn route(
    request: Request<Incoming>,
    shared: Arc<Shared>,
    peer: SocketAddr,
) -> Result<Response<ResponseBody>, Infallible> {
    let path = request.uri().path().to_string();
    let endpoint = endpoint_of(&path);
    let method = request.method().clone();
    let unanswered = Unanswered {
        metrics: &shared.metrics,
        endpoint,
        answered: false,
    };
    let response = match (endpoint, method) {
        ("/api", Method::PUT) => megatron_api(request, &shared, peer).await,
        ("/v1/completions", Method::POST) => completions(request, &shared).await,
        ("/v1/chat/completions", Method::POST) => chat(request, &shared).await,
        ("/v1/models", Method::GET) => models(&shared),
        ("/v1/models/{id}", Method::GET) => model(&shared, &path["/v1/models/".len()..]),
        ("/metrics", Method::GET) => metrics(&shared),
        ("/health", Method::GET) => health(&shared),
        ("/api", _) => error(Style::Megatron, 405, "use PUT /api"),
        ("/v1/completions" | "/v1/chat/completions", _) => {
            error(Style::OpenAi, 405, &format!("use POST {path}"))
        }
        ("other", _) => error(
            Style::Megatron,
            404,
            &format!(
                "no such endpoint: {path} (PUT /api, POST /v1/completions, POST \
                 /v1/chat/completions, GET /v1/models, /v1/models/{{id}}, /metrics or /health)"
            ),
        ),
        (_, _) => error(Style::Megatron, 405, &format!("use GET {path}")),
    };
    unanswered.answered();
    shared
        .metrics
        .answered(endpoint, response.status().as_u16());
    Ok(response)
}

/// The request body as JSON, read within `--http-body-timeout` and `--max-request-bytes`, or
/// the status and message to answer instead.
async fn read_json(
    request: Request<Incoming>,
    options: &ServerOptions,
) -> Result<Value, (u16, String)> {
    let too_large = || {
        (
            413,
            format!(
                "the request body is larger than {} bytes",
                options.max_body_bytes
            ),
        )
    };
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > options.max_body_bytes as u64) {
        return Err(too_large());
    }
    let body = Limited::new(request.into_body(), options.max_body_bytes);
    let collected = match tokio::time::timeout(options.body_timeout, body.collect()).await {
        Err(_) => {
            return Err((
                408,
                format!(
                    "the request body did not arrive within {} s",
                    options.body_timeout.as_secs_f64()
                ),
            ))
        }
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(too_large()),
        Ok(Err(e)) => return Err((400, format!("cannot read the request body: {e}"))),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    serde_json::from_slice(&collected).map_err(|e| (400, format!("malformed JSON: {e}")))
}

/// Submits a request to the scheduler, or gives the answer to give instead (503 when the queue
/// is full or the server is stopping).
fn admit(
    shared: &Arc<Shared>,
    submission: Submission,
    style: Style,
) -> Result<InFlight, Response<ResponseBody>> {
    let in_flight = InFlight::new(shared);
    if shared.draining() {
        return Err(stopping(style, shared));
    }
    match shared.queue.submit(submission) {
        Ok(()) => Ok(in_flight),
        Err(Refused::Full(text)) => Err(unavailable(style, shared, &text, RETRY_WHEN_BUSY)),
        Err(Refused::Closed) => Err(stopping(style, shared)),
    }
}

async fn megatron_api(
    request: Request<Incoming>,
    shared: &Arc<Shared>,
    peer: SocketAddr,
) -> Response<ResponseBody> {
    let style = Style::Megatron;
    let json = match read_json(request, &shared.options).await {
        Ok(json) => json,
        Err((status, text)) => return error(style, status, &text),
    };
    let parsed = match ApiRequest::parse(&json) {
        Ok(parsed) => parsed,
        Err(e) => return error(style, 400, &e.0),
    };
    if !parsed.no_log {
        println!("request IP: {}", peer.ip());
        println!("{json}");
        println!(
            "start time: {}",
            chrono::Local::now().format("%Y-%m-%d %H:%M:%S%.6f")
        );
    }
    let (reply, answer) = oneshot::channel();
    let cancel = CancelFlag::new();
    let _cancel_on_drop = CancelOnDrop(cancel.clone());
    let submission = Submission::new(SharedJob::Api(parsed), false, Reply::Api(reply), cancel);
    let _in_flight = match admit(shared, submission, style) {
        Ok(in_flight) => in_flight,
        Err(response) => return response,
    };
    match answer.await {
        Ok(Ok(body)) => json_response(200, &body),
        Ok(Err(e)) => service_error(style, shared, e),
        Err(_) => stopping(style, shared),
    }
}

/// A completion's or chat completion's id and creation time (seconds since the epoch).
fn completion_id(prefix: &str) -> (String, u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (format!("{prefix}-{:x}", now.as_nanos()), now.as_secs())
}

/// Turns a completion's events into server-sent events in one of OpenAI's formats.
trait StreamFormat: Send + Unpin + 'static {
    /// The text to send for `event`; `true` when it is the last.
    fn format(&mut self, event: Event) -> (String, bool);
}

fn data(value: &Value) -> String {
    format!("data: {value}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

fn stream_error(text: String) -> String {
    data(&json!({"error": {"message": text}}))
}

/// What a choice's deltas have carried: bytes of its text, and tokens with their
/// log-probabilities.
#[derive(Debug, Clone, Copy, Default)]
struct Carried {
    text: usize,
    tokens: usize,
}

impl Carried {
    fn add(
        carried: &mut HashMap<usize, Carried>,
        index: usize,
        text: &str,
        logprobs: Option<&TokenLogprobs>,
    ) {
        let choice = carried.entry(index).or_default();
        choice.text += text.len();
        choice.tokens += logprobs.map_or(0, |l| l.tokens.len());
    }

    /// The end of a choice's `text` no delta carried: what a held back stop-sequence prefix or
    /// unfinished character turned into when the row ended, or a streamed echo answered at
    /// once (`max_tokens: 0`).
    fn rest(&self, text: &str) -> String {
        text.get(self.text..).unwrap_or_default().to_string()
    }
}

/// `/v1/completions`: a `text_completion` per text delta (with the tokens it carries when
/// log-probabilities were asked), then the choices with their finish reasons, the text and
/// tokens not yet carried, and the usage.
struct CompletionStream {
    id: String,
    created: u64,
    model: String,
    carried: HashMap<usize, Carried>,
}

impl StreamFormat for CompletionStream {
    fn format(&mut self, event: Event) -> (String, bool) {
        match event {
            Event::Delta(index, text, logprobs) => {
                Carried::add(&mut self.carried, index, &text, logprobs.as_ref());
                let body = delta_body(
                    &self.id,
                    self.created,
                    &self.model,
                    index,
                    &text,
                    logprobs.as_ref(),
                );
                (data(&body), false)
            }
            Event::Done(Ok(mut body)) => {
                for (index, choice) in body["choices"]
                    .as_array_mut()
                    .into_iter()
                    .flatten()
                    .enumerate()
                {
                    let carried = self.carried.get(&index).copied().unwrap_or_default();
                    let rest = carried.rest(choice["text"].as_str().unwrap_or(""));
                    choice["text"] = Value::String(rest);
                    if let Some(logprobs) = choice["logprobs"].as_object_mut() {
                        for key in ["tokens", "token_logprobs", "text_offset", "top_logprobs"] {
                            if let Some(Value::Array(items)) = logprobs.get_mut(key) {
                                items.drain(..carried.tokens.min(items.len()));
                            }
                        }
                    }
                }
                (data(&body) + DONE, true)
            }
            Event::Done(Err(
                ServiceError::Rejected(text)
                | ServiceError::Busy(text)
                | ServiceError::Failed(text),
            )) => (stream_error(text) + DONE, true),
        }
    }
}

/// `/v1/chat/completions`: `chat.completion.chunk`s, per choice the assistant's role first,
/// then the content deltas and a last one with the finish reason; when asked, one with the
/// usage after all.
struct ChatStream {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Per choice, whether its role was sent, and what its deltas carried.
    announced: HashSet<usize>,
    carried: HashMap<usize, Carried>,
}

impl ChatStream {
    fn chunk(&mut self, index: usize, delta: Value, logprobs: Value, finish: Value) -> String {
        let mut out = String::new();
        if self.announced.insert(index) {
            out += &data(&chat_chunk(
                &self.id,
                self.created,
                &self.model,
                index,
                json!({"role": "assistant", "content": ""}),
                Value::Null,
                Value::Null,
            ));
        }
        out + &data(&chat_chunk(
            &self.id,
            self.created,
            &self.model,
            index,
            delta,
            logprobs,
            finish,
        ))
    }
}

impl StreamFormat for ChatStream {
    fn format(&mut self, event: Event) -> (String, bool) {
        match event {
            Event::Delta(index, text, logprobs) => {
                Carried::add(&mut self.carried, index, &text, logprobs.as_ref());
                let logprobs = logprobs
                    .as_ref()
                    .map_or(Value::Null, |l| chat_logprobs(&l.to_json()));
                (
                    self.chunk(index, json!({"content": text}), logprobs, Value::Null),
                    false,
                )
            }
            Event::Done(Ok(body)) => {
                let mut out = String::new();
                for (index, choice) in body["choices"].as_array().into_iter().flatten().enumerate()
                {
                    let finish = choice["finish_reason"].clone();
                    let carried = self.carried.get(&index).copied().unwrap_or_default();
                    // The tokens no delta carried (those after a stop sequence, say).
                    let logprobs = match chat_logprobs(&choice["logprobs"]) {
                        Value::Object(mut logprobs) => {
                            if let Some(Value::Array(content)) = logprobs.get_mut("content") {
                                content.drain(..carried.tokens.min(content.len()));
                            }
                            Value::Object(logprobs)
                        }
                        other => other,
                    };
                    let rest = carried.rest(choice["text"].as_str().unwrap_or(""));
                    let delta = if rest.is_empty() {
                        json!({})
                    } else {
                        json!({"content": rest})
                    };
                    out += &self.chunk(index, delta, logprobs, finish);
                }
                if self.include_usage {
                    out += &data(&json!({"id": self.id, "object": "chat.completion.chunk",
                        "created": self.created, "model": self.model, "choices": [],
                        "usage": body["usage"]}));
                }
                (out + DONE, true)
            }
            Event::Done(Err(
                ServiceError::Rejected(text)
                | ServiceError::Busy(text)
                | ServiceError::Failed(text),
            )) => (stream_error(text) + DONE, true),
        }
    }
}

/// A streamed answer. Dropping it (the client went away) drops the receiving end of the
/// events and cancels the request, which stops the generation at its next step.
struct EventStream<F> {
    first: Option<Event>,
    events: events::UnboundedReceiver<Event>,
    format: F,
    finished: bool,
    _cancel_on_drop: CancelOnDrop,
    _in_flight: InFlight,
}

impl<F: StreamFormat> Body for EventStream<F> {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        let event = match this.first.take() {
            Some(event) => event,
            None => match this.events.poll_recv(cx) {
                Poll::Ready(Some(event)) => event,
                Poll::Ready(None) => {
                    this.finished = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            },
        };
        let (text, last) = this.format.format(event);
        this.finished = last;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(text)))))
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }
}

/// Queues a completion and answers it: whole, or streamed through `format`.
async fn run_completion<F: StreamFormat>(
    shared: &Arc<Shared>,
    request: CompletionRequest,
    (id, created): (String, u64),
    fill_context: bool,
    format: F,
    whole: impl FnOnce(Value) -> Value,
) -> Response<ResponseBody> {
    let style = Style::OpenAi;
    let stream = request.stream;
    let (events, mut received) = events::unbounded_channel();
    let cancel = CancelFlag::new();
    let cancel_on_drop = CancelOnDrop(cancel.clone());
    let reply = Reply::Completion {
        events,
        id,
        created,
    };
    let submission = Submission::new(SharedJob::Completion(request), fill_context, reply, cancel);
    let in_flight = match admit(shared, submission, style) {
        Ok(in_flight) => in_flight,
        Err(response) => return response,
    };
    if stream {
        // The status goes out with the first event: a request the scheduler rejects
        // before any text (too long, say) is answered 400 like an unstreamed one.
        let first = match received.recv().await {
            Some(Event::Done(Err(e))) => return service_error(style, shared, e),
            Some(event) => event,
            None => return stopping(style, shared),
        };
        let body = EventStream {
            first: Some(first),
            events: received,
            format,
            finished: false,
            _cancel_on_drop: cancel_on_drop,
            _in_flight: in_flight,
        };
        let mut response = respond(200, "text/event-stream", body.boxed_unsync());
        response
            .headers_mut()
            .insert("Cache-Control", "no-cache".parse().expect("a valid header"));
        return response;
    }
    loop {
        match received.recv().await {
            Some(Event::Delta(..)) => continue,
            Some(Event::Done(Ok(body))) => return json_response(200, &whole(body)),
            Some(Event::Done(Err(e))) => return service_error(style, shared, e),
            None => return stopping(style, shared),
        }
    }
}

async fn completions(request: Request<Incoming>, shared: &Arc<Shared>) -> Response<ResponseBody> {
    let parsed = match read_json(request, &shared.options)
        .await
        .and_then(|json| CompletionRequest::parse(&json).map_err(|e| (400, e.0)))
    {
        Ok(parsed) => parsed,
        Err((status, text)) => return error(Style::OpenAi, status, &text),
    };
    let (id, created) = completion_id("cmpl");
    let format = CompletionStream {
        id: id.clone(),
        created,
        model: parsed.model.clone(),
        carried: HashMap::new(),
    };
    run_completion(shared, parsed, (id, created), false, format, |body| body).await
}

async fn chat(request: Request<Incoming>, shared: &Arc<Shared>) -> Response<ResponseBody> {
    let parsed = match read_json(request, &shared.options)
        .await
        .and_then(|json| ChatRequest::parse(&json).map_err(|e| (400, e.0)))
    {
        Ok(parsed) => parsed,
        Err((status, text)) => return error(Style::OpenAi, status, &text),
    };
    let prompt = match shared.chat.render(&parsed.messages) {
        Ok(prompt) => prompt,
        Err(e) => return error(Style::OpenAi, 400, &e.0),
    };
    let mut completion = parsed.completion;
    completion.prompts = vec![prompt];
    let (id, created) = completion_id("chatcmpl");
    let format = ChatStream {
        id: id.clone(),
        created,
        model: completion.model.clone(),
        include_usage: parsed.include_usage,
        announced: HashSet::new(),
        carried: HashMap::new(),
    };
    let answer_id = id.clone();
    run_completion(
        shared,
        completion,
        (id, created),
        parsed.unbounded,
        format,
        move |body| chat_body(&body, &answer_id),
    )
    .await
}

/// The served model as OpenAI's model object.
fn model_object(shared: &Shared) -> Value {
    json!({"id": shared.options.model_name, "object": "model", "created": shared.started,
           "owned_by": "megatron-rs"})
}

fn models(shared: &Shared) -> Response<ResponseBody> {
    json_response(
        200,
        &json!({"object": "list", "data": [model_object(shared)]}),
    )
}

/// `GET /v1/models/{id}`: the served model, or OpenAI's 404 for any other id.
fn model(shared: &Shared, id: &str) -> Response<ResponseBody> {
    if id == shared.options.model_name {
        json_response(200, &model_object(shared))
    } else {
        error(
            Style::OpenAi,
            404,
            &format!(
                "the model {id:?} does not exist; this server serves {:?}",
                shared.options.model_name
            ),
        )
    }
}

fn metrics(shared: &Shared) -> Response<ResponseBody> {
    let workload = shared.workload.get();
    let cache = workload.map(|w| w.cache_use()).unwrap_or_default();
    let serving = workload.map_or(0, |w| w.serving());
    let gauges = Gauges {
        queued: shared.queue.waiting() + cache.waiting_requests,
        running: serving.saturating_sub(cache.waiting_requests),
        batch_size: cache.running_rows,
        kv_blocks_used: cache.used_blocks.max(0) as u64,
        kv_blocks_capacity: cache.total_blocks.max(0) as u64,
        kv_blocks_peak: cache.peak_blocks.max(0) as u64,
        steps: cache.steps,
        steps_ahead: cache.steps_ahead,
        prefilled_positions: cache.prefilled_positions,
        open_connections: shared.connections.load(Ordering::SeqCst),
        draining: shared.draining(),
    };
    respond(
        200,
        "text/plain; version=0.0.4",
        full(shared.metrics.render(&gauges)),
    )
}

/// 200 while serving; 503 with `Retry-After` while the model loads or the server stops.
fn health(shared: &Shared) -> Response<ResponseBody> {
    let status = if shared.draining() {
        "stopping"
    } else if !shared.ready.load(Ordering::SeqCst) {
        "loading"
    } else {
        return json_response(200, &json!({"status": "ok"}));
    };
    let mut response = json_response(503, &json!({"status": status}));
    response
        .headers_mut()
        .insert(RETRY_AFTER, RETRY_WHEN_UNAVAILABLE.into());
    response
}

/// The answer to a connection beyond `--max-connections`, written without HTTP parsing.
pub(super) fn too_many_connections() -> String {
    let body = "\"too many connections; try again later\"";
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: \
         {RETRY_WHEN_BUSY}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}
