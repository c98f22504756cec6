//! Serving: the HTTP front of the inference engine. Megatron's `PUT /api` with its validation and
//! messages, OpenAI's `/v1/completions`, `/v1/chat/completions` (chat templates) and
//! `/v1/models` with streaming, Prometheus `/metrics` and `/health`; the service that turns
//! requests into generation work for `megatron-inference`'s batcher, on any model it runs.

pub mod api;
pub mod chat;
mod metrics;
pub mod openai;
mod options;
mod routes;
mod server;
mod service;
mod settings;
mod write_timeout;

pub use options::ServerOptions;
pub use server::GenerationServer;
pub use service::{CancelFlag, ClientGone, ServiceError, TextGenerationService};
pub use settings::{
    ServingSettings, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUED, DEFAULT_MAX_TOKENS,
};
