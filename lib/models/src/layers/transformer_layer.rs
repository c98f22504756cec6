//! One pre-LN transformer layer (spec §1.1), with T5's cross-attention block in decoder layers
//! of an encoder-decoder (spec §1.5).

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Result};
use tch::Tensor;

use super::attention::{AttentionMask, CrossAttention, MemoryKeysValues, SelfAttention};
use super::fp8_linear::Fp8Linear;
use super::kv_cache::{LayerCache, PagedStep};
use super::linear::RowParallelLinear;
use super::mlp::Mlp;
use super::moe::expert_bias::ExpertBias;
use super::moe::MoeLayer;
use super::norm::Norm;
use super::rope::RotaryTables;
use super::{NamedTensors, TensorParallel};
use crate::config::TransformerConfig;
use crate::fp8::{Fp8Plan, Fp8Recipe};
use crate::param::Initializer;
use megatron_kernels::ops::decode_gemv::{self, decode_linear, Epilogue};
use megatron_parallel::Communicator;

#[derive(Clone)]
pub struct TransformerLayer {
    pub input_layernorm: Norm,
    pub self_attention: SelfAttention,
    /// Decoder layers of an encoder-decoder: the norm and the attention over the encoder output.
    pub cross: Option<(Norm, CrossAttention)>,
    pub pre_mlp_layernorm: Norm,
    pub mlp: FeedForward,
    hidden_dropout: f64,
    /// The hidden dropout waits for the next residual add + norm, whose kernel runs it.
    bias_dropout_fusion: bool,
    residual_from_norm: bool,
}

impl TransformerLayer {
    /// `init` is scoped to the layer's global name (`decoder.layers.<index>`, `index` the
    /// layer's global index, which decides whether its MLP is a Mixture of Experts).
    /// `experts` is the expert-parallel group its Mixture of Experts, if any, splits the
    /// experts over.
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        parallel: TensorParallel,
        index: usize,
        experts: &Arc<dyn Communicator>,
    ) -> Self {
        Self::build(init, config, parallel, false, Some((index, experts)))
    }

    /// A decoder layer of an encoder-decoder: self-attention, cross-attention, MLP.
    pub fn with_cross_attention(
        init: &Initializer,
        config: &TransformerConfig,
        parallel: TensorParallel,
    ) -> Self {
        Self::build(init, config, parallel, true, None)
    }

    fn build(
        init: &Initializer,
        config: &TransformerConfig,
        parallel: TensorParallel,
        cross_attention: bool,
        index: Option<(usize, &Arc<dyn Communicator>)>,
    ) -> Self {
        // Output projections are scaled by 1/sqrt(2L) (Megatron's "scaled init").
        let output_std = config.init_method_std / (2.0 * config.num_layers as f64).sqrt();
        let norm = |name: &str| {
            Norm::new(
                &init.scope(name),
                config.normalization,
                config.hidden_size,
                config.norm_epsilon,
                config.apply_layernorm_1p,
                parallel.sequence_parallel,
            )
        };
        let input_layernorm = norm("input_layernorm");
        let self_attention = SelfAttention::new(
            &init.scope("self_attention"),
            config,
            output_std,
            parallel.clone(),
        );
        let cross = cross_attention.then(|| {
            (
                norm("pre_cross_attn_layernorm"),
                CrossAttention::new(
                    &init.scope("cross_attention"),
                    config,
                    output_std,
                    parallel.clone(),
                ),
            )
        });
        let pre_mlp_layernorm = norm("pre_mlp_layernorm");
        let moe = config.moe.as_ref().and_then(|moe| {
            index
                .filter(|(i, _)| moe.is_moe_layer(*i))
                .map(|(_, experts)| (moe, experts))
        });
        let mlp = match moe {
            Some((moe, experts)) => FeedForward::Moe(MoeLayer::new(
                &init.scope("mlp"),
                config,
                moe,
                output_std,
                parallel,
                experts.clone(),
            )),
            None => FeedForward::Dense(Mlp::new(&init.scope("mlp"), config, output_std, parallel)),
        };
        TransformerLayer {
            input_layernorm,
            self_attention,
            cross,
            pre_mlp_layernorm,
            mlp,
            hidden_dropout: config.hidden_dropout,
            bias_dropout_fusion: true,
            residual_from_norm: config.apply_residual_connection_post_layernorm,
        }
    }

    /// With `fused` false (`--no-bias-dropout-fusion`) the hidden dropout runs as libtorch's
    /// dropout on the attention or MLP output at once, before its residual add + norm.
    pub fn with_bias_dropout_fusion(mut self, fused: bool) -> Self {
        self.bias_dropout_fusion = fused;
        self
    }

    /// Runs the layer's linears (attention projections, MLP) in fp8; norms, attention itself and
    /// everything outside the layers stay in the parameters' dtype, as with Transformer Engine.
    pub fn enable_fp8(&mut self, recipe: Fp8Recipe) -> Result<()> {
        let attention = &mut self.self_attention;
        attention
            .linear_qkv
            .enable_fp8("self_attention.linear_qkv", recipe)?;
        attention
            .linear_proj
            .enable_fp8("self_attention.linear_proj", recipe)?;
        if let Some((_, cross)) = &mut self.cross {
            cross
                .linear_q
                .enable_fp8("cross_attention.linear_q", recipe)?;
            cross
                .linear_kv
                .enable_fp8("cross_attention.linear_kv", recipe)?;
            cross
                .linear_proj
                .enable_fp8("cross_attention.linear_proj", recipe)?;
        }
        let FeedForward::Dense(mlp) = &mut self.mlp else {
            bail!("fp8 does not cover Mixture-of-Experts layers yet");
        };
        mlp.linear_fc1.enable_fp8("mlp.linear_fc1", recipe)?;
        mlp.linear_fc2.enable_fp8("mlp.linear_fc2", recipe)
    }

    /// The layer's fp8 linears under their names in the layer, for checkpoints.
    pub fn fp8_linears(&self) -> Vec<(&'static str, Arc<Fp8Linear>)> {
        let attention = &self.self_attention;
        let mut linears = vec![
            ("self_attention.linear_qkv", attention.linear_qkv.fp8()),
            ("self_attention.linear_proj", attention.linear_proj.fp8()),
        ];
        if let Some((_, cross)) = &self.cross {
            linears.extend([
                ("cross_attention.linear_q", cross.linear_q.fp8()),
                ("cross_attention.linear_kv", cross.linear_kv.fp8()),
                ("cross_attention.linear_proj", cross.linear_proj.fp8()),
            ]);
        }
        if let FeedForward::Dense(mlp) = &self.mlp {
            linears.extend([
                ("mlp.linear_fc1", mlp.linear_fc1.fp8()),
                ("mlp.linear_fc2", mlp.linear_fc2.fp8()),
            ]);
        }
        linears
            .into_iter()
            .filter_map(|(name, fp8)| Some((name, fp8?.clone())))
            .collect()
    }

    pub fn forward(
        &self,
        hidden: &Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        train: bool,
        recompute_core_attention: bool,
    ) -> Result<Tensor> {
        self.forward_attending(hidden, mask, rotary, None, train, recompute_core_attention)
    }

    /// [`forward`](Self::forward) of a layer that may also attend to `memory` (the encoder's
    /// output); decoder layers of an encoder-decoder need it, other layers must not get it.
    pub fn forward_attending(
        &self,
        hidden: &Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        memory: Option<&Memory>,
        train: bool,
        recompute_core_attention: bool,
    ) -> Result<Tensor> {
        let hidden = Residual::Summed(hidden.shallow_clone());
        Ok(self
            .forward_residual(
                hidden,
                mask,
                rotary,
                memory,
                train,
                recompute_core_attention,
            )?
            .sum())
    }

    /// [`forward_attending`](Self::forward_attending) on the residual stream: the input may
    /// still be a sum to form, and the output is one, so that each add meets the norm after it
    /// in [`Norm::add_and_norm`] (one kernel in training on GPUs), the next layer's input norm
    /// included. A stack of layers passes the stream from layer to layer.
    pub fn forward_residual(
        &self,
        hidden: Residual,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        memory: Option<&Memory>,
        train: bool,
        recompute_core_attention: bool,
    ) -> Result<Residual> {
        let hidden = self.block(hidden, &self.input_layernorm, train, |normed| {
            self.self_attention
                .forward(normed, mask, rotary, train, recompute_core_attention)
        })?;
        let hidden = match (&self.cross, memory) {
            (Some((norm, attention)), Some(memory)) => {
                self.block(hidden, norm, train, |normed| {
                    attention.forward(normed, &memory.states, &memory.mask, train)
                })?
            }
            (None, None) => hidden,
            (Some(_), None) => {
                bail!("a decoder layer with cross-attention needs the encoder output")
            }
            (None, Some(_)) => bail!("encoder output given to a layer without cross-attention"),
        };
        self.block(hidden, &self.pre_mlp_layernorm, train, |normed| {
            self.mlp.forward(normed, train)
        })
    }

    /// The keys and values this decoder layer's cross-attention reads from the encoder's
    /// output `memory` `[se, b, h]`.
    pub fn memory_keys_values(&self, memory: &Tensor) -> Result<MemoryKeysValues> {
        match &self.cross {
            Some((_, attention)) => attention.memory_keys_values(memory),
            None => bail!("encoder output given to a layer without cross-attention"),
        }
    }

    /// Inference of a decoder layer over new positions: causal self-attention through the
    /// layer's KV cache, then cross-attention to the projected encoder output under `mask`.
    pub fn forward_cached_attending(
        &self,
        hidden: &Tensor,
        cache: &mut LayerCache,
        memory: &MemoryKeysValues,
        mask: &AttentionMask,
    ) -> Result<Tensor> {
        let Some((norm, attention)) = &self.cross else {
            bail!("encoder output given to a layer without cross-attention");
        };
        let hidden = Residual::Summed(hidden.shallow_clone());
        let hidden = self.block(hidden, &self.input_layernorm, false, |normed| {
            self.self_attention.forward_cached(normed, None, cache)
        })?;
        let hidden = self.block(hidden, norm, false, |normed| {
            attention.attend(normed, memory, mask, false)
        })?;
        Ok(self
            .block(hidden, &self.pre_mlp_layernorm, false, |normed| {
                self.mlp.forward(normed, false)
            })?
            .sum())
    }

    /// Inference over new positions, attending through the layer's KV cache.
    pub fn forward_cached(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        self.forward_with(
            hidden,
            false,
            |normed| self.self_attention.forward_cached(normed, rotary, cache),
            |normed| self.mlp.forward(normed, false),
        )
    }

    /// Inference of new positions of several sequences through a paged KV cache; steps that
    /// ask for it run through the fused decode kernels where this layer allows
    /// ([`supports_decode_fusion`](Self::supports_decode_fusion)).
    pub fn forward_paged(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        pool: &mut Tensor,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let (s, b, _) = hidden.size3()?;
        if step.fuses(s * b)
            && hidden.kind() == self.self_attention.linear_qkv.weight.kind()
            && self.supports_decode_fusion()
        {
            return self.forward_paged_fused(hidden, rotary, pool, step);
        }
        let attend = |normed: &Tensor| {
            self.self_attention
                .forward_paged(normed, rotary, pool, step)
        };
        match s {
            1 => self.forward_with(hidden, false, attend, |normed| {
                self.mlp.forward_decode(normed)
            }),
            _ => self.forward_with(hidden, false, attend, |normed| {
                self.mlp.forward(normed, false)
            }),
        }
    }

    /// Whether decode steps can run this layer through the fused decode kernels
    /// ([`megatron_kernels::ops::decode_gemv`]): pre-norm residuals, no cross-attention, the inputs of the
    /// column-parallel layers whole, the weights in a layout the kernels read. Under tensor
    /// parallelism the row-parallel layers (attention output, fc2) keep their all-reduce before
    /// the bias and residual: only the norm + QKV and norm + fc1 (+ GeLU) fuse. Activations
    /// other than GeLU (SwiGLU, squared ReLU) run between fc1 and fc2 as libtorch operations.
    pub fn supports_decode_fusion(&self) -> bool {
        let FeedForward::Dense(mlp) = &self.mlp else {
            return false;
        };
        let attention = &self.self_attention;
        let fits = |weight: &Tensor| decode_gemv::fits(1, weight);
        !self.residual_from_norm
            && self.cross.is_none()
            && attention.linear_qkv.takes_whole_input()
            && mlp.linear_fc1.takes_whole_input()
            && fits(&attention.linear_qkv.weight)
            && fits(&mlp.linear_fc1.weight)
            && (!attention.linear_proj.is_whole() || fits(&attention.linear_proj.weight))
            && (!mlp.linear_fc2.is_whole() || fits(&mlp.linear_fc2.weight))
    }

    /// [`forward_paged`](Self::forward_paged) of few rows through the fused decode kernels: the
    /// norm, QKV, bias and attention (one kernel where
    /// [`SelfAttention::decode_attention`] can, else two); the output projection, bias and
    /// residual; the norm, fc1, bias and GeLU (other activations after it); fc2, bias and
    /// residual.
    fn forward_paged_fused(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        pool: &mut Tensor,
        step: &PagedStep,
    ) -> Result<Tensor> {
        let (s, b, h) = hidden.size3()?;
        let rows = s * b;
        let x = hidden.reshape([rows, h]);
        let FeedForward::Dense(mlp) = &self.mlp else {
            bail!("a Mixture-of-Experts layer has no fused decode path");
        };
        let attention = &self.self_attention;
        let context = attention.decode_attention(
            hidden,
            &self.input_layernorm.as_input_norm(),
            rotary,
            pool,
            step,
        )?;
        let attended = plus_row_parallel(&x, &attention.linear_proj, &context)?;
        let gelu = mlp.gelu();
        let intermediate = decode_linear(
            &attended,
            &mlp.linear_fc1.weight,
            Some(&self.pre_mlp_layernorm.as_input_norm()),
            &Epilogue {
                bias: mlp.linear_fc1.bias.as_deref(),
                gelu,
                residual: None,
            },
        )?;
        let intermediate = if gelu.is_some() {
            intermediate
        } else {
            mlp.activate(&intermediate)
        };
        let out = plus_row_parallel(&attended, &mlp.linear_fc2, &intermediate)?;
        Ok(out.view([s, b, h]))
    }

    /// The layer around its self-attention and MLP: norm, `attend`, residual, norm,
    /// `feed_forward`, residual.
    fn forward_with(
        &self,
        hidden: &Tensor,
        train: bool,
        attend: impl FnOnce(&Tensor) -> Result<Tensor>,
        feed_forward: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let hidden = Residual::Summed(hidden.shallow_clone());
        let hidden = self.block(hidden, &self.input_layernorm, train, attend)?;
        Ok(self
            .block(hidden, &self.pre_mlp_layernorm, train, feed_forward)?
            .sum())
    }

    /// One pre-norm block: the stream's sum (formed here if pending) is normed, `apply`'d and
    /// dropped out, and added back to the residual branch, which is left pending. Legacy
    /// models whose residual is the normed input (`--apply-residual-connection-post-layernorm`)
    /// add at once, with libtorch's ops.
    fn block(
        &self,
        hidden: Residual,
        norm: &Norm,
        train: bool,
        apply: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Residual> {
        let (input, normed) = match hidden {
            Residual::Summed(input) => {
                let normed = norm.forward(&input);
                (input, normed)
            }
            Residual::Pending {
                residual,
                delta,
                dropout,
            } => norm.add_and_norm(&residual, &delta, dropout, train)?,
        };
        let delta = apply(&normed)?;
        Ok(if self.residual_from_norm {
            Residual::Summed(normed + delta.dropout(self.hidden_dropout, train))
        } else if self.bias_dropout_fusion && train {
            Residual::Pending {
                residual: input,
                delta,
                dropout: self.hidden_dropout,
            }
        } else {
            Residual::Pending {
                residual: input,
                delta: delta.dropout(self.hidden_dropout, train),
                dropout: 0.0,
            }
        })
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.input_layernorm
            .named_tensors(&mut out.scope("input_layernorm"));
        self.self_attention
            .named_tensors(&mut out.scope("self_attention"));
        if let Some((norm, attention)) = &self.cross {
            norm.named_tensors(&mut out.scope("pre_cross_attn_layernorm"));
            attention.named_tensors(&mut out.scope("cross_attention"));
        }
        self.pre_mlp_layernorm
            .named_tensors(&mut out.scope("pre_mlp_layernorm"));
        self.mlp.named_tensors(&mut out.scope("mlp"));
    }
}

/// A layer's MLP: dense, or a Mixture of Experts (`--num-experts`, on the layers
/// `--moe-layer-freq` picks). Both sit under the layer's `mlp.` names.
#[derive(Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Moe(MoeLayer),
}

impl FeedForward {
    /// `train` adds a Mixture of Experts' auxiliary losses.
    pub fn forward(&self, hidden: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(hidden),
            FeedForward::Moe(moe) => moe.forward(hidden, train),
        }
    }

    /// Inference of a decode step (one new position per row): a Mixture of Experts runs
    /// every expert over the few tokens ([`MoeLayer::forward_every_expert`]), reading no
    /// counts back from the device, so that the step can be replayed from a CUDA graph.
    pub fn forward_decode(&self, hidden: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(hidden),
            FeedForward::Moe(moe) => moe.forward_every_expert(hidden),
        }
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        match self {
            FeedForward::Dense(mlp) => mlp.named_tensors(out),
            FeedForward::Moe(moe) => moe.named_tensors(out),
        }
    }
}

/// The residual stream between pre-norm blocks: a tensor, or a block's output not yet dropped
/// out (with probability `dropout`, 0 outside training) and added to its residual branch, so
/// that the dropout and the add happen in the next norm's kernel.
pub enum Residual {
    Summed(Tensor),
    Pending {
        residual: Tensor,
        delta: Tensor,
        dropout: f64,
    },
}

impl Residual {
    /// The stream as one tensor, with libtorch's dropout and add for a pending sum.
    pub fn sum(self) -> Tensor {
        match self {
            Residual::Summed(hidden) => hidden,
            Residual::Pending {
                residual,
                delta,
                dropout,
            } => residual + delta.dropout(dropout, dropout > 0.0),
        }
    }
}

/// What a decoder layer attends to besides itself: the encoder's output `[se, b, h]` (a
/// sequence-parallel slice when enabled) and the encoder's padding as the mask.
pub struct Memory {
    pub states: Tensor,
    pub mask: AttentionMask,
}

impl Clone for Memory {
    fn clone(&self) -> Memory {
        Memory {
            states: self.states.shallow_clone(),
            mask: self.mask.clone(),
        }
    }
}

/// `residual + linear(input)` for a decode step of few rows: one fused kernel (bias and residual
/// in its epilogue) when the layer is whole on this rank; otherwise the all-reduce has to come
/// between the product and the bias, so the layer runs unfused.
fn plus_row_parallel(
    residual: &Tensor,
    linear: &RowParallelLinear,
    input: &Tensor,
) -> Result<Tensor> {
    if !linear.is_whole() {
        return Ok(residual + linear.forward(input)?);
    }
    decode_linear(
        input,
        &linear.weight,
        None,
        &Epilogue {
            bias: linear.bias.as_deref(),
            residual: Some(residual),
            ..Epilogue::default()
        },
    )
}

/// Enables fp8 in those of `layers` (global indices `global`, of a stack of `num_layers`) that
/// `plan` puts in fp8.
pub fn enable_planned_fp8(
    plan: &Fp8Plan,
    layers: &mut [TransformerLayer],
    global: Range<usize>,
    num_layers: usize,
) -> Result<()> {
    for (layer, index) in layers.iter_mut().zip(global) {
        if plan.in_fp8(index, num_layers) {
            layer.enable_fp8(plan.recipe)?;
        }
    }
    Ok(())
}

/// The expert biases of the MoE routers of `layers` (`--moe-router-enable-expert-bias`) under
/// their checkpoint names, `<scope>.<i>.mlp.router.expert_bias` with `i` counted from 0 within
/// the chunk.
pub fn scoped_expert_biases(layers: &[TransformerLayer], scope: &str) -> Vec<(String, ExpertBias)> {
    layers
        .iter()
        .enumerate()
        .filter_map(|(i, layer)| match &layer.mlp {
            FeedForward::Moe(moe) => moe
                .router
                .expert_bias
                .clone()
                .map(|bias| (format!("{scope}.{i}.mlp.router.expert_bias"), bias)),
            FeedForward::Dense(_) => None,
        })
        .collect()
}

/// The fp8 linears of `layers` under their checkpoint names, `<scope>.<i>.<linear>` with `i`
/// counted from 0 within the chunk (as its parameter names are).
pub fn scoped_fp8_linears(
    layers: &[TransformerLayer],
    scope: &str,
) -> Vec<(String, Arc<Fp8Linear>)> {
    layers
        .iter()
        .enumerate()
        .flat_map(|(i, layer)| {
            layer
                .fp8_linears()
                .into_iter()
                .map(move |(name, linear)| (format!("{scope}.{i}.{name}"), linear))
        })
        .collect()
}
