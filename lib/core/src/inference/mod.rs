//! Inference: loading a trained GPT or T5 from its checkpoint alone; Megatron's generation as
//! continuous batching over a paged KV cache with per-row sampling, decode steps replayed from
//! CUDA graphs on a GPU; the HTTP server in front of it (Megatron's `/api`, OpenAI's
//! completions, chat and models, Prometheus metrics); T5's teacher-forced scoring and greedy
//! decoding.

pub mod api;
mod beam_search;
pub mod chat;
mod decoder;
mod generation;
mod in_flight;
mod load;
mod metrics;
pub mod openai;
mod routes;
mod sampling;
mod server;
mod service;
mod t5;
mod worker;
mod write_timeout;

pub use beam_search::{beam_search, BeamSearchRequest, BeamSearchResult};
pub use decoder::{bucket, DecodeRow, Decoder, KvBudget, PrefillChunk, WINDOW_STEP};
pub use generation::{
    generate_tokens, generate_tokens_observed, BatchLimits, Batcher, CacheUse, Generation,
    GenerationRequest, Refusal, RowSpec, StopCondition, TokenObserver, DEFAULT_PREFILL_CHUNK,
};
pub use load::{
    checkpoint_gpt_config, checkpoint_t5_config, load_gpt_for_inference, load_t5_for_inference,
};
pub use sampling::{row_seed, sample, RowSampling, Sampling};
pub use server::{GenerationServer, ServerOptions};
pub use service::{
    CacheUseReader, CancelFlag, ClientGone, ServiceError, TextGenerationService,
    DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUED, DEFAULT_MAX_TOKENS,
};
pub use t5::{
    encode_with_sentinels, fill_spans, greedy_decode, score_t5_batch, split_spans, DecodedSpan,
    GreedyOptions, SampleScore, ScoreTotals, T5Decoding,
};
