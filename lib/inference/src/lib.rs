//! Inference: a trained GPT or T5 loaded from its checkpoint alone (any TP/PP layout, or a
//! HuggingFace model imported on the fly: [`CheckpointModelArgs`]); Megatron's generation as
//! continuous batching over a paged KV cache with per-row sampling, decode steps replayed from
//! CUDA graphs on a GPU; beam search; T5's teacher-forced scoring and greedy decoding. The
//! engine runs any [`CausalLm`] (GPT implements it). The HTTP server in front of it is
//! `megatron-serving`.

mod beam_search;
mod causal_lm;
mod checkpoint_model;
mod decoder;
mod generation;
mod in_flight;
mod sampling;
mod t5;
mod top_tokens;

pub use beam_search::{beam_search, BeamSearchRequest, BeamSearchResult};
pub use causal_lm::CausalLm;
pub use checkpoint_model::{at_least_one, CheckpointModelArgs};
pub use decoder::{
    bucket, DecodeRow, DecodeSettings, Decoder, KvBudget, PrefillChunk, WINDOW_STEP,
};
pub use generation::{
    generate_tokens, generate_tokens_observed, BatchLimits, Batcher, CacheUse, Generation,
    GenerationRequest, NewToken, Refusal, RowSpec, StopCondition, TokenObserver,
    DEFAULT_PREFILL_CHUNK,
};
pub use sampling::{row_seed, sample, LogitAdjust, RowSampling, Sampling};
pub use t5::{
    encode_with_sentinels, fill_spans, greedy_decode, score_t5_batch, split_spans, DecodedSpan,
    GreedyOptions, SampleScore, ScoreTotals, T5Decoding,
};
pub use top_tokens::TopTokens;
