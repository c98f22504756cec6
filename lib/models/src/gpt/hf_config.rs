//! GPT's HuggingFace `config.json` (`GPT2LMHeadModel` and the Llama family: `LlamaForCausalLM`,
//! `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, and the Mixtures of Experts
//! `MixtralForCausalLM`, `Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`) ↔ the trunk's
//! architecture.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value as Json};

use crate::config::{Activation, Normalization, PositionEmbeddingType, TransformerConfig};
use crate::layers::moe::config::{LoadBalancing, MoeConfig, ScoreFunction, TokenDispatcher};
use crate::rope_scaling::{Llama3Scaling, RopeScaling, YarnScaling};

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
/// `rope_parameters`, older versions `rope_scaling` (with `type` before 4.45). Parameters we
/// cannot represent are refused by name rather than dropped.
fn rope_scaling_from_hf(hf: &Json) -> Result<Option<RopeScaling>> {
    let found = [
        ("rope_parameters", &hf["rope_parameters"]),
        ("rope_scaling", &hf["rope_scaling"]),
    ]
    .into_iter()
    .find(|(_, p)| p.is_object());
    let Some((field, parameters)) = found else {
        return Ok(None);
    };
    let kind = parameters["rope_type"]
        .as_str()
        .or(parameters["type"].as_str())
        .unwrap_or("default");
    let known: &[&str] = match kind {
        "default" => &[],
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
            "attention_factor",
        ],
        other => bail!(
            "config.json: {field}.rope_type {other} is not supported (supported: default, linear, llama3, yarn)"
        ),
    };
    let entries = parameters.as_object().expect("checked to be an object");
    for (key, value) in entries {
        let common = ["rope_type", "type", "rope_theta"].contains(&key.as_str());
        let full_rotation = key == "partial_rotary_factor" && value.as_f64() == Some(1.0);
        ensure!(
            common || full_rotation || value.is_null() || known.contains(&key.as_str()),
            "config.json: {field}.{key} ({value}) is not supported with rope_type {kind}"
        );
    }
    let optional = |key: &str| -> Result<Option<f64>> {
        match &parameters[key] {
            Json::Null => Ok(None),
            value => value
                .as_f64()
                .map(Some)
                .with_context(|| format!("config.json: {field}.{key} {value} is not a number")),
        }
    };
    let number = |key: &str| -> Result<f64> {
        optional(key)?.with_context(|| format!("config.json: {kind} {field} has no number {key}"))
    };
    let scaling = match kind {
        "default" => return Ok(None),
        "linear" => RopeScaling::Linear {
            factor: number("factor")?,
        },
        "llama3" => RopeScaling::Llama3(Llama3Scaling {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_max_position_embeddings: number("original_max_position_embeddings")? as i64,
        }),
        _ => yarn_from_hf(hf, field, parameters, &optional)?,
    };
    scaling
        .validate()
        .with_context(|| format!("config.json: {field}"))?;
    Ok(Some(scaling))
}

/// YaRN's parameters with transformers' defaults: the original context is
/// `max_position_embeddings`, the factor (when absent) the ratio of the two, betas 32 and 1,
/// `truncate` true.
fn yarn_from_hf(
    hf: &Json,
    field: &str,
    parameters: &Json,
    optional: &dyn Fn(&str) -> Result<Option<f64>>,
) -> Result<RopeScaling> {
    let original = match optional("original_max_position_embeddings")? {
        Some(original) => original as i64,
        None => int(hf, "max_position_embeddings")?,
    };
    let factor = match optional("factor")? {
        Some(factor) => factor,
        None => int(hf, "max_position_embeddings")? as f64 / original as f64,
    };
    // transformers reads both betas with `or`: a zero means the default too.
    let beta = |key: &str, default: f64| -> Result<f64> {
        Ok(optional(key)?.filter(|b| *b != 0.0).unwrap_or(default))
    };
    // The factor transformers applies: the explicit one, else its rule on the mscales. We keep
    // the mscales as given (Megatron's defaults where absent) when Megatron's rule on them
    // gives that factor, else Megatron's defaults, which give transformers' default.
    let (mscale, mscale_all_dim) = (optional("mscale")?, optional("mscale_all_dim")?);
    let applied = match optional("attention_factor")? {
        Some(given) => given,
        None => YarnScaling::hf_attention_factor(factor, mscale, mscale_all_dim),
    };
    let defaults = YarnScaling::megatron(factor);
    let candidates = [
        (
            mscale.unwrap_or(defaults.mscale),
            mscale_all_dim.unwrap_or(defaults.mscale_all_dim),
        ),
        (defaults.mscale, defaults.mscale_all_dim),
    ];
    let Some((mscale, mscale_all_dim)) =
        candidates.into_iter().find(|&(mscale, mscale_all_dim)| {
            let megatron = YarnScaling {
                mscale,
                mscale_all_dim,
                ..defaults
            };
            (megatron.attention_factor() - applied).abs() <= 1e-9 * applied.abs()
        })
    else {
        bail!(
            "config.json: {field}.attention_factor {applied} is not supported: Megatron derives it from factor, mscale and mscale_all_dim"
        );
    };
    let truncate = match &parameters["truncate"] {
        Json::Null => true,
        value => value
            .as_bool()
            .with_context(|| format!("config.json: {field}.truncate {value} is not a boolean"))?,
    };
    let yarn = YarnScaling {
        factor,
        original_max_position_embeddings: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        mscale,
        mscale_all_dim,
        correction_range_round_to_int: truncate,
    };
    Ok(RopeScaling::Yarn(yarn))
}

/// HF's parameters of a scaling (without `rope_theta`), in transformers' names.
fn rope_scaling_to_hf(scaling: &RopeScaling) -> Json {
    match scaling {
        RopeScaling::Llama3(s) => json!({
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }),
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Yarn(s) => {
            let mut hf = json!({
                "rope_type": "yarn",
                "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            });
            // The betas' defaults are the same in transformers and Megatron.
            let defaults = YarnScaling::megatron(s.factor);
            if s.beta_fast != defaults.beta_fast {
                hf["beta_fast"] = json!(s.beta_fast);
            }
            if s.beta_slow != defaults.beta_slow {
                hf["beta_slow"] = json!(s.beta_slow);
            }
            if !s.correction_range_round_to_int {
                hf["truncate"] = json!(false);
            }
            if (s.mscale, s.mscale_all_dim) != (1.0, 0.0) {
                hf["mscale"] = json!(s.mscale);
                hf["mscale_all_dim"] = json!(s.mscale_all_dim);
                // Where transformers' rule on these two differs from Megatron's, say the result.
                let hf_factor = YarnScaling::hf_attention_factor(
                    s.factor,
                    Some(s.mscale),
                    Some(s.mscale_all_dim),
                );
                if hf_factor != s.attention_factor() {
                    hf["attention_factor"] = json!(s.attention_factor());
                }
            }
            hf
        }
    }
}

/// `config.json`'s RoPE entries: `rope_parameters` for transformers ≥ 5, `rope_theta` and
/// `rope_scaling` for older readers (vLLM, transformers 4).
pub fn rope_to_hf(config: &TransformerConfig, hf: &mut Json) {
    let mut parameters = json!({"rope_theta": config.rotary_base, "rope_type": "default"});
    hf["rope_theta"] = json!(config.rotary_base);
    if let Some(scaling) = &config.rope_scaling {
        let scaling = rope_scaling_to_hf(scaling);
        for (key, value) in scaling.as_object().expect("a JSON object") {
            parameters[key] = value.clone();
        }
        hf["rope_scaling"] = scaling;
    }
    hf["rope_parameters"] = parameters;
}

/// The HuggingFace architecture of a Llama-style model (RoPE, RMSNorm, SwiGLU), told apart by
/// its structure, so that import and export name its tensors alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlamaFamily {
    Llama,
    /// QKV biases.
    Qwen2,
    /// Per-head query and key norms (`--qk-layernorm`).
    Qwen3,
    /// Every layer sparse, softmax over the chosen experts, nothing else.
    Mixtral,
    /// A gated shared expert, QKV biases, dense layers where `mlp_only_layers` says.
    Qwen2Moe,
    /// Per-head query and key norms, no shared expert.
    Qwen3Moe,
}

impl LlamaFamily {
    /// The family of a Llama-style `config`; an MoE model no HuggingFace family describes is
    /// refused, naming what is in the way.
    pub fn of(config: &TransformerConfig) -> Result<Self> {
        let Some(moe) = &config.moe else {
            return Ok(match (config.qk_layernorm, config.add_qkv_bias) {
                (true, _) => LlamaFamily::Qwen3,
                (false, true) => LlamaFamily::Qwen2,
                (false, false) => LlamaFamily::Llama,
            });
        };
        ensure!(
            moe.score_function == ScoreFunction::Softmax && moe.topk_scaling_factor.is_none(),
            "only softmax routers without --moe-router-topk-scaling-factor export to HuggingFace"
        );
        let shared = moe.shared_expert_intermediate_size.is_some();
        if config.qk_layernorm {
            ensure!(
                !shared,
                "a Mixture of Experts with --qk-layernorm exports as Qwen3-MoE, which has no shared expert"
            );
            return Ok(LlamaFamily::Qwen3Moe);
        }
        let mixtral = moe.layer_pattern.iter().all(|&sparse| sparse)
            && !moe.pre_softmax
            && !shared
            && !config.add_qkv_bias;
        if mixtral {
            return Ok(LlamaFamily::Mixtral);
        }
        ensure!(
            shared && moe.shared_expert_gate,
            "a Mixture of Experts that is not Mixtral-shaped (every layer sparse, softmax over the \
             top k, no shared expert, no QKV bias) exports as Qwen2-MoE, which needs a shared \
             expert with --moe-shared-expert-gate"
        );
        Ok(LlamaFamily::Qwen2Moe)
    }

    /// The architecture `config.json` names.
    pub fn architecture(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "LlamaForCausalLM",
            LlamaFamily::Qwen2 => "Qwen2ForCausalLM",
            LlamaFamily::Qwen3 => "Qwen3ForCausalLM",
            LlamaFamily::Mixtral => "MixtralForCausalLM",
            LlamaFamily::Qwen2Moe => "Qwen2MoeForCausalLM",
            LlamaFamily::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            LlamaFamily::Llama => "llama",
            LlamaFamily::Qwen2 => "qwen2",
            LlamaFamily::Qwen3 => "qwen3",
            LlamaFamily::Mixtral => "mixtral",
            LlamaFamily::Qwen2Moe => "qwen2_moe",
            LlamaFamily::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The router's weight, under the layer's `model.layers.<i>.`.
    pub fn router(self) -> &'static str {
        match self {
            LlamaFamily::Mixtral => "block_sparse_moe.gate.weight",
            _ => "mlp.gate.weight",
        }
    }

    /// Routed expert `e`'s gate, up and down projections, under the layer's name.
    pub fn expert(self, e: i64) -> [String; 3] {
        match self {
            LlamaFamily::Mixtral => {
                ["w1", "w3", "w2"].map(|w| format!("block_sparse_moe.experts.{e}.{w}.weight"))
            }
            _ => {
                ["gate_proj", "up_proj", "down_proj"].map(|p| format!("mlp.experts.{e}.{p}.weight"))
            }
        }
    }
}

/// Qwen2-MoE's shared expert: its gate, up and down projections, under the layer's name.
pub const SHARED_EXPERT: [&str; 3] = [
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
    "mlp.shared_expert.down_proj.weight",
];

/// Qwen2-MoE's sigmoid gate of the shared expert, `[1, hidden]`.
pub const SHARED_EXPERT_GATE: &str = "mlp.shared_expert_gate.weight";

/// The sparse MLPs of Mixtral, Qwen2-MoE and Qwen3-MoE. Mixtral's is in every layer,
/// `num_local_experts` experts of `intermediate_size`, the `num_experts_per_tok` best taken
/// with the softmax over all experts renormalised over them, which is the softmax over the
/// chosen logits (Megatron's default router). The Qwens' experts are of
/// `moe_intermediate_size`, renormalised over the k only with `norm_topk_prob` (else the
/// softmax over all experts, Megatron's `--moe-router-pre-softmax`), in the layers
/// `decoder_sparse_step` and `mlp_only_layers` leave sparse (`--moe-layer-freq`); Qwen2-MoE's
/// shared expert of `shared_expert_intermediate_size` is gated by a sigmoid.
fn hf_moe(hf: &Json, family: LlamaFamily, num_layers: usize) -> Result<Option<MoeConfig>> {
    ensure!(
        hf["router_jitter_noise"].as_f64().unwrap_or(0.0) == 0.0,
        "config.json: router_jitter_noise {} is not supported",
        hf["router_jitter_noise"]
    );
    let experts_key = match family {
        LlamaFamily::Mixtral => "num_local_experts",
        LlamaFamily::Qwen2Moe | LlamaFamily::Qwen3Moe if hf["num_experts"].is_i64() => {
            "num_experts"
        }
        LlamaFamily::Qwen2Moe | LlamaFamily::Qwen3Moe => "num_local_experts",
        _ => return Ok(None),
    };
    let qwen = family != LlamaFamily::Mixtral;
    let (ffn_hidden_size, layer_pattern, pre_softmax) = if qwen {
        let step = hf["decoder_sparse_step"].as_i64().unwrap_or(1);
        ensure!(
            step > 0,
            "config.json: decoder_sparse_step {step} must be positive"
        );
        let dense: Vec<i64> = match &hf["mlp_only_layers"] {
            Json::Null => Vec::new(),
            list => list
                .as_array()
                .and_then(|l| l.iter().map(Json::as_i64).collect())
                .with_context(|| {
                    format!("config.json: mlp_only_layers {list} is not a list of layer numbers")
                })?,
        };
        let pattern = (0..num_layers as i64)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect();
        let normalised = hf["norm_topk_prob"].as_bool().unwrap_or(false);
        (positive(hf, "moe_intermediate_size")?, pattern, !normalised)
    } else {
        (
            positive(hf, "intermediate_size")?,
            vec![true; num_layers],
            false,
        )
    };
    let shared_expert_intermediate_size = match family {
        LlamaFamily::Qwen2Moe => Some(positive(hf, "shared_expert_intermediate_size")?),
        _ => None,
    };
    let moe = MoeConfig {
        num_experts: positive(hf, experts_key)?,
        ffn_hidden_size,
        layer_pattern,
        topk: positive(hf, "num_experts_per_tok")?,
        score_function: ScoreFunction::Softmax,
        pre_softmax,
        topk_scaling_factor: None,
        router_dtype: None,
        load_balancing: LoadBalancing::AuxLoss,
        aux_loss_coeff: hf["router_aux_loss_coef"].as_f64().unwrap_or(0.0),
        z_loss_coeff: None,
        shared_expert_gate: shared_expert_intermediate_size.is_some(),
        shared_expert_intermediate_size,
        token_dispatcher: TokenDispatcher::default(),
        grouped_gemm: false,
        capacity: None,
        expert_bias_update_rate: None,
    };
    moe.validate(num_layers).context("config.json")?;
    Ok(Some(moe))
}

/// MoE entries of `config.json` for `family` (the dense layers' `intermediate_size` is set
/// already).
pub fn moe_to_hf(family: LlamaFamily, moe: &MoeConfig, hf: &mut Json) {
    hf["num_experts_per_tok"] = json!(moe.topk);
    hf["router_aux_loss_coef"] = json!(moe.aux_loss_coeff);
    if family == LlamaFamily::Mixtral {
        hf["intermediate_size"] = json!(moe.ffn_hidden_size);
        hf["num_local_experts"] = json!(moe.num_experts);
        hf["router_jitter_noise"] = json!(0.0);
        return;
    }
    let dense: Vec<usize> = (0..moe.layer_pattern.len())
        .filter(|&i| !moe.is_moe_layer(i))
        .collect();
    hf["num_experts"] = json!(moe.num_experts);
    hf["moe_intermediate_size"] = json!(moe.ffn_hidden_size);
    hf["norm_topk_prob"] = json!(!moe.pre_softmax);
    hf["decoder_sparse_step"] = json!(1);
    hf["mlp_only_layers"] = json!(dense);
    if let Some(size) = moe.shared_expert_intermediate_size {
        hf["shared_expert_intermediate_size"] = json!(size);
    }
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
                qk_layernorm: false,
                moe: None,
            }
        }
        "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM" | "Qwen3ForCausalLM"
        | "MixtralForCausalLM" | "Qwen2MoeForCausalLM" | "Qwen3MoeForCausalLM" => {
            let family = match architecture.as_str() {
                "Qwen2ForCausalLM" => LlamaFamily::Qwen2,
                "Qwen3ForCausalLM" => LlamaFamily::Qwen3,
                "MixtralForCausalLM" => LlamaFamily::Mixtral,
                "Qwen2MoeForCausalLM" => LlamaFamily::Qwen2Moe,
                "Qwen3MoeForCausalLM" => LlamaFamily::Qwen3Moe,
                _ => LlamaFamily::Llama,
            };
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
            // Qwen2 and Qwen2-MoE have QKV biases (transformers 5 writes Qwen2-MoE's
            // `qkv_bias`), the others where `attention_bias` says.
            let qkv_bias = match family {
                LlamaFamily::Qwen2 => true,
                LlamaFamily::Qwen2Moe => hf["qkv_bias"].as_bool().unwrap_or(true),
                _ => hf["attention_bias"].as_bool() == Some(true),
            };
            ensure!(
                hf["mlp_bias"].as_bool() != Some(true),
                "config.json: mlp_bias is not supported"
            );
            let num_layers = positive(hf, "num_hidden_layers")? as usize;
            let moe = hf_moe(hf, family, num_layers)?;
            TransformerConfig {
                num_layers,
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
                qk_layernorm: matches!(family, LlamaFamily::Qwen3 | LlamaFamily::Qwen3Moe),
                moe,
            }
        }
        "" => bail!("config.json names no architecture"),
        other => bail!(
            "config.json: unknown architecture {other} (supported: GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)"
        ),
    };
    Ok((architecture, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every scaling, Megatron's YaRN attention factors included where transformers' rule
    /// differs (`mscale` without `mscale_all_dim`), comes back from its own `config.json`.
    #[test]
    fn exported_rope_scalings_import_unchanged() {
        let yarn = YarnScaling {
            original_max_position_embeddings: 64,
            ..YarnScaling::megatron(4.0)
        };
        let scalings = [
            RopeScaling::Llama3(Llama3Scaling::megatron(8.0)),
            RopeScaling::Linear { factor: 2.5 },
            RopeScaling::Yarn(yarn),
            RopeScaling::Yarn(YarnScaling {
                mscale: 0.5,
                ..yarn
            }),
            RopeScaling::Yarn(YarnScaling {
                mscale: 0.0,
                mscale_all_dim: 0.7,
                ..yarn
            }),
            RopeScaling::Yarn(YarnScaling {
                mscale: 0.9,
                mscale_all_dim: 0.7,
                beta_fast: 8.0,
                beta_slow: 0.5,
                correction_range_round_to_int: false,
                ..yarn
            }),
        ];
        for scaling in scalings {
            let mut config = TransformerConfig::gpt_345m();
            config.rope_scaling = Some(scaling);
            config.rotary_base = 500000.0;
            let mut hf = json!({
                "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": 256,
            });
            rope_to_hf(&config, &mut hf);
            let (_, back) = config_from_hf(&hf, 128).unwrap();
            assert_eq!(back.rope_scaling, Some(scaling), "{hf}");
            assert_eq!(back.rotary_base, 500000.0);
        }
    }
}
