//! How the HTTP server listens and what it bounds: address, queue, body size, connections,
//! timeouts, the model's name.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub host: String,
    pub port: u16,
    /// Requests that may wait for the model while it loads (at least 1): the service's queue
    /// limit (`--max-queued`), so that no request waits that the service would refuse.
    pub max_queued: usize,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Threads of the runtime that serves the connections (each serves many).
    pub http_threads: usize,
    /// Connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// Time to send a request's head, and the longest a kept-alive connection may idle.
    pub header_timeout: Duration,
    /// Time to send a request's body.
    pub body_timeout: Duration,
    /// The longest an answer may wait for the client to read it.
    pub write_timeout: Duration,
    /// The model's id in `/v1/models`.
    pub model_name: String,
}
