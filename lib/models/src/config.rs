//! The transformer architecture every family shares, as Megatron's flags describe it (spec §1). Stored in
//! checkpoint metadata so that other tools can rebuild the model without repeating the flags.

use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

pub use megatron_kernels::ops::Normalization;

pub use crate::layers::moe::config::MoeConfig;
use crate::rope_scaling::{self, RopeScaling};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEmbeddingType {
    LearnedAbsolute,
    Rope,
    None,
}

impl PositionEmbeddingType {
    /// Megatron's `--position-embedding-type` values; `yarn` is RoPE whose scaling the YaRN
    /// flags describe (`RopeScaling::Yarn`).
    pub fn parse(value: &str) -> Result<Self> {
        Ok(match value {
            "learned_absolute" => Self::LearnedAbsolute,
            "rope" | "yarn" => Self::Rope,
            "none" => Self::None,
            other => bail!(
                "--position-embedding-type {other:?}: expected learned_absolute, rope, yarn or none"
            ),
        })
    }
}

/// The MLP non-linearity. Which GeLU a Megatron run used depends on fusion flags (spec §1.1):
/// the fused bias-GeLU kernel is the tanh approximation, the unfused path is exact erf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    GeluTanh,
    GeluErf,
    Swiglu,
    SquaredRelu,
}

impl Activation {
    /// Megatron's choice from `--swiglu`, `--squared-relu`, `--openai-gelu`, `--onnx-safe`,
    /// `--no-bias-gelu-fusion` and `--disable-bias-linear` (which turns the fusion off).
    pub fn from_flags(
        swiglu: bool,
        squared_relu: bool,
        openai_gelu: bool,
        bias_gelu_fusion: bool,
        add_bias_linear: bool,
    ) -> Self {
        if swiglu {
            Self::Swiglu
        } else if squared_relu {
            Self::SquaredRelu
        } else if openai_gelu || (bias_gelu_fusion && add_bias_linear) {
            Self::GeluTanh
        } else {
            Self::GeluErf
        }
    }
}

/// The transformer trunk every model family shares (GPT, BERT and T5 build on it): its shape,
/// normalization, activation, position embeddings and vocabulary, as Megatron's flags describe it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransformerConfig {
    pub num_layers: usize,
    pub hidden_size: i64,
    pub num_attention_heads: i64,
    /// Equal to `num_attention_heads` without `--group-query-attention`.
    pub num_query_groups: i64,
    pub kv_channels: i64,
    pub ffn_hidden_size: i64,
    pub max_position_embeddings: i64,
    /// The tokenizer's vocabulary size before padding.
    pub vocab_size: i64,
    pub make_vocab_size_divisible_by: i64,
    pub position_embedding_type: PositionEmbeddingType,
    pub rotary_base: f64,
    pub rotary_percent: f64,
    /// RoPE scaling for long contexts; absent in metadata written before it existed.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "rope_scaling::deserialize_stored"
    )]
    pub rope_scaling: Option<RopeScaling>,
    pub normalization: Normalization,
    pub norm_epsilon: f64,
    pub apply_layernorm_1p: bool,
    pub activation: Activation,
    pub add_bias_linear: bool,
    pub add_qkv_bias: bool,
    pub untie_embeddings_and_output_weights: bool,
    pub apply_residual_connection_post_layernorm: bool,
    pub hidden_dropout: f64,
    pub attention_dropout: f64,
    pub init_method_std: f64,
    /// `--qk-layernorm`: each query and key head is normalised (the model's normalization over
    /// the head's channels, `self_attention.{q,k}_layernorm.weight`) after the projection and
    /// before the rotary embedding, as in Qwen3; absent in metadata written before it existed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub qk_layernorm: bool,
    /// `--num-experts`: the MLPs of the layers `--moe-layer-freq` picks are Mixtures of
    /// Experts; absent for dense models (and in metadata written before MoE existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

impl TransformerConfig {
    /// GPT-345M as spec §1.7 lists it.
    pub fn gpt_345m() -> Self {
        TransformerConfig {
            num_layers: 24,
            hidden_size: 1024,
            num_attention_heads: 16,
            num_query_groups: 16,
            kv_channels: 64,
            ffn_hidden_size: 4096,
            max_position_embeddings: 1024,
            vocab_size: 50257,
            make_vocab_size_divisible_by: 128,
            position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
            rotary_base: 10000.0,
            rotary_percent: 1.0,
            rope_scaling: None,
            normalization: Normalization::LayerNorm,
            norm_epsilon: 1e-5,
            apply_layernorm_1p: false,
            activation: Activation::GeluTanh,
            add_bias_linear: true,
            add_qkv_bias: true,
            untie_embeddings_and_output_weights: false,
            apply_residual_connection_post_layernorm: false,
            hidden_dropout: 0.1,
            attention_dropout: 0.1,
            init_method_std: 0.02,
            qk_layernorm: false,
            moe: None,
        }
    }

    /// The width of one attention head when a config gives none: `hidden / heads`, `None`
    /// unless `heads` is positive and divides `hidden` (Megatron asserts the same).
    pub fn derived_head_width(hidden: i64, heads: i64) -> Option<i64> {
        (heads > 0 && hidden > 0 && hidden % heads == 0).then(|| hidden / heads)
    }

    /// Megatron's padded vocabulary: a multiple of `make_vocab_size_divisible_by · t`.
    pub fn padded_vocab_size(&self, tensor_parallel_size: i64) -> i64 {
        let multiple = self.make_vocab_size_divisible_by * tensor_parallel_size;
        (self.vocab_size + multiple - 1) / multiple * multiple
    }

    /// Width of the fused QKV projection: `(n + 2g) · d`.
    pub fn qkv_width(&self) -> i64 {
        (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels
    }

    /// Width of fc1's output (doubled for the gated SwiGLU).
    pub fn fc1_width(&self) -> i64 {
        match self.activation {
            Activation::Swiglu => 2 * self.ffn_hidden_size,
            _ => self.ffn_hidden_size,
        }
    }

    pub fn rotary_dim(&self) -> i64 {
        (self.kv_channels as f64 * self.rotary_percent) as i64
    }

    /// The checks Megatron's `validate_args` makes on the architecture.
    pub fn validate(&self, tensor_parallel_size: i64) -> Result<()> {
        ensure!(self.num_layers > 0, "--num-layers must be positive");
        ensure!(self.hidden_size > 0, "--hidden-size must be positive");
        ensure!(
            self.num_attention_heads > 0 && self.num_attention_heads % tensor_parallel_size == 0,
            "--num-attention-heads {} must be a positive multiple of --tensor-model-parallel-size {tensor_parallel_size}",
            self.num_attention_heads
        );
        ensure!(
            self.num_query_groups > 0 && self.num_attention_heads % self.num_query_groups == 0,
            "--num-query-groups {} must divide --num-attention-heads {}",
            self.num_query_groups,
            self.num_attention_heads
        );
        ensure!(
            self.num_query_groups % tensor_parallel_size == 0,
            "--num-query-groups {} must be a multiple of --tensor-model-parallel-size {tensor_parallel_size}",
            self.num_query_groups
        );
        ensure!(
            self.ffn_hidden_size % tensor_parallel_size == 0,
            "--ffn-hidden-size must be a multiple of the TP size"
        );
        ensure!(self.vocab_size > 0, "the tokenizer has an empty vocabulary");
        if self.position_embedding_type == PositionEmbeddingType::Rope {
            let rotary = self.rotary_dim();
            ensure!(
                rotary > 0 && rotary % 2 == 0,
                "--rotary-percent gives an odd or empty rotary dimension {rotary}"
            );
        }
        if let Some(scaling) = &self.rope_scaling {
            ensure!(
                self.position_embedding_type == PositionEmbeddingType::Rope,
                "{} needs --position-embedding-type rope",
                scaling.flag()
            );
            // Megatron's YaRN spans the whole head whatever --rotary-percent says, transformers'
            // only the rotated part: with both at 1 they agree.
            ensure!(
                !matches!(scaling, RopeScaling::Yarn(_)) || self.rotary_percent == 1.0,
                "yarn rope scaling needs --rotary-percent 1.0 (got {})",
                self.rotary_percent
            );
            scaling.validate()?;
        }
        if let Some(moe) = &self.moe {
            moe.validate(self.num_layers)?;
            ensure!(
                !self.add_bias_linear,
                "--num-experts needs --disable-bias-linear: Megatron's experts scale their \
                 activations by the router's probabilities before fc2, which takes no bias"
            );
        }
        ensure!(
            (0.0..1.0).contains(&self.hidden_dropout)
                && (0.0..1.0).contains(&self.attention_dropout),
            "dropout probabilities must be in [0, 1)"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_padding_depends_on_tensor_parallel_size() {
        let config = TransformerConfig::gpt_345m();
        assert_eq!(config.padded_vocab_size(1), 50304);
        assert_eq!(config.padded_vocab_size(2), 50432);
        assert_eq!(config.qkv_width(), 3 * 1024);
        config.validate(1).unwrap();
        assert!(config.validate(3).is_err());
    }

    #[test]
    fn gelu_flavour_follows_the_fusion_flags() {
        assert_eq!(
            Activation::from_flags(false, false, false, true, true),
            Activation::GeluTanh
        );
        assert_eq!(
            Activation::from_flags(false, false, false, true, false),
            Activation::GeluErf
        );
        assert_eq!(
            Activation::from_flags(false, false, false, false, true),
            Activation::GeluErf
        );
        assert_eq!(
            Activation::from_flags(true, false, false, true, true),
            Activation::Swiglu
        );
    }
}
