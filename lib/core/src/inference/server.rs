//! The HTTP side of `text_generation_server`: Megatron's `PUT /api` and OpenAI's
//! `POST /v1/completions` (streamed as server-sent events on request) on a thread pool,
//! a worker that owns the service and hands it every request from a bounded queue on a thread
//! of its own (the service batches them), limits answered with clear errors, and a clean stop.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use serde_json::Value;
use tiny_http::{Header, Method, Request, Response, Server};

use super::api::ApiRequest;
use super::openai::{delta_body, CompletionRequest};
use super::service::{ClientGone, ServiceError, TextGenerationService};

#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub host: String,
    pub port: u16,
    /// Requests waiting for the generation worker beyond the one it is serving.
    pub max_queued: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Connections handled at once.
    pub http_threads: usize,
}

/// What a handler asks of the generation worker.
enum Job {
    Api(ApiRequest, mpsc::Sender<Result<Value, ServiceError>>),
    Completion(CompletionRequest, mpsc::Sender<CompletionEvent>),
}

/// What the worker tells a completion's handler: text as it is generated, then the answer.
enum CompletionEvent {
    Delta(usize, String),
    Done(Result<Value, ServiceError>),
}

/// A running server; [`GenerationServer::run`] serves until `stop` returns true.
pub struct GenerationServer {
    http: Arc<Server>,
    options: ServerOptions,
}

impl GenerationServer {
    pub fn bind(options: ServerOptions) -> Result<Self> {
        let address = format!("{}:{}", options.host, options.port);
        let http = Server::http(&address)
            .map_err(|e| anyhow::anyhow!("cannot listen on {address}: {e}"))?;
        Ok(GenerationServer {
            http: Arc::new(http),
            options,
        })
    }

    /// The address actually bound (port 0 picks a free one).
    pub fn address(&self) -> Option<SocketAddr> {
        self.http.server_addr().to_ip()
    }

    /// Serves until `stop()` is true, then finishes the requests in flight and returns.
    /// `service` is built on the worker thread, which keeps the model for the server's life.
    pub fn run(
        self,
        service: impl FnOnce() -> Result<TextGenerationService> + Send,
        stop: impl Fn() -> bool + Sync,
    ) -> Result<()> {
        let (queue, jobs) = mpsc::sync_channel::<Job>(self.options.max_queued);
        std::thread::scope(|scope| -> Result<()> {
            let worker = scope.spawn(move || -> Result<()> {
                let service = service()?;
                work(&service, jobs);
                Ok(())
            });
            let handlers: Vec<_> = (0..self.options.http_threads.max(1))
                .map(|_| {
                    let queue = queue.clone();
                    let (http, options, stop) = (&self.http, &self.options, &stop);
                    scope.spawn(move || {
                        while !stop() {
                            match http.recv_timeout(Duration::from_millis(100)) {
                                Ok(Some(request)) => handle(request, &queue, options),
                                Ok(None) => {}
                                Err(e) => {
                                    eprintln!("text_generation_server: connection error: {e}")
                                }
                            }
                        }
                    })
                })
                .collect();
            drop(queue);
            for handler in handlers {
                let _ = handler.join();
            }
            worker
                .join()
                .map_err(|_| anyhow::anyhow!("the generation worker panicked"))?
        })
    }
}

/// Serves every job on its own thread: the service batches the requests in flight.
fn work(service: &TextGenerationService, jobs: Receiver<Job>) {
    std::thread::scope(|scope| {
        for job in jobs {
            scope.spawn(move || match job {
                Job::Api(request, reply) => {
                    let _ = reply.send(service.respond(&request));
                }
                Job::Completion(request, events) => {
                    let (id, created) = completion_id();
                    let outcome = service.complete_streaming(
                        &request,
                        &id,
                        created,
                        &mut |index, text| {
                            events
                                .send(CompletionEvent::Delta(index, text.to_string()))
                                .map_err(|_| ClientGone)
                        },
                        None,
                    );
                    let _ = events.send(CompletionEvent::Done(outcome));
                }
            });
        }
    });
    if let Err(e) = service.stop_followers() {
        eprintln!(
            "text_generation_server: releasing the other tensor-parallel ranks failed: {e:#}"
        );
    }
}

/// A completion's id and creation time (seconds since the epoch), as OpenAI names them.
fn completion_id() -> (String, u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (format!("cmpl-{:x}", now.as_nanos()), now.as_secs())
}

type Body = Box<dyn Read + Send>;

fn json_response(status: u16, body: &Value) -> Response<Body> {
    let header = Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    Response::from_data(serde_json::to_vec(body).expect("JSON values serialise"))
        .with_status_code(status)
        .with_header(header)
        .boxed()
}

/// Megatron answers errors with the message as a JSON string.
fn message(status: u16, text: &str) -> Response<Body> {
    json_response(status, &Value::String(text.to_string()))
}

/// OpenAI's error object.
fn openai_error(status: u16, text: &str) -> Response<Body> {
    let kind = if status < 500 {
        "invalid_request_error"
    } else {
        "server_error"
    };
    json_response(
        status,
        &serde_json::json!({"error": {"message": text, "type": kind, "param": null, "code": null}}),
    )
}

fn handle(mut request: Request, queue: &SyncSender<Job>, options: &ServerOptions) {
    let response = match (request.url(), request.method()) {
        ("/api", Method::Put) => megatron_api(&mut request, queue, options),
        ("/v1/completions", Method::Post) => completions(&mut request, queue, options),
        ("/api", _) => message(405, "use PUT /api"),
        ("/v1/completions", _) => openai_error(405, "use POST /v1/completions"),
        (url, _) => message(
            404,
            &format!("no such endpoint: {url} (PUT /api or POST /v1/completions)"),
        ),
    };
    let _ = request.respond(response);
}

/// The request body as JSON, or the status and message to answer instead.
fn read_json(request: &mut Request, options: &ServerOptions) -> Result<Value, (u16, String)> {
    let too_large = || {
        (
            413,
            format!(
                "the request body is larger than {} bytes",
                options.max_body_bytes
            ),
        )
    };
    if request
        .body_length()
        .is_some_and(|n| n > options.max_body_bytes)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    let limit = options.max_body_bytes as u64 + 1;
    request
        .as_reader()
        .take(limit)
        .read_to_end(&mut body)
        .map_err(|e| (400, format!("cannot read the request body: {e}")))?;
    if body.len() > options.max_body_bytes {
        return Err(too_large());
    }
    serde_json::from_slice(&body).map_err(|e| (400, format!("malformed JSON: {e}")))
}

fn submit(queue: &SyncSender<Job>, job: Job, options: &ServerOptions) -> Result<(), String> {
    match queue.try_send(job) {
        Ok(()) => Ok(()),
        Err(TrySendError::Full(_)) => Err(format!(
            "the server is busy ({} requests are waiting); try again later",
            options.max_queued
        )),
        Err(TrySendError::Disconnected(_)) => Err("the server is shutting down".into()),
    }
}

fn megatron_api(
    request: &mut Request,
    queue: &SyncSender<Job>,
    options: &ServerOptions,
) -> Response<Body> {
    let json = match read_json(request, options) {
        Ok(json) => json,
        Err((status, text)) => return message(status, &text),
    };
    let parsed = match ApiRequest::parse(&json) {
        Ok(parsed) => parsed,
        Err(e) => return message(400, &e.0),
    };
    if !parsed.no_log {
        let peer = request
            .remote_addr()
            .map(|a| a.ip().to_string())
            .unwrap_or_default();
        println!("request IP: {peer}");
        println!("{json}");
        println!(
            "start time: {}",
            chrono::Local::now().format("%Y-%m-%d %H:%M:%S%.6f")
        );
    }
    let (reply, answer) = mpsc::channel();
    if let Err(busy) = submit(queue, Job::Api(parsed, reply), options) {
        return message(503, &busy);
    }
    match answer.recv() {
        Ok(Ok(body)) => json_response(200, &body),
        Ok(Err(ServiceError::Rejected(text))) => message(400, &text),
        Ok(Err(ServiceError::Busy(text))) => message(503, &text),
        Ok(Err(ServiceError::Failed(text))) => message(500, &text),
        Err(_) => message(503, "the server is shutting down"),
    }
}

fn completions(
    request: &mut Request,
    queue: &SyncSender<Job>,
    options: &ServerOptions,
) -> Response<Body> {
    let parsed = match read_json(request, options)
        .and_then(|json| CompletionRequest::parse(&json).map_err(|e| (400, e.0)))
    {
        Ok(parsed) => parsed,
        Err((status, text)) => return openai_error(status, &text),
    };
    let (stream, model) = (parsed.stream, parsed.model.clone());
    let (events, received) = mpsc::channel();
    if let Err(busy) = submit(queue, Job::Completion(parsed, events), options) {
        return openai_error(503, &busy);
    }
    if stream {
        // The status goes out with the first event: a request the worker rejects before any
        // text (too long, say) is answered 400 like an unstreamed one, not 200 and an error.
        let first = match received.recv() {
            Ok(CompletionEvent::Done(Err(ServiceError::Rejected(text)))) => {
                return openai_error(400, &text)
            }
            Ok(CompletionEvent::Done(Err(ServiceError::Busy(text)))) => {
                return openai_error(503, &text)
            }
            Ok(CompletionEvent::Done(Err(ServiceError::Failed(text)))) => {
                return openai_error(500, &text)
            }
            Ok(event) => event,
            Err(_) => return openai_error(503, "the server is shutting down"),
        };
        let header =
            Header::from_bytes("Content-Type", "text/event-stream").expect("a valid header");
        let body = ServerSentEvents {
            first: Some(first),
            events: received,
            model,
            pending: Vec::new(),
            finished: false,
        };
        return Response::new(
            tiny_http::StatusCode(200),
            vec![header],
            Box::new(body) as Body,
            None,
            None,
        );
    }
    loop {
        match received.recv() {
            Ok(CompletionEvent::Delta(..)) => continue,
            Ok(CompletionEvent::Done(Ok(body))) => return json_response(200, &body),
            Ok(CompletionEvent::Done(Err(ServiceError::Rejected(text)))) => {
                return openai_error(400, &text)
            }
            Ok(CompletionEvent::Done(Err(ServiceError::Busy(text)))) => {
                return openai_error(503, &text)
            }
            Ok(CompletionEvent::Done(Err(ServiceError::Failed(text)))) => {
                return openai_error(500, &text)
            }
            Err(_) => return openai_error(503, "the server is shutting down"),
        }
    }
}

/// Server-sent events from a completion's worker events: a `data:` line per text delta, then
/// the choices with their finish reasons and the usage, then `data: [DONE]`.
struct ServerSentEvents {
    /// The event already received to decide the status.
    first: Option<CompletionEvent>,
    events: Receiver<CompletionEvent>,
    model: String,
    pending: Vec<u8>,
    finished: bool,
}

impl ServerSentEvents {
    fn next_event(&mut self) -> Option<Vec<u8>> {
        if self.finished {
            return None;
        }
        let event = |value: &Value| format!("data: {value}\n\n").into_bytes();
        let next = match self.first.take() {
            Some(first) => Ok(first),
            None => self.events.recv(),
        };
        match next {
            Ok(CompletionEvent::Delta(index, text)) => {
                let (id, created) = completion_id();
                Some(event(&delta_body(&id, created, &self.model, index, &text)))
            }
            Ok(CompletionEvent::Done(outcome)) => {
                self.finished = true;
                let last = match outcome {
                    Ok(mut body) => {
                        for choice in body["choices"].as_array_mut().into_iter().flatten() {
                            choice["text"] = Value::String(String::new());
                        }
                        body
                    }
                    Err(
                        ServiceError::Rejected(text)
                        | ServiceError::Busy(text)
                        | ServiceError::Failed(text),
                    ) => {
                        serde_json::json!({"error": {"message": text}})
                    }
                };
                let mut bytes = event(&last);
                bytes.extend_from_slice(b"data: [DONE]\n\n");
                Some(bytes)
            }
            Err(_) => {
                self.finished = true;
                None
            }
        }
    }
}

impl Read for ServerSentEvents {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        while self.pending.is_empty() {
            match self.next_event() {
                Some(bytes) => self.pending = bytes,
                None => return Ok(0),
            }
        }
        let n = buffer.len().min(self.pending.len());
        buffer[..n].copy_from_slice(&self.pending[..n]);
        self.pending.drain(..n);
        Ok(n)
    }
}
