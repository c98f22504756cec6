//! Megatron's `args` namespace (as pickled in its checkpoints) → our [`TransformerConfig`].

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::Value;

use super::megatron_moe_args::moe_config;
use megatron_models::{
    Activation, Normalization, PositionEmbeddingType, RopeScalingArgs, TransformerConfig,
};

fn int(args: &Value, key: &str) -> Result<i64> {
    args.get(key)
        .and_then(Value::as_i64)
        .with_context(|| format!("the checkpoint's args have no integer {key}"))
}

/// A count or size of the args that must be positive (layers, widths, heads).
fn positive(args: &Value, key: &str) -> Result<i64> {
    let value = int(args, key)?;
    ensure!(
        value > 0,
        "the checkpoint's args: {key} {value} must be positive"
    );
    Ok(value)
}

fn int_or(args: &Value, key: &str, default: i64) -> i64 {
    args.get(key).and_then(Value::as_i64).unwrap_or(default)
}

fn float_or(args: &Value, key: &str, default: f64) -> f64 {
    args.get(key).and_then(Value::as_f64).unwrap_or(default)
}

fn flag(args: &Value, key: &str) -> bool {
    args.get(key).and_then(Value::as_bool).unwrap_or(false)
}

/// The tokenizer's true vocabulary size as far as the args tell: `--true-vocab-size` wins,
/// then the NullTokenizer's `vocab_size + 1`, GPT-2 BPE's 50257; otherwise the padded size
/// (padding rows are then kept as ordinary rows).
pub fn true_vocab_size(args: &Value, padded_rows: i64, given: Option<i64>) -> i64 {
    if let Some(size) = given {
        return size;
    }
    match args.get("tokenizer_type").and_then(Value::as_str) {
        Some("NullTokenizer") => match args.get("vocab_size").and_then(Value::as_i64) {
            Some(size) => size + 1,
            None => padded_rows,
        },
        Some("GPT2BPETokenizer") => 50257,
        _ => padded_rows,
    }
}

/// The RoPE scaling flags as the args recorded them (Megatron's defaults where absent).
fn rope_flags(args: &Value) -> RopeScalingArgs {
    let defaults = RopeScalingArgs::default();
    let float = |key: &str| args.get(key).and_then(Value::as_f64);
    RopeScalingArgs {
        use_rope_scaling: flag(args, "use_rope_scaling"),
        rope_scaling_factor: float_or(args, "rope_scaling_factor", defaults.rope_scaling_factor),
        rotary_seq_len_interpolation_factor: float("rotary_seq_len_interpolation_factor"),
        rope_type: args
            .get("rope_type")
            .and_then(Value::as_str)
            .map(str::to_string),
        rotary_scaling_factor: float_or(
            args,
            "rotary_scaling_factor",
            defaults.rotary_scaling_factor,
        ),
        mscale: float_or(args, "mscale", defaults.mscale),
        mscale_all_dim: float_or(args, "mscale_all_dim", defaults.mscale_all_dim),
        yarn_original_max_position_embeddings: args
            .get("yarn_original_max_position_embeddings")
            .and_then(Value::as_i64),
        yarn_beta_fast: float("yarn_beta_fast"),
        yarn_beta_slow: float("yarn_beta_slow"),
        yarn_correction_range_round_to_int: false,
        no_yarn_correction_range_round_to_int: args
            .get("yarn_correction_range_round_to_int")
            .and_then(Value::as_bool)
            == Some(false),
    }
}

/// The architecture the args describe, for a vocabulary of `vocab_size` tokens.
pub fn gpt_config(args: &Value, vocab_size: i64) -> Result<TransformerConfig> {
    let hidden_size = positive(args, "hidden_size")?;
    let heads = positive(args, "num_attention_heads")?;
    let groups = if flag(args, "group_query_attention") {
        positive(args, "num_query_groups")?
    } else {
        heads
    };
    ensure!(
        heads % groups == 0,
        "the checkpoint's args: num_query_groups {groups} must divide num_attention_heads {heads}"
    );
    let kv_channels = match args.get("kv_channels").and_then(Value::as_i64) {
        Some(width) if width > 0 => width,
        Some(width) => bail!("the checkpoint's args: kv_channels {width} must be positive"),
        None => TransformerConfig::derived_head_width(hidden_size, heads).with_context(|| {
            format!("the checkpoint's args: num_attention_heads {heads} must divide hidden_size {hidden_size}")
        })?,
    };
    let swiglu = flag(args, "swiglu");
    let ffn_hidden_size = args
        .get("ffn_hidden_size")
        .and_then(Value::as_i64)
        .unwrap_or(if swiglu {
            (4 * hidden_size * 2 / 3) / 64 * 64
        } else {
            4 * hidden_size
        });
    let add_bias_linear = args
        .get("add_bias_linear")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let position = args
        .get("position_embedding_type")
        .and_then(Value::as_str)
        .unwrap_or("learned_absolute");
    let normalization = args
        .get("normalization")
        .and_then(Value::as_str)
        .unwrap_or("LayerNorm");
    let rope_scaling = rope_flags(args)
        .scaling(position)
        .context("the checkpoint's args")?;
    let seq_length = int_or(args, "seq_length", 0);
    let num_layers = positive(args, "num_layers")? as usize;
    Ok(TransformerConfig {
        num_layers,
        hidden_size,
        num_attention_heads: heads,
        num_query_groups: groups,
        kv_channels,
        ffn_hidden_size,
        max_position_embeddings: args
            .get("max_position_embeddings")
            .and_then(Value::as_i64)
            .unwrap_or(seq_length),
        vocab_size,
        make_vocab_size_divisible_by: int_or(args, "make_vocab_size_divisible_by", 128),
        position_embedding_type: PositionEmbeddingType::parse(position)?,
        rotary_base: float_or(args, "rotary_base", 10000.0),
        rotary_percent: float_or(args, "rotary_percent", 1.0),
        rope_scaling,
        normalization: Normalization::parse(normalization)?,
        norm_epsilon: float_or(
            args,
            "norm_epsilon",
            float_or(args, "layernorm_epsilon", 1e-5),
        ),
        apply_layernorm_1p: flag(args, "apply_layernorm_1p"),
        activation: Activation::from_flags(
            swiglu,
            flag(args, "squared_relu"),
            flag(args, "openai_gelu"),
            args.get("bias_gelu_fusion")
                .and_then(Value::as_bool)
                .unwrap_or(true),
            add_bias_linear,
        ),
        add_bias_linear,
        add_qkv_bias: add_bias_linear || flag(args, "add_qkv_bias"),
        untie_embeddings_and_output_weights: flag(args, "untie_embeddings_and_output_weights"),
        apply_residual_connection_post_layernorm: flag(
            args,
            "apply_residual_connection_post_layernorm",
        ),
        hidden_dropout: float_or(args, "hidden_dropout", 0.1),
        attention_dropout: float_or(args, "attention_dropout", 0.1),
        init_method_std: float_or(args, "init_method_std", 0.02),
        qk_layernorm: flag(args, "qk_layernorm"),
        moe: moe_config(args, num_layers, ffn_hidden_size)?,
    })
}

/// `torch.bfloat16` → `bfloat16`.
pub fn params_dtype(args: &Value) -> String {
    match args.get("params_dtype") {
        Some(Value::Global { name, .. }) => name.clone(),
        _ if flag(args, "bf16") => "bfloat16".into(),
        _ if flag(args, "fp16") => "float16".into(),
        _ => "float32".into(),
    }
}

/// The number of entries of a GPT-2 vocabulary JSON (`--vocab-file`).
pub fn vocab_file_size(path: &std::path::Path) -> Result<i64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let vocab: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a GPT-2 vocabulary JSON", path.display()))?;
    Ok(vocab.len() as i64)
}
