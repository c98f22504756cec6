//! GPT's HuggingFace `config.json` (`GPT2LMHeadModel` and the Llama family: `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`) ↔ the trunk's architecture.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value as Json};

use crate::config::{
    Activation, Normalization, PositionEmbeddingType, RopeScaling, TransformerConfig,
};

fn int(config: &Json, key: &str) -> Result<i64> {
    config[key]
        .as_i64()
        .with_context(|| format!("config.json has no integer {key}"))
}

/// A count or size of `config.json` that must be positive (layers, widths, the vocabulary).
fn positive(config: &Json, key: &str) -> Result<i64> {
    let value = int(config, key)?;
    ensure!(value > 0, "config.json: {key} {value} must be positive");
    Ok(value)
}

/// `hidden / heads`, or an error naming both fields.
fn head_width(hidden: (&str, i64), heads: (&str, i64)) -> Result<i64> {
    TransformerConfig::derived_head_width(hidden.1, heads.1).with_context(|| {
        format!(
            "config.json: {} {} must be positive and divide {} {}",
            heads.0, heads.1, hidden.0, hidden.1
        )
    })
}

/// The RoPE scaling of a Llama-family `config.json`: transformers ≥ 5 writes
/// `rope_parameters`, older versions `rope_scaling` (with `type` before 4.45).
fn rope_scaling_from_hf(hf: &Json) -> Result<Option<RopeScaling>> {
    let parameters = [&hf["rope_parameters"], &hf["rope_scaling"]]
        .into_iter()
        .find(|p| p.is_object());
    let Some(parameters) = parameters else {
        return Ok(None);
    };
    let kind = parameters["rope_type"]
        .as_str()
        .or(parameters["type"].as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let number = |key: &str| {
                parameters[key].as_f64().with_context(|| {
                    format!("config.json: llama3 rope scaling has no number {key}")
                })
            };
            let scaling = RopeScaling {
                factor: number("factor")?,
                low_freq_factor: number("low_freq_factor")?,
                high_freq_factor: number("high_freq_factor")?,
                original_max_position_embeddings: number("original_max_position_embeddings")?
                    as i64,
            };
            scaling
                .validate()
                .context("config.json: llama3 rope scaling")?;
            Ok(Some(scaling))
        }
        other => {
            bail!("config.json: rope scaling {other} is not supported (supported: default, llama3)")
        }
    }
}

/// `config.json`'s RoPE entries: `rope_parameters` for transformers ≥ 5, `rope_theta` and
/// `rope_scaling` for older readers (vLLM, transformers 4).
pub fn rope_to_hf(config: &TransformerConfig, hf: &mut Json) {
    let mut parameters = json!({"rope_theta": config.rotary_base, "rope_type": "default"});
    hf["rope_theta"] = json!(config.rotary_base);
    if let Some(scaling) = &config.rope_scaling {
        let scaling = json!({
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        });
        for (key, value) in scaling.as_object().expect("a JSON object") {
            parameters[key] = value.clone();
        }
        hf["rope_scaling"] = scaling;
    }
    hf["rope_parameters"] = parameters;
}

/// The architecture of a HuggingFace `config.json`, the vocabulary padded as Megatron pads it.
pub fn config_from_hf(
    hf: &Json,
    make_vocab_size_divisible_by: i64,
) -> Result<(String, TransformerConfig)> {
    let architecture = hf["architectures"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let tie = hf["tie_word_embeddings"].as_bool();
    let config = match architecture.as_str() {
        "GPT2LMHeadModel" => {
            let hidden = positive(hf, "n_embd")?;
            let heads = int(hf, "n_head")?;
            let kv_channels = head_width(("n_embd", hidden), ("n_head", heads))?;
            let activation = match hf["activation_function"].as_str().unwrap_or("gelu_new") {
                "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Activation::GeluTanh,
                "gelu" => Activation::GeluErf,
                other => bail!("config.json: activation_function {other} is not supported"),
            };
            ensure!(tie != Some(false), "config.json: untied GPT-2 output layers are not supported");
            TransformerConfig {
                num_layers: positive(hf, "n_layer")? as usize,
                hidden_size: hidden,
                num_attention_heads: heads,
                num_query_groups: heads,
                kv_channels,
                ffn_hidden_size: hf["n_inner"].as_i64().unwrap_or(4 * hidden),
                max_position_embeddings: int(hf, "n_positions")?,
                vocab_size: positive(hf, "vocab_size")?,
                make_vocab_size_divisible_by,
                position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
                rotary_base: 10000.0,
                rotary_percent: 1.0,
                rope_scaling: None,
                normalization: Normalization::LayerNorm,
                norm_epsilon: hf["layer_norm_epsilon"].as_f64().unwrap_or(1e-5),
                apply_layernorm_1p: false,
                activation,
                add_bias_linear: true,
                add_qkv_bias: true,
                untie_embeddings_and_output_weights: false,
                apply_residual_connection_post_layernorm: false,
                hidden_dropout: 0.0,
                attention_dropout: 0.0,
                init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02),
            }
        }
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" => {
            let hidden = positive(hf, "hidden_size")?;
            let heads = positive(hf, "num_attention_heads")?;
            let groups = hf["num_key_value_heads"].as_i64().unwrap_or(heads);
            ensure!(
                groups > 0 && heads % groups == 0,
                "config.json: num_key_value_heads {groups} must be positive and divide num_attention_heads {heads}"
            );
            let kv_channels = match hf["head_dim"].as_i64() {
                Some(width) if width > 0 => width,
                Some(width) => bail!("config.json: head_dim {width} must be positive"),
                None => head_width(("hidden_size", hidden), ("num_attention_heads", heads))?,
            };
            let rope_scaling = rope_scaling_from_hf(hf)?;
            ensure!(
                hf["hidden_act"].as_str().unwrap_or("silu") == "silu",
                "config.json: hidden_act {} is not supported (SwiGLU needs silu)",
                hf["hidden_act"]
            );
            let qkv_bias = architecture == "Qwen2ForCausalLM" || hf["attention_bias"].as_bool() == Some(true);
            ensure!(
                hf["mlp_bias"].as_bool() != Some(true),
                "config.json: mlp_bias is not supported"
            );
            TransformerConfig {
                num_layers: positive(hf, "num_hidden_layers")? as usize,
                hidden_size: hidden,
                num_attention_heads: heads,
                num_query_groups: groups,
                kv_channels,
                ffn_hidden_size: positive(hf, "intermediate_size")?,
                max_position_embeddings: int(hf, "max_position_embeddings")?,
                vocab_size: positive(hf, "vocab_size")?,
                make_vocab_size_divisible_by,
                position_embedding_type: PositionEmbeddingType::Rope,
                rotary_base: hf["rope_parameters"]["rope_theta"]
                    .as_f64()
                    .or(hf["rope_theta"].as_f64())
                    .unwrap_or(10000.0),
                rotary_percent: 1.0,
                rope_scaling,
                normalization: Normalization::RMSNorm,
                norm_epsilon: hf["rms_norm_eps"].as_f64().unwrap_or(1e-6),
                apply_layernorm_1p: false,
                activation: Activation::Swiglu,
                add_bias_linear: false,
                add_qkv_bias: qkv_bias,
                untie_embeddings_and_output_weights: tie != Some(true),
                apply_residual_connection_post_layernorm: false,
                hidden_dropout: 0.0,
                attention_dropout: 0.0,
                init_method_std: hf["initializer_range"].as_f64().unwrap_or(0.02),
            }
        }
        "" => bail!("config.json names no architecture"),
        other => bail!(
            "config.json: unknown architecture {other} (supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)"
        ),
    };
    Ok((architecture, config))
}
