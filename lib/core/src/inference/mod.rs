//! Inference: loading a trained GPT or T5 from its checkpoint alone, Megatron's generation loop
//! over a KV cache with its sampling, decode steps replayed from CUDA graphs on a GPU, and T5's
//! teacher-forced scoring and greedy decoding.

pub mod api;
mod beam_search;
mod decoder;
mod generation;
mod load;
pub mod openai;
mod sampling;
mod server;
mod service;
mod t5;

pub use beam_search::{beam_search, BeamSearchRequest, BeamSearchResult};
pub use decoder::{Decoder, WINDOW_STEP};
pub use generation::{
    generate_tokens, generate_tokens_observed, Generation, GenerationRequest, StopCondition,
    TokenObserver,
};
pub use load::{
    checkpoint_gpt_config, checkpoint_t5_config, load_gpt_for_inference, load_t5_for_inference,
};
pub use sampling::{sample, Sampling};
pub use server::{GenerationServer, ServerOptions};
pub use service::{ServiceError, TextGenerationService, DEFAULT_MAX_TOKENS};
pub use t5::{
    encode_with_sentinels, fill_spans, greedy_decode, score_t5_batch, split_spans, DecodedSpan,
    GreedyOptions, SampleScore, ScoreTotals, T5Decoding,
};
