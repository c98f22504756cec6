//! The HTTP side of `text_generation_server`: `hyper` on a `tokio` runtime, so a connection
//! costs no thread while it waits. Request heads and bodies must arrive within their timeouts
//! (an idle keep-alive connection is closed after the head timeout), a client must read its
//! answer (a write stalled beyond the write timeout drops the connection), connections beyond
//! `--max-connections` are answered 503 and closed, and generation requests are submitted to the
//! queue of the scheduler, which runs on the generation thread once the model is loaded
//! ([`super::service`]). On SIGTERM the server drains: new generation requests get 503 with
//! `Retry-After`, those in flight finish.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::chat::ChatTemplate;
use super::metrics::ServerMetrics;
use super::options::ServerOptions;
use super::routes::{route, too_many_connections, Shared};
use super::service::queue::RequestQueue;
use super::service::TextGenerationService;
use super::write_timeout::WriteTimeout;
use megatron_inference::CausalLm;

/// How often the server looks at its stop condition.
const STOP_POLL: Duration = Duration::from_millis(50);
/// How long a stopping server waits for the last answers to be written.
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// Open files kept free of connections (model files, logs, the generation thread's needs).
const RESERVED_FILES: usize = 64;

/// A bound server; [`GenerationServer::run`] serves until `stop` returns true.
pub struct GenerationServer {
    listener: std::net::TcpListener,
    options: ServerOptions,
    chat: ChatTemplate,
}

impl GenerationServer {
    pub fn bind(mut options: ServerOptions) -> Result<Self> {
        let address = format!("{}:{}", options.host, options.port);
        let listener = std::net::TcpListener::bind(&address)
            .with_context(|| format!("cannot listen on {address}"))?;
        listener.set_nonblocking(true)?;
        let files = raise_open_file_limit();
        if options.max_connections + RESERVED_FILES > files {
            let most = files.saturating_sub(RESERVED_FILES).max(1);
            eprintln!(
                "text_generation_server: --max-connections {} lowered to {most}: this process \
                 may open {files} files (ulimit -n)",
                options.max_connections
            );
            options.max_connections = most;
        }
        Ok(GenerationServer {
            listener,
            options,
            chat: ChatTemplate::plain(),
        })
    }

    /// Renders chat completions' messages through `template` (the plain one by default).
    pub fn with_chat_template(mut self, template: ChatTemplate) -> Self {
        self.chat = template;
        self
    }

    /// The address actually bound (port 0 picks a free one).
    pub fn address(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `stop()` is true, then finishes the requests in flight and returns.
    /// `service` is built on the generation thread, which then runs its scheduler for the
    /// server's life; requests that arrive meanwhile wait (at most `max_queued` of them).
    /// `serving` is printed once it is built (and `/health` answers 200).
    pub fn run<M: CausalLm>(
        self,
        service: impl FnOnce() -> Result<TextGenerationService<M>> + Send,
        serving: &str,
        stop: impl Fn() -> bool + Sync,
    ) -> Result<()> {
        let (queue, inbox) = RequestQueue::new(self.options.max_queued);
        let shared = Arc::new(Shared {
            queue,
            workload: std::sync::OnceLock::new(),
            metrics: ServerMetrics::default(),
            chat: self.chat,
            ready: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            connections: AtomicUsize::new(0),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            options: self.options,
        });
        let generation_ended = AtomicBool::new(false);
        std::thread::scope(|scope| -> Result<()> {
            let generation = scope.spawn(|| -> Result<()> {
                let outcome = service().and_then(|service| {
                    let _ = shared.workload.set(service.workload());
                    service.serve(inbox, &shared.metrics, || {
                        shared.ready.store(true, Ordering::SeqCst);
                        println!("{serving}");
                    })
                });
                generation_ended.store(true, Ordering::SeqCst);
                outcome
            });
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(shared.options.http_threads.max(1))
                .thread_name("http")
                .enable_all()
                .build()
                .context("cannot start the HTTP runtime")?;
            // Moved, not cloned: once the server stops accepting, new connections are refused
            // by the system instead of waiting in a backlog nobody reads.
            let listener = self.listener;
            let served = runtime.block_on(serve(listener, shared.clone(), &|| {
                stop() || generation_ended.load(Ordering::SeqCst)
            }));
            shared.queue.close();
            runtime.shutdown_timeout(Duration::from_secs(1));
            let generated = generation
                .join()
                .map_err(|_| anyhow::anyhow!("the generation thread panicked"))?;
            served.and(generated)
        })
    }
}

/// Accepts connections until `stop()`, then drains: new generation requests are refused
/// while those in flight finish, and the connections are closed.
async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    stop: &(dyn Fn() -> bool + Sync),
) -> Result<()> {
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(shared.options.max_connections));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(shared.options.header_timeout);
    let mut poll = tokio::time::interval(STOP_POLL);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors, say: wait for some to close.
                        eprintln!("text_generation_server: cannot accept a connection: {e}");
                        tokio::time::sleep(STOP_POLL).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    shared.metrics.refused_connection();
                    tokio::spawn(refuse(stream));
                    continue;
                };
                let for_requests = shared.clone();
                let stream = WriteTimeout::new(stream, shared.options.write_timeout);
                let connection = http.serve_connection(
                    TokioIo::new(stream),
                    service_fn(move |request| route(request, for_requests.clone(), peer)),
                );
                let connection = graceful.watch(connection);
                let counted = shared.clone();
                counted.connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let _ = connection.await;
                    counted.connections.fetch_sub(1, Ordering::SeqCst);
                    drop(slot);
                });
            }
            _ = poll.tick() => {
                if !shared.draining.load(Ordering::SeqCst) && stop() {
                    shared.draining.store(true, Ordering::SeqCst);
                    // A server that never served (its model or cache failed) just ends.
                    if shared.ready.load(Ordering::SeqCst) {
                        eprintln!("text_generation_server: stopping after the requests in flight");
                    }
                }
                if shared.draining.load(Ordering::SeqCst)
                    && shared.in_flight.load(Ordering::SeqCst) == 0
                {
                    break;
                }
            }
        }
    }
    drop(listener);
    let _ = tokio::time::timeout(CLOSE_GRACE, graceful.shutdown()).await;
    Ok(())
}

/// Answers a connection beyond the limit with 503 and closes it, within a second.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        stream.write_all(too_many_connections().as_bytes()).await?;
        stream.shutdown().await?;
        // Read what the client sent, so that closing does not reset the connection before it
        // has read the answer.
        let mut sink = [0u8; 4096];
        while stream.read(&mut sink).await? > 0 {}
        Ok::<(), std::io::Error>(())
    })
    .await;
}

/// Raises the soft limit on open files to the hard one; returns the limit.
fn raise_open_file_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}
