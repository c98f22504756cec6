//! Self-attention with the fused QKV projection in Megatron's per-group layout and
//! libtorch's `scaled_dot_product_attention` (flash attention on GPUs) as the core.

use anyhow::Result;
use tch::Tensor;

use super::context_parallel::ContextChunks;
use super::kv_cache::{LayerCache, PagedStep};
use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::norm::Norm;
use super::packed::PackedSequences;
use super::qkv_projection::{self, QkvLayout};
use super::rope::RotaryTables;
use super::{NamedTensors, TensorParallel};
use crate::config::TransformerConfig;
use crate::param::Initializer;
use megatron_kernels::autograd::recompute;
use megatron_kernels::ops::decode_attention::{
    self, decode_qkv_attention, AttentionShape, CacheStep,
};
use megatron_kernels::ops::decode_gemv::{decode_linear, Epilogue, InputNorm};
use megatron_kernels::rng::with_model_parallel_rng;

/// Which positions a query may attend to: the attention mask kind of the model family (GPT's
/// causal decoder, BERT's bidirectional encoder over padded sequences) is a parameter of the
/// layer's forward pass.
pub enum AttentionMask {
    /// Lower-triangular: the common case, served by the fused causal kernels.
    Causal,
    /// `[b or 1, 1, s, s]` booleans, `true` = masked out (Megatron's convention).
    Explicit(Tensor),
    /// Causal within each document of packed sequences (`--reset-attention-mask`), from the
    /// documents' offsets.
    Packed(PackedSequences),
    /// Bidirectional attention to every real token: `[b, 1, 1, s]` booleans, `true` = the key
    /// may be attended to. Megatron also masks the query rows of padding positions; their
    /// outputs never reach a loss, and masking only keys keeps those rows finite.
    Padding(Tensor),
    /// Causal over the whole sequence (within each document when packed), of which this rank
    /// holds two chunks of a context-parallel group's (`--context-parallel-size`).
    ContextParallel(ContextChunks),
}

impl AttentionMask {
    /// The padding mask of `[b, s]` ones (real tokens) and zeros (padding), any dtype.
    pub fn padding(keep: &Tensor) -> AttentionMask {
        let (b, s) = keep.size2().expect("a padding mask is [b, s]");
        AttentionMask::Padding(keep.ne(0).view([b, 1, 1, s]))
    }
}

impl Clone for AttentionMask {
    fn clone(&self) -> AttentionMask {
        match self {
            AttentionMask::Causal => AttentionMask::Causal,
            AttentionMask::Explicit(mask) => AttentionMask::Explicit(mask.shallow_clone()),
            AttentionMask::Packed(packed) => AttentionMask::Packed(packed.clone()),
            AttentionMask::Padding(keep) => AttentionMask::Padding(keep.shallow_clone()),
            AttentionMask::ContextParallel(group) => AttentionMask::ContextParallel(group.clone()),
        }
    }
}

#[derive(Clone)]
pub struct SelfAttention {
    pub linear_qkv: ColumnParallelLinear,
    pub linear_proj: RowParallelLinear,
    /// `--qk-layernorm`: the norms of each query head and each key head, over its channels.
    pub head_norms: Option<HeadNorms>,
    local_heads: i64,
    local_groups: i64,
    head_dim: i64,
    dropout: f64,
    /// Attention probabilities of different heads live on different tensor-parallel ranks, so
    /// their dropout draws from the per-rank model-parallel stream; with sequence parallelism
    /// the whole layer stack already runs inside it.
    fork_dropout_rng: bool,
}

impl SelfAttention {
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        output_std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let t = init.tensor_parallel_size;
        let h = config.hidden_size;
        let projection = config.num_attention_heads * config.kv_channels;
        let qkv_bias = config.add_bias_linear || config.add_qkv_bias;
        let fork_dropout_rng = !parallel.sequence_parallel;
        let head_norms = config
            .qk_layernorm
            .then(|| HeadNorms::new(init, config, t > 1));
        SelfAttention {
            head_norms,
            linear_qkv: ColumnParallelLinear::new(
                &init.scope("linear_qkv"),
                h,
                config.qkv_width(),
                qkv_bias,
                config.init_method_std,
                1,
                parallel.clone(),
            ),
            linear_proj: RowParallelLinear::new(
                &init.scope("linear_proj"),
                projection,
                h,
                config.add_bias_linear,
                output_std,
                parallel,
            ),
            local_heads: config.num_attention_heads / t,
            local_groups: config.num_query_groups / t,
            head_dim: config.kv_channels,
            dropout: config.attention_dropout,
            fork_dropout_rng,
        }
    }

    /// Query `[b, n, s, d]`, key and value `[b, g, s, d]` of `hidden` (`[s, b, h]`, or with
    /// sequence parallelism a slice the projection gathers), rotated when `rotary` is given.
    fn project(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, d) = (self.local_heads, self.head_dim);
        let per_group = n / self.local_groups;
        let parts: Vec<Tensor> = match self.projection_with_packed_grad(hidden)? {
            Some(parts) => parts.into(),
            None => self
                .fused_qkv(hidden)?
                .split_with_sizes([per_group * d, d, d], -1),
        };
        let (s, b) = (parts[0].size()[0], parts[0].size()[1]);
        let mut query = parts[0].reshape([s, b, n, d]);
        let mut key = parts[1].shallow_clone();
        if let Some(norms) = &self.head_norms {
            query = norms.query.forward(&query);
            key = norms.key.forward(&key);
        }
        if let Some(tables) = rotary {
            query = tables.apply(&query)?;
            key = tables.apply(&key)?;
        }
        // [s, b, heads, d] → [b, heads, s, d] for SDPA.
        Ok((
            query.permute([1, 2, 0, 3]),
            key.permute([1, 2, 0, 3]),
            parts[2].permute([1, 2, 0, 3]),
        ))
    }

    /// The query, key and value parts of the fused projection of `hidden` (`[s, b, g, width]`
    /// each) through [`qkv_projection`], whose backward packs their gradients and sums the
    /// bias gradient in one pass; `None` where it does not apply (fp8 GEMMs among them).
    fn projection_with_packed_grad(&self, hidden: &Tensor) -> Result<Option<[Tensor; 3]>> {
        if self.linear_qkv.fp8().is_some() || !hidden.requires_grad() {
            return Ok(None);
        }
        let layout = QkvLayout {
            groups: self.local_groups,
            query_width: self.local_heads / self.local_groups * self.head_dim,
            head_dim: self.head_dim,
        };
        let Some(projection) = qkv_projection::fused(
            &self.linear_qkv.weight,
            self.linear_qkv.bias.as_ref(),
            layout,
            hidden.kind(),
            hidden.device(),
        ) else {
            return Ok(None);
        };
        let input = self.linear_qkv.parallel_input(hidden)?;
        projection.apply(&input).map(Some)
    }

    /// The fused projection of `hidden` per query group, `[s, b, g, (n/g + 2)·d]`: each group's
    /// queries, then its key, then its value (Megatron's layout).
    fn fused_qkv(&self, hidden: &Tensor) -> Result<Tensor> {
        let (g, d) = (self.local_groups, self.head_dim);
        let per_group = self.local_heads / g;
        let qkv = self.linear_qkv.forward(hidden)?;
        let (s, b) = (qkv.size()[0], qkv.size()[1]);
        Ok(qkv.view([s, b, g, (per_group + 2) * d]))
    }

    /// Query `[b, n, s, d]` and key and value side by side `[b, g, s, 2·d]` for the KV cache,
    /// of the QKV projection `qkv` (`[s, b, g·(n/g + 2)·d]`): without rotary embeddings views,
    /// so storing them is one kernel.
    fn side_by_side(
        &self,
        qkv: &Tensor,
        rotary: Option<&RotaryTables>,
    ) -> Result<(Tensor, Tensor)> {
        let (g, n, d) = (self.local_groups, self.local_heads, self.head_dim);
        let per_group = n / g;
        let (s, b, _) = qkv.size3()?;
        let qkv = qkv.view([s, b, g, (per_group + 2) * d]);
        let mut query = qkv.narrow(-1, 0, per_group * d).reshape([s, b, n, d]);
        let mut kv = qkv.narrow(-1, per_group * d, 2 * d);
        if self.head_norms.is_some() || rotary.is_some() {
            let mut key = kv.narrow(-1, 0, d);
            if let Some(norms) = &self.head_norms {
                query = norms.query.forward(&query);
                key = norms.key.forward(&key);
            }
            if let Some(tables) = rotary {
                query = tables.apply(&query)?;
                key = tables.apply(&key)?;
            }
            kv = Tensor::cat(&[&key, &kv.narrow(-1, d, d)], -1);
        }
        Ok((query.permute([1, 2, 0, 3]), kv.permute([1, 2, 0, 3])))
    }

    /// Every query head's key and value: grouped heads repeated for their queries.
    fn expand_groups(&self, kv: Tensor) -> Tensor {
        let per_group = self.local_heads / self.local_groups;
        if per_group > 1 {
            kv.repeat_interleave_self_int(per_group, 1, None)
        } else {
            kv
        }
    }

    /// Context `[b, n, s, d]` → the output projection `[s, b, h]`.
    fn output(&self, context: &Tensor) -> Result<Tensor> {
        let (b, n, s, d) = context.size4()?;
        self.linear_proj
            .forward(&context.permute([2, 0, 1, 3]).reshape([s, b, n * d]))
    }

    /// `[s, b, h]` → `[s, b, h]`. `recompute_core` recomputes the attention core in backward
    /// instead of keeping its activations (`--recompute-activations`).
    pub fn forward(
        &self,
        hidden: &Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        train: bool,
        recompute_core: bool,
    ) -> Result<Tensor> {
        let (query, key, value) = self.project(hidden, rotary)?;
        let (key, value) = (self.expand_groups(key), self.expand_groups(value));
        let dropout = if train { self.dropout } else { 0.0 };
        let fork = self.fork_dropout_rng && dropout > 0.0;
        let context = if recompute_core {
            let mask = mask.clone();
            recompute(
                move |inputs: &[Tensor]| {
                    Ok(vec![core_attention(
                        &inputs[0], &inputs[1], &inputs[2], &mask, dropout, fork,
                    )?])
                },
                &[&query, &key, &value],
            )?
            .remove(0)
        } else {
            core_attention(&query, &key, &value, mask, dropout, fork)?
        };
        self.output(&context)
    }

    /// Inference over the new positions `cache.len..cache.len + s` of `hidden` (`[s, b, h]`):
    /// their keys and values join the cache, and every query attends to all cached positions up
    /// to its own.
    pub fn forward_cached(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        let (query, key, value) = self.project(hidden, rotary)?;
        let (start, new) = (cache.len, query.size()[2]);
        let (keys, values) = cache.append(&key, &value)?;
        let (keys, values) = (self.expand_groups(keys), self.expand_groups(values));
        let context = if new == 1 {
            Tensor::scaled_dot_product_attention::<&Tensor>(
                &query, &keys, &values, None, 0.0, false, None, false,
            )
        } else if start == 0 {
            Tensor::scaled_dot_product_attention::<&Tensor>(
                &query, &keys, &values, None, 0.0, true, None, false,
            )
        } else {
            // Query i sits at position start + i and may see keys 0..=start + i.
            let device = query.device();
            let rows =
                Tensor::arange_start(start, start + new, (tch::Kind::Int64, device)).unsqueeze(1);
            let columns = Tensor::arange(start + new, (tch::Kind::Int64, device)).unsqueeze(0);
            let allowed = columns.le_tensor(&rows);
            Tensor::scaled_dot_product_attention(
                &query,
                &keys,
                &values,
                Some(&allowed),
                0.0,
                false,
                None,
                false,
            )
        };
        self.output(&context)
    }

    /// Inference of new positions of several sequences (`hidden` `[s, b, h]`) through a paged
    /// KV cache: their keys and values go to `step`'s write slots of `pool`, and each query
    /// attends to the read slots `step` allows it.
    pub fn forward_paged(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        pool: &mut Tensor,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let qkv = self.linear_qkv.forward(hidden)?;
        let context = self.attend_paged(&qkv, rotary, pool, step)?;
        self.output(&context)
    }

    /// The attention context `[b, n, s, d]` of the QKV projection `qkv` (`[s, b, width]`) of
    /// new positions through a paged KV cache, their keys and values stored first (see
    /// [`forward_paged`](Self::forward_paged)).
    pub fn attend_paged(
        &self,
        qkv: &Tensor,
        rotary: Option<&RotaryTables>,
        pool: &mut Tensor,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let (query, kv) = self.side_by_side(qkv, rotary)?;
        step.attend(pool, &query, &kv, |t| self.expand_groups(t))
    }

    /// The attention context `[s·b, n·d]` of a decode step of few rows (`hidden` `[s, b, h]`,
    /// the layer's input before `norm`) through the fused decode kernels: on a GPU that has it
    /// ([`decode_attention::usable`]), for a step of one position per row that reads the cache
    /// in place without rotary embeddings, one kernel for the norm, the QKV projection, its bias, the store of the new
    /// keys and values and the attention; otherwise the norm, projection and bias as one decode
    /// linear kernel and [`attend_paged`](Self::attend_paged).
    pub fn decode_attention(
        &self,
        hidden: &Tensor,
        norm: &InputNorm,
        rotary: Option<&RotaryTables>,
        pool: &mut Tensor,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let (s, b, h) = hidden.size3()?;
        let rows = s * b;
        let x = hidden.reshape([rows, h]);
        let shape = AttentionShape {
            rows,
            hidden: h,
            heads: self.local_heads,
            groups: self.local_groups,
            head_dim: self.head_dim,
        };
        let weight = &self.linear_qkv.weight;
        let bias = self.linear_qkv.bias.as_deref();
        let plain_heads = self.head_norms.is_none();
        if let (None, Some((tables, positions)), 1, true) =
            (rotary, step.in_place(), s, plain_heads)
        {
            if decode_attention::usable(x.device(), x.kind(), &shape) {
                let cache = CacheStep {
                    pool,
                    tables,
                    positions,
                    write_slots: &step.write_slots,
                };
                let context =
                    decode_qkv_attention(&x, weight, bias, norm, cache, self.local_heads)?;
                return Ok(context.view([rows, -1]));
            }
        }
        let epilogue = Epilogue {
            bias,
            ..Epilogue::default()
        };
        let qkv = decode_linear(&x, weight, Some(norm), &epilogue)?;
        let context = self.attend_paged(&qkv.view([s, b, -1]), rotary, pool, step)?;
        // [b, n, s, d] → [s·b, n·d]
        Ok(context.permute([2, 0, 1, 3]).reshape([rows, -1]))
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.linear_qkv.named_tensors(&mut out.scope("linear_qkv"));
        self.linear_proj
            .named_tensors(&mut out.scope("linear_proj"));
        if let Some(norms) = &self.head_norms {
            norms.query.named_tensors(&mut out.scope("q_layernorm"));
            norms.key.named_tensors(&mut out.scope("k_layernorm"));
        }
    }
}

/// `--qk-layernorm`'s norms (Megatron's `q_layernorm` and `k_layernorm`): the model's
/// normalization over one head's channels, shared by every head. Each tensor-parallel rank
/// normalises its own heads with the same weights, so their gradients are partial sums over
/// the tensor-parallel group, as sequence-parallel norms' are.
#[derive(Clone)]
pub struct HeadNorms {
    pub query: Norm,
    pub key: Norm,
}

impl HeadNorms {
    fn new(init: &Initializer, config: &TransformerConfig, partial_grads: bool) -> Self {
        let norm = |name: &str| {
            Norm::new(
                &init.scope(name),
                config.normalization,
                config.kv_channels,
                config.norm_epsilon,
                config.apply_layernorm_1p,
                partial_grads,
            )
        };
        HeadNorms {
            query: norm("q_layernorm"),
            key: norm("k_layernorm"),
        }
    }
}

/// One cross-attention layer's keys and values of the encoder output, `[b, n/t, sk, d]` each.
pub struct MemoryKeysValues {
    pub key: Tensor,
    pub value: Tensor,
}

/// Megatron-core's cross-attention (T5's decoder): queries from the decoder's hidden states
/// (`linear_q`), keys and values from the encoder's output (`linear_kv`, per head the key's
/// channels then the value's), the encoder's padding as the mask, and the output projection.
#[derive(Clone)]
pub struct CrossAttention {
    pub linear_q: ColumnParallelLinear,
    pub linear_kv: ColumnParallelLinear,
    pub linear_proj: RowParallelLinear,
    local_heads: i64,
    head_dim: i64,
    dropout: f64,
    fork_dropout_rng: bool,
}

impl CrossAttention {
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        output_std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let t = init.tensor_parallel_size;
        let h = config.hidden_size;
        let projection = config.num_attention_heads * config.kv_channels;
        let bias = config.add_bias_linear || config.add_qkv_bias;
        let fork_dropout_rng = !parallel.sequence_parallel;
        let column = |name: &str, width: i64| {
            ColumnParallelLinear::new(
                &init.scope(name),
                h,
                width,
                bias,
                config.init_method_std,
                1,
                parallel.clone(),
            )
        };
        CrossAttention {
            linear_q: column("linear_q", projection),
            linear_kv: column("linear_kv", 2 * projection),
            linear_proj: RowParallelLinear::new(
                &init.scope("linear_proj"),
                projection,
                h,
                config.add_bias_linear,
                output_std,
                parallel,
            ),
            local_heads: config.num_attention_heads / t,
            head_dim: config.kv_channels,
            dropout: config.attention_dropout,
            fork_dropout_rng,
        }
    }

    /// Decoder states `hidden` `[sq, b, h]` attend to `memory` `[sk, b, h]` (sequence-parallel
    /// slices when enabled) under `mask`; returns `[sq, b, h]`.
    pub fn forward(
        &self,
        hidden: &Tensor,
        memory: &Tensor,
        mask: &AttentionMask,
        train: bool,
    ) -> Result<Tensor> {
        let memory = self.memory_keys_values(memory)?;
        self.attend(hidden, &memory, mask, train)
    }

    /// This rank's heads' keys and values of `memory` `[sk, b, h]`: they depend only on the
    /// encoder's output, so incremental decoding computes them once.
    pub fn memory_keys_values(&self, memory: &Tensor) -> Result<MemoryKeysValues> {
        let (n, d) = (self.local_heads, self.head_dim);
        let kv = self.linear_kv.forward(memory)?;
        let (sk, b) = (kv.size()[0], kv.size()[1]);
        let kv = kv.view([sk, b, n, 2 * d]).permute([1, 2, 0, 3]);
        Ok(MemoryKeysValues {
            key: kv.narrow(-1, 0, d),
            value: kv.narrow(-1, d, d),
        })
    }

    /// Decoder states `hidden` `[sq, b, h]` attend to the projected `memory` under `mask`.
    pub fn attend(
        &self,
        hidden: &Tensor,
        memory: &MemoryKeysValues,
        mask: &AttentionMask,
        train: bool,
    ) -> Result<Tensor> {
        let (n, d) = (self.local_heads, self.head_dim);
        let query = self.linear_q.forward(hidden)?;
        let (sq, b) = (query.size()[0], query.size()[1]);
        let query = query.view([sq, b, n, d]).permute([1, 2, 0, 3]);
        let dropout = if train { self.dropout } else { 0.0 };
        let fork = self.fork_dropout_rng && dropout > 0.0;
        let context = core_attention(&query, &memory.key, &memory.value, mask, dropout, fork)?;
        self.linear_proj
            .forward(&context.permute([2, 0, 1, 3]).reshape([sq, b, n * d]))
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.linear_q.named_tensors(&mut out.scope("linear_q"));
        self.linear_kv.named_tensors(&mut out.scope("linear_kv"));
        self.linear_proj
            .named_tensors(&mut out.scope("linear_proj"));
    }
}

fn core_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    mask: &AttentionMask,
    dropout: f64,
    fork_rng: bool,
) -> Result<Tensor> {
    let attend = || match mask {
        AttentionMask::ContextParallel(context) => context.attend(query, key, value, dropout),
        AttentionMask::Packed(packed) => packed.attend(query, key, value, dropout),
        _ => Ok(sdpa(query, key, value, mask, dropout)),
    };
    if fork_rng {
        return with_model_parallel_rng(query.device(), attend)?;
    }
    attend()
}

fn sdpa(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    mask: &AttentionMask,
    dropout: f64,
) -> Tensor {
    match mask {
        AttentionMask::Causal => Tensor::scaled_dot_product_attention::<&Tensor>(
            query, key, value, None, dropout, true, None, false,
        ),
        AttentionMask::Explicit(masked) => {
            // SDPA's boolean masks mean "may attend", the opposite of Megatron's.
            let allowed = masked.logical_not();
            Tensor::scaled_dot_product_attention(
                query,
                key,
                value,
                Some(&allowed),
                dropout,
                false,
                None,
                false,
            )
        }
        AttentionMask::Padding(keep) => Tensor::scaled_dot_product_attention(
            query,
            key,
            value,
            Some(keep),
            dropout,
            false,
            None,
            false,
        ),
        AttentionMask::ContextParallel(_) | AttentionMask::Packed(_) => {
            unreachable!("core_attention hands these to their own attention")
        }
    }
}
