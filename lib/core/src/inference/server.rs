//! The HTTP side of `text_generation_server`: Megatron's `PUT /api` on a small thread pool,
//! one generation worker that owns the model and takes requests from a bounded queue (so many
//! clients are all answered, in turn), limits answered with clear errors, and a clean stop.

use std::io::Read;
use std::net::SocketAddr;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use serde_json::Value;
use tiny_http::{Header, Method, Request, Response, Server};

use super::api::ApiRequest;
use super::service::{ServiceError, TextGenerationService};

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

type Job = (ApiRequest, mpsc::Sender<Result<Value, ServiceError>>);

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

fn work(service: &TextGenerationService, jobs: Receiver<Job>) {
    for (request, reply) in jobs {
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| service.respond(&request)))
                .unwrap_or_else(|_| Err(ServiceError::Failed("generation panicked".into())));
        let _ = reply.send(outcome);
    }
}

fn json_response(status: u16, body: &Value) -> Response<std::io::Cursor<Vec<u8>>> {
    let header = Header::from_bytes("Content-Type", "application/json").expect("a valid header");
    Response::from_data(serde_json::to_vec(body).expect("JSON values serialise"))
        .with_status_code(status)
        .with_header(header)
}

/// Megatron answers errors with the message as a JSON string.
fn message(status: u16, text: &str) -> Response<std::io::Cursor<Vec<u8>>> {
    json_response(status, &Value::String(text.to_string()))
}

fn handle(mut request: Request, queue: &SyncSender<Job>, options: &ServerOptions) {
    let response = respond(&mut request, queue, options);
    let _ = request.respond(response);
}

fn respond(
    request: &mut Request,
    queue: &SyncSender<Job>,
    options: &ServerOptions,
) -> Response<std::io::Cursor<Vec<u8>>> {
    if request.url() != "/api" {
        return message(
            404,
            &format!("no such endpoint: {} (the API is PUT /api)", request.url()),
        );
    }
    if *request.method() != Method::Put {
        return message(405, "use PUT /api");
    }
    if request
        .body_length()
        .is_some_and(|n| n > options.max_body_bytes)
    {
        return message(
            413,
            &format!(
                "the request body is larger than {} bytes",
                options.max_body_bytes
            ),
        );
    }
    let mut body = Vec::new();
    let limit = options.max_body_bytes as u64 + 1;
    if let Err(e) = request.as_reader().take(limit).read_to_end(&mut body) {
        return message(400, &format!("cannot read the request body: {e}"));
    }
    if body.len() > options.max_body_bytes {
        return message(
            413,
            &format!(
                "the request body is larger than {} bytes",
                options.max_body_bytes
            ),
        );
    }
    let json: Value = match serde_json::from_slice(&body) {
        Ok(json) => json,
        Err(e) => return message(400, &format!("malformed JSON: {e}")),
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
    match queue.try_send((parsed, reply)) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return message(
                503,
                &format!(
                    "the server is busy ({} requests are waiting); try again later",
                    options.max_queued
                ),
            )
        }
        Err(TrySendError::Disconnected(_)) => return message(503, "the server is shutting down"),
    }
    match answer.recv() {
        Ok(Ok(body)) => json_response(200, &body),
        Ok(Err(ServiceError::Rejected(text))) => message(400, &text),
        Ok(Err(ServiceError::Failed(text))) => message(500, &text),
        Err(_) => message(503, "the server is shutting down"),
    }
}
