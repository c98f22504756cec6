//! Architecture flags (spec §1.6).

use anyhow::{ensure, Result};
use clap::Args;
use megatron_cli::ranges;

use super::moe::MoeArgs;

use megatron_models::{
    Activation, Normalization, PositionEmbeddingType, RopeScalingArgs, TransformerConfig,
};

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct ModelArgs {
    /// Number of transformer layers.
    #[arg(long)]
    pub num_layers: usize,
    /// Transformer hidden size.
    #[arg(long)]
    pub hidden_size: i64,
    /// MLP hidden size [default: 4 × hidden size; with --swiglu ⌊8h/3/64⌋·64].
    #[arg(long)]
    pub ffn_hidden_size: Option<i64>,
    /// Number of attention heads.
    #[arg(long)]
    pub num_attention_heads: i64,
    /// Head dimension [default: hidden size / heads].
    #[arg(long)]
    pub kv_channels: Option<i64>,
    /// Use grouped-query attention (with --num-query-groups).
    #[arg(long)]
    pub group_query_attention: bool,
    /// Key/value head groups for grouped-query attention.
    #[arg(long, default_value_t = 1)]
    pub num_query_groups: i64,
    /// Maximum sequence length the model is trained on.
    #[arg(long)]
    pub seq_length: i64,
    /// Size of the learned position table [default: --seq-length].
    #[arg(long)]
    pub max_position_embeddings: Option<i64>,
    /// learned_absolute, rope, yarn (RoPE with YaRN scaling) or none.
    #[arg(
        long,
        default_value = "learned_absolute",
        value_parser = ["learned_absolute", "rope", "yarn", "none"],
        hide_possible_values = true
    )]
    pub position_embedding_type: String,
    /// Megatron's older spelling of --position-embedding-type rope.
    #[arg(long)]
    pub use_rotary_position_embeddings: bool,
    /// Fraction of each head's channels rotated by RoPE.
    #[arg(long, default_value_t = 1.0, value_parser = ranges::probability, allow_hyphen_values = true)]
    pub rotary_percent: f64,
    /// RoPE base period.
    #[arg(long, default_value_t = 10000.0, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub rotary_base: f64,
    #[command(flatten)]
    #[serde(flatten)]
    pub rope: RopeScalingArgs,
    /// Pad the vocabulary to a multiple of this (times the tensor-parallel size).
    #[arg(long, default_value_t = 128)]
    pub make_vocab_size_divisible_by: i64,
    /// LayerNorm or RMSNorm.
    #[arg(long, default_value = "LayerNorm", value_parser = ["LayerNorm", "RMSNorm"], hide_possible_values = true)]
    pub normalization: String,
    /// Epsilon of the normalisation layers (alias: --layernorm-epsilon).
    #[arg(long, alias = "layernorm-epsilon", default_value_t = 1e-5, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub norm_epsilon: f64,
    /// Store LayerNorm weights zero-centred (gamma = 1 + w).
    #[arg(long)]
    pub apply_layernorm_1p: bool,
    /// Normalise each query and key head (with --normalization, over the head's channels)
    /// after the QKV projection and before the rotary embedding, as Qwen3 does.
    #[arg(long)]
    pub qk_layernorm: bool,
    /// Gated SiLU MLP (fc1 doubled).
    #[arg(long)]
    pub swiglu: bool,
    /// relu(x)² activation.
    #[arg(long)]
    pub squared_relu: bool,
    /// GeLU with OpenAI's tanh approximation.
    #[arg(long)]
    pub openai_gelu: bool,
    /// Use the unfused (exact erf) GeLU instead of the fused tanh approximation.
    #[arg(long)]
    pub no_bias_gelu_fusion: bool,
    /// No biases in the linear layers (also switches GeLU to erf, as in Megatron).
    #[arg(long)]
    pub disable_bias_linear: bool,
    /// Bias on the QKV projection even with --disable-bias-linear.
    #[arg(long)]
    pub add_qkv_bias: bool,
    /// A separate output projection instead of the tied word embeddings.
    #[arg(long)]
    pub untie_embeddings_and_output_weights: bool,
    /// Residual taken from the LayerNorm output instead of its input (legacy models).
    #[arg(long)]
    pub apply_residual_connection_post_layernorm: bool,
    /// Standard deviation of the normal weight init.
    #[arg(long, default_value_t = 0.02, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub init_method_std: f64,
    /// Dropout on embeddings and after attention/MLP.
    #[arg(long, default_value_t = 0.1, value_parser = ranges::probability, allow_hyphen_values = true)]
    pub hidden_dropout: f64,
    /// Dropout on attention probabilities.
    #[arg(long, default_value_t = 0.1, value_parser = ranges::probability, allow_hyphen_values = true)]
    pub attention_dropout: f64,
    /// Accepted for compatibility: attention always runs through libtorch's fused
    /// scaled_dot_product_attention (flash attention on GPUs).
    #[arg(long)]
    pub use_flash_attn: bool,
    /// Accepted for compatibility: weights are always drawn on the CPU over the full tensor,
    /// so the same seed gives the same model for any tensor-parallel size.
    #[arg(long)]
    pub use_cpu_initialization: bool,
    /// Accepted for compatibility (mathematically a no-op; attention is computed by SDPA).
    #[arg(long)]
    pub apply_query_key_layer_scaling: bool,
    /// Accepted for compatibility (the softmax of SDPA accumulates in float32).
    #[arg(long)]
    pub attention_softmax_in_fp32: bool,
    /// Accepted for compatibility: local, transformer_engine (only affects Megatron's key names).
    #[arg(long)]
    pub transformer_impl: Option<String>,
    /// Compute the output layer and the cross entropy together, chunk by chunk over the
    /// tokens, without ever holding the full logits (less memory, fewer passes over them).
    #[arg(long)]
    pub cross_entropy_loss_fusion: bool,
    /// native or te: both select the one fused implementation of --cross-entropy-loss-fusion.
    #[arg(long, default_value = "native", value_parser = ["native", "te"])]
    pub cross_entropy_fusion_impl: String,
    /// Accepted for compatibility (the model is Megatron-core's GPT).
    #[arg(long)]
    pub use_mcore_models: bool,
    /// Accepted for compatibility: attention's softmax always runs inside libtorch's
    /// scaled_dot_product_attention kernels.
    #[arg(long)]
    pub no_masked_softmax_fusion: bool,
    /// Accepted for compatibility, as --no-masked-softmax-fusion.
    #[arg(long)]
    pub masked_softmax_fusion: bool,
    /// Accepted for compatibility: flash, fused, unfused, local or auto; attention always runs
    /// through libtorch's scaled_dot_product_attention, which picks its kernel.
    #[arg(long, value_parser = ["flash", "fused", "unfused", "local", "auto"])]
    pub attention_backend: Option<String>,
    /// Rotary embeddings through libtorch's ops instead of the fused kernel that rotates each
    /// query and key channel in one pass forward and one backward (training on GPUs).
    #[arg(long)]
    pub no_rope_fusion: bool,
    /// Accepted for compatibility: norms run as the fused residual add + norm kernels in
    /// training on GPUs, as libtorch's elsewhere.
    #[arg(long)]
    pub no_persist_layer_norm: bool,
    /// Accepted for compatibility: SwiGLU has one implementation, the same values either way.
    #[arg(long)]
    pub no_bias_swiglu_fusion: bool,
    /// Accepted for compatibility (deprecated in Megatron): tensor-parallel all-reduces are not
    /// overlapped with the weight-gradient GEMMs.
    #[arg(long)]
    pub no_async_tensor_model_parallel_allreduce: bool,
    #[command(flatten)]
    #[serde(flatten)]
    pub moe: MoeArgs,
}

impl ModelArgs {
    /// The architecture for a tokenizer of `vocab_size` tokens.
    pub fn gpt_config(&self, vocab_size: i64) -> Result<TransformerConfig> {
        ensure!(
            self.hidden_size % self.num_attention_heads == 0 || self.kv_channels.is_some(),
            "--hidden-size {} is not divisible by --num-attention-heads {}; give --kv-channels",
            self.hidden_size,
            self.num_attention_heads
        );
        let num_query_groups = if self.group_query_attention {
            self.num_query_groups
        } else {
            self.num_attention_heads
        };
        let ffn_hidden_size = self.ffn_hidden_size.unwrap_or(if self.swiglu {
            (4 * self.hidden_size * 2 / 3) / 64 * 64
        } else {
            4 * self.hidden_size
        });
        let max_position_embeddings = self.max_position_embeddings.unwrap_or(self.seq_length);
        let position_embedding_type = if self.use_rotary_position_embeddings {
            PositionEmbeddingType::Rope
        } else {
            PositionEmbeddingType::parse(&self.position_embedding_type)?
        };
        if position_embedding_type == PositionEmbeddingType::LearnedAbsolute {
            ensure!(
                max_position_embeddings >= self.seq_length,
                "--max-position-embeddings {max_position_embeddings} must be at least --seq-length {}",
                self.seq_length
            );
        }
        let add_bias_linear = !self.disable_bias_linear;
        Ok(TransformerConfig {
            num_layers: self.num_layers,
            hidden_size: self.hidden_size,
            num_attention_heads: self.num_attention_heads,
            num_query_groups,
            kv_channels: self
                .kv_channels
                .unwrap_or(self.hidden_size / self.num_attention_heads),
            ffn_hidden_size,
            max_position_embeddings,
            vocab_size,
            make_vocab_size_divisible_by: self.make_vocab_size_divisible_by,
            position_embedding_type,
            rotary_base: self.rotary_base,
            rotary_percent: self.rotary_percent,
            rope_scaling: self.rope.scaling(&self.position_embedding_type)?,
            normalization: Normalization::parse(&self.normalization)?,
            norm_epsilon: self.norm_epsilon,
            apply_layernorm_1p: self.apply_layernorm_1p,
            activation: Activation::from_flags(
                self.swiglu,
                self.squared_relu,
                self.openai_gelu,
                !self.no_bias_gelu_fusion,
                add_bias_linear,
            ),
            add_bias_linear,
            add_qkv_bias: add_bias_linear || self.add_qkv_bias,
            untie_embeddings_and_output_weights: self.untie_embeddings_and_output_weights,
            apply_residual_connection_post_layernorm: self.apply_residual_connection_post_layernorm,
            hidden_dropout: self.hidden_dropout,
            attention_dropout: self.attention_dropout,
            init_method_std: self.init_method_std,
            qk_layernorm: self.qk_layernorm,
            moe: self
                .moe
                .config(self.num_layers, ffn_hidden_size, add_bias_linear)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn config(extra: &[&str]) -> TransformerConfig {
        let shape = [
            "pretrain",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
        ];
        let flags = Flags::try_parse_from(shape.iter().chain(extra)).unwrap();
        flags.model.gpt_config(1000).unwrap()
    }

    /// Megatron's scripts pass kernel switches (softmax, RoPE, layer norm, SwiGLU fusion, the
    /// attention backend): they parse and leave the architecture as it is.
    #[test]
    fn megatrons_kernel_switches_are_accepted_and_change_no_architecture() {
        let switches = [
            "--no-masked-softmax-fusion",
            "--masked-softmax-fusion",
            "--attention-backend",
            "flash",
            "--no-rope-fusion",
            "--no-persist-layer-norm",
            "--no-bias-swiglu-fusion",
            "--no-async-tensor-model-parallel-allreduce",
            "--use-flash-attn",
            "--attention-softmax-in-fp32",
            "--transformer-impl",
            "local",
        ];
        let plain = serde_json::to_value(config(&[])).unwrap();
        assert_eq!(serde_json::to_value(config(&switches)).unwrap(), plain);
    }

    /// Megatron's RoPE scaling flags become the model's scaling, each with its parameters and
    /// Megatron's defaults for the rest; two scalings at once are refused.
    #[test]
    fn rope_scaling_flags_select_one_scaling() {
        use megatron_models::{Llama3Scaling, RopeScaling, YarnScaling};
        let rope = ["--position-embedding-type", "rope"];
        let scaling = |extra: &[&str]| config(&[&rope[..], extra].concat()).rope_scaling;
        assert_eq!(scaling(&[]), None);
        assert_eq!(
            scaling(&["--use-rope-scaling", "--rope-scaling-factor", "16"]),
            Some(RopeScaling::Llama3(Llama3Scaling::megatron(16.0)))
        );
        assert_eq!(
            scaling(&["--rotary-seq-len-interpolation-factor", "4"]),
            Some(RopeScaling::Linear { factor: 4.0 })
        );
        let yarn = YarnScaling {
            original_max_position_embeddings: 16,
            beta_fast: 8.0,
            mscale: 0.707,
            mscale_all_dim: 0.5,
            correction_range_round_to_int: false,
            ..YarnScaling::megatron(4.0)
        };
        let yarn_flags = [
            "--rotary-scaling-factor",
            "4",
            "--yarn-original-max-position-embeddings",
            "16",
            "--yarn-beta-fast",
            "8",
            "--mscale",
            "0.707",
            "--mscale-all-dim",
            "0.5",
            "--no-yarn-correction-range-round-to-int",
        ];
        let selected = config(&[&["--position-embedding-type", "yarn"][..], &yarn_flags].concat());
        assert_eq!(
            selected.position_embedding_type,
            PositionEmbeddingType::Rope
        );
        assert_eq!(selected.rope_scaling, Some(RopeScaling::Yarn(yarn)));
        assert_eq!(
            scaling(&[&["--rope-type", "yarn"][..], &yarn_flags].concat()),
            Some(RopeScaling::Yarn(yarn))
        );
        let shape = [
            "pretrain",
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--position-embedding-type",
            "yarn",
            "--use-rope-scaling",
        ];
        let flags = Flags::try_parse_from(shape).unwrap();
        let error = flags.model.gpt_config(1000).unwrap_err().to_string();
        assert!(
            error.contains("--use-rope-scaling and --position-embedding-type yarn"),
            "{error}"
        );
        let negative = [&shape[..9], &["--rotary-scaling-factor", "-1"][..]].concat();
        let error = Flags::try_parse_from(negative).err().unwrap().to_string();
        assert!(error.contains("--rotary-scaling-factor"), "{error}");
    }
}
