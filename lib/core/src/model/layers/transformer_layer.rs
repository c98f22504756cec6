//! One pre-LN transformer layer (spec §1.1).

use anyhow::Result;
use tch::Tensor;

use super::attention::{AttentionMask, DecodeStep, SelfAttention};
use super::kv_cache::LayerCache;
use super::mlp::Mlp;
use super::norm::Norm;
use super::rope::RotaryTables;
use super::{NamedTensors, TensorParallel};
use crate::model::config::GptConfig;
use crate::model::param::Initializer;

#[derive(Clone)]
pub struct TransformerLayer {
    pub input_layernorm: Norm,
    pub self_attention: SelfAttention,
    pub pre_mlp_layernorm: Norm,
    pub mlp: Mlp,
    hidden_dropout: f64,
    residual_from_norm: bool,
}

impl TransformerLayer {
    /// `init` is scoped to the layer's global name (`decoder.layers.<global index>`).
    pub fn new(init: &Initializer, config: &GptConfig, parallel: TensorParallel) -> Self {
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
        let pre_mlp_layernorm = norm("pre_mlp_layernorm");
        let mlp = Mlp::new(&init.scope("mlp"), config, output_std, parallel);
        TransformerLayer {
            input_layernorm,
            self_attention,
            pre_mlp_layernorm,
            mlp,
            hidden_dropout: config.hidden_dropout,
            residual_from_norm: config.apply_residual_connection_post_layernorm,
        }
    }

    pub fn forward(
        &self,
        hidden: &Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        train: bool,
        recompute_core_attention: bool,
    ) -> Result<Tensor> {
        self.forward_with(hidden, train, |normed| {
            self.self_attention
                .forward(normed, mask, rotary, train, recompute_core_attention)
        })
    }

    /// Inference over new positions, attending through the layer's KV cache.
    pub fn forward_cached(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        cache: &mut LayerCache,
    ) -> Result<Tensor> {
        self.forward_with(hidden, false, |normed| {
            self.self_attention.forward_cached(normed, rotary, cache)
        })
    }

    /// Inference of one new position per sequence at a slot held on the device.
    pub fn forward_decode(
        &self,
        hidden: &Tensor,
        rotary: Option<&RotaryTables>,
        cache: &mut LayerCache,
        step: &DecodeStep,
    ) -> Result<Tensor> {
        self.forward_with(hidden, false, |normed| {
            self.self_attention
                .forward_decode(normed, rotary, cache, step)
        })
    }

    /// The block around its attention: norm, attention, residual, norm, MLP, residual.
    fn forward_with(
        &self,
        hidden: &Tensor,
        train: bool,
        attend: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let normed = self.input_layernorm.forward(hidden);
        let attention = attend(&normed)?;
        let residual = if self.residual_from_norm {
            &normed
        } else {
            hidden
        };
        let hidden = residual + attention.dropout(self.hidden_dropout, train);
        let normed = self.pre_mlp_layernorm.forward(&hidden);
        let mlp = self.mlp.forward(&normed)?;
        let residual = if self.residual_from_norm {
            &normed
        } else {
            &hidden
        };
        Ok(residual + mlp.dropout(self.hidden_dropout, train))
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.input_layernorm
            .named_tensors(&mut out.scope("input_layernorm"));
        self.self_attention
            .named_tensors(&mut out.scope("self_attention"));
        self.pre_mlp_layernorm
            .named_tensors(&mut out.scope("pre_mlp_layernorm"));
        self.mlp.named_tensors(&mut out.scope("mlp"));
    }
}
