//! What the inference engine needs of a model: the facts it reads, the KV caches it makes, and
//! the forwards that fill and read them. Generation, the batcher, the decoder, beam search and
//! the server take any [`CausalLm`], so a model family whose model predicts the next token
//! through a KV cache is generated with, scored and served by the same engine once it
//! implements this trait. GPT's implementation is here, beside the trait.
//!
//! The engine is generic over the model (`M: CausalLm + ?Sized`): the decode step calls the
//! concrete model directly, and `&dyn CausalLm` works where one engine must hold any family.

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use megatron_models::layers::{KvCache, PagedKvCache, PagedStep};
use megatron_models::{AttentionMask, GptModel};

/// A causal language model as the inference engine runs it: logits of the next token at every
/// position, from the positions before it, their keys and values kept in a KV cache. Every
/// forward returns logits `[positions, rows, padded vocabulary]` over the whole vocabulary
/// (gathered from the tensor-parallel ranks); the engine reads the first
/// [`vocab_size`](Self::vocab_size) of them.
pub trait CausalLm {
    /// Token ids the model knows; its logits may be padded beyond them.
    fn vocab_size(&self) -> i64;

    /// Positions a sequence may reach, its prompt included.
    fn max_positions(&self) -> i64;

    /// Where the model runs: its inputs go there.
    fn device(&self) -> Device;

    /// The dtype of its parameters and of its KV caches.
    fn dtype(&self) -> Kind;

    /// Channels of one attention head: the paged decode kernel serves some head sizes only.
    fn head_size(&self) -> i64;

    /// Whether decode steps can run some of the model through the fused decode kernels
    /// ([`megatron_kernels::ops::decode_gemv`]); the engine asks for them through
    /// [`PagedStep::with_decode_fusion`].
    fn supports_decode_fusion(&self) -> bool;

    /// Bytes one block of its paged KV cache takes.
    fn kv_block_bytes(&self) -> Result<u64>;

    /// An empty paged KV cache of `blocks` blocks, which continuous batching shares among its
    /// rows.
    fn new_paged_kv_cache(&self, blocks: i64) -> Result<PagedKvCache>;

    /// A prefill chunk or a decode step through the paged cache: `tokens` (`[b, s]`) at
    /// `positions` (`[b, s]`, int64, on the device), their keys and values stored and attended
    /// to as `step` says (gathered windows or the paged decode kernel, fused decode kernels or
    /// not). Its kernels must depend only on the shapes, so that a decode step can be captured
    /// in a CUDA graph and replayed.
    fn forward_paged(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        cache: &mut PagedKvCache,
        step: &PagedStep,
    ) -> Result<Tensor>;

    /// An empty contiguous KV cache for `batch` sequences of up to `capacity` positions (beam
    /// search and prompt scoring).
    fn new_kv_cache(&self, batch: i64, capacity: i64) -> Result<KvCache>;

    /// `tokens` (`[b, s]`) at the positions after those in `cache`, which they join.
    fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor>;

    /// `tokens` (`[b, s]`) at `positions` (`[b, s]`) in one forward without a cache, each
    /// position attending to those before it.
    fn causal_logits(&self, tokens: &Tensor, positions: &Tensor) -> Result<Tensor>;
}

impl CausalLm for GptModel {
    fn vocab_size(&self) -> i64 {
        self.config.vocab_size
    }

    fn max_positions(&self) -> i64 {
        self.config.max_position_embeddings
    }

    fn device(&self) -> Device {
        self.options().device
    }

    fn dtype(&self) -> Kind {
        self.options().params_dtype
    }

    fn head_size(&self) -> i64 {
        self.config.kv_channels
    }

    fn supports_decode_fusion(&self) -> bool {
        GptModel::supports_decode_fusion(self)
    }

    fn kv_block_bytes(&self) -> Result<u64> {
        GptModel::kv_block_bytes(self)
    }

    fn new_paged_kv_cache(&self, blocks: i64) -> Result<PagedKvCache> {
        GptModel::new_paged_kv_cache(self, blocks)
    }

    fn forward_paged(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        cache: &mut PagedKvCache,
        step: &PagedStep,
    ) -> Result<Tensor> {
        GptModel::forward_paged(self, tokens, positions, cache, step)
    }

    fn new_kv_cache(&self, batch: i64, capacity: i64) -> Result<KvCache> {
        GptModel::new_kv_cache(self, batch, capacity)
    }

    fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        GptModel::forward_cached(self, tokens, cache)
    }

    fn causal_logits(&self, tokens: &Tensor, positions: &Tensor) -> Result<Tensor> {
        self.forward_full_logits(tokens, positions, &AttentionMask::Causal)
    }
}
