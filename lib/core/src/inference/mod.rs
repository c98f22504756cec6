//! Inference: loading a trained GPT from its checkpoint alone, and Megatron's generation loop
//! over a KV cache with its sampling, decode steps replayed from CUDA graphs on a GPU; the
//! HTTP server in front of it (Megatron's `/api`, OpenAI's completions, chat and models,
//! Prometheus metrics).

pub mod api;
mod beam_search;
pub mod chat;
mod decoder;
mod generation;
mod load;
mod metrics;
pub mod openai;
mod routes;
mod sampling;
mod server;
mod service;
mod worker;
mod write_timeout;

pub use beam_search::{beam_search, BeamSearchRequest, BeamSearchResult};
pub use decoder::{Decoder, WINDOW_STEP};
pub use generation::{
    generate_tokens, generate_tokens_observed, Generation, GenerationRequest, StopCondition,
    TokenObserver,
};
pub use load::{checkpoint_gpt_config, load_gpt_for_inference};
pub use sampling::{sample, Sampling};
pub use server::{GenerationServer, ServerOptions};
pub use service::{ClientGone, DeltaSink, ServiceError, TextGenerationService, DEFAULT_MAX_TOKENS};
