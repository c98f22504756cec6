//! How a [`crate::TextGenerationService`] serves: one struct, built from the server's flags
//! (`text_generation_server`) or directly (tests), instead of a toggle per choice.

use megatron_inference::{BatchLimits, DecodeSettings, DEFAULT_PREFILL_CHUNK};

/// Megatron's `--max-tokens-to-oom` default: prompts × total length per request.
pub const DEFAULT_MAX_TOKENS: usize = 12_000;
/// Rows decoded together by default (`--max-batch-size`).
pub const DEFAULT_MAX_BATCH_SIZE: usize = 64;
/// Requests that may wait for room by default (`--max-queued`).
pub const DEFAULT_MAX_QUEUED: usize = 256;

/// How requests are batched, how decode steps run, and how large a request may be.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServingSettings {
    /// Rows decoded together (`--max-batch-size`; 1 serves one request at a time), prompt
    /// positions prefilled per step (`--prefill-chunk-size`) and requests that may wait for
    /// room (`--max-queued`).
    pub limits: BatchLimits,
    /// CUDA graphs (`--no-cuda-graphs`), the paged decode kernel (`--no-paged-attention`), the
    /// fused decode kernels (`--no-decode-fusion`), decode steps queued ahead
    /// (`--no-decode-overlap`) and the KV cache's memory (`--kv-cache-gb`).
    pub decode: DecodeSettings,
    /// The most prompts × (longest prompt + new tokens) a request may ask for
    /// (`--max-tokens-to-oom`).
    pub max_tokens: usize,
    /// The longest prompt + generation a request may have (`--inference-max-seq-length`), at
    /// most the model's positions; `None`: the model's positions.
    pub max_sequence: Option<usize>,
}

impl Default for ServingSettings {
    fn default() -> Self {
        ServingSettings {
            limits: BatchLimits {
                max_batch_size: DEFAULT_MAX_BATCH_SIZE,
                prefill_chunk: DEFAULT_PREFILL_CHUNK,
                max_queued: DEFAULT_MAX_QUEUED,
            },
            decode: DecodeSettings::default(),
            max_tokens: DEFAULT_MAX_TOKENS,
            max_sequence: None,
        }
    }
}
