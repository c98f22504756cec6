//! Inference: loading a trained GPT from its checkpoint alone, and Megatron's generation as
//! continuous batching over a paged KV cache with per-row sampling, decode steps replayed from
//! CUDA graphs on a GPU; the HTTP server in front of it (Megatron's `/api`, OpenAI's
//! completions, chat and models, Prometheus metrics).

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
pub use decoder::{bucket, DecodeRow, Decoder, KvBudget, PrefillChunk, WINDOW_STEP};
pub use generation::{
    generate_tokens, generate_tokens_observed, BatchLimits, Batcher, CacheUse, Generation,
    GenerationRequest, Refusal, RowSpec, StopCondition, TokenObserver, DEFAULT_PREFILL_CHUNK,
};
pub use load::{checkpoint_gpt_config, load_gpt_for_inference};
pub use sampling::{row_seed, sample, RowSampling, Sampling};
pub use server::{GenerationServer, ServerOptions};
pub use service::{
    CacheUseReader, CancelFlag, ClientGone, ServiceError, TextGenerationService,
    DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUED, DEFAULT_MAX_TOKENS,
};
