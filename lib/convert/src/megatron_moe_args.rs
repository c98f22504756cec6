//! The Mixture-of-Experts part of Megatron's `args` namespace (`num_experts`, `moe_*`) → our
//! [`MoeConfig`], refusing what the model here does not compute.

use anyhow::{bail, Context, Result};
use megatron_checkpoint::Value;
use megatron_models::layers::moe::config::{
    parse_layer_freq, LoadBalancing, MoeConfig, RouterDtype, ScoreFunction, TokenDispatcher,
};

/// The MoE architecture of the args (`None` for a dense model) for `num_layers` layers whose
/// dense MLP is `ffn_hidden_size` wide.
pub fn moe_config(
    args: &Value,
    num_layers: usize,
    ffn_hidden_size: i64,
) -> Result<Option<MoeConfig>> {
    let Some(num_experts) = args.get("num_experts").and_then(Value::as_i64) else {
        return Ok(None);
    };
    let text = |key: &str| args.get(key).and_then(Value::as_str);
    let set = |key: &str| !matches!(args.get(key), None | Some(Value::None | Value::Bool(false)));
    for refused in [
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_input_jitter_eps",
        "moe_use_legacy_grouped_gemm",
    ] {
        if set(refused) {
            bail!(
                "the checkpoint's args: {refused} is set; Mixture-of-Experts models with it are not supported"
            );
        }
    }
    let layer_pattern = match args.get("moe_layer_freq") {
        None | Some(Value::None) => Ok(vec![true; num_layers]),
        Some(Value::Int(every)) => parse_layer_freq(&every.to_string(), num_layers),
        Some(Value::List(entries)) => {
            let ones: Vec<i64> = entries.iter().filter_map(Value::as_i64).collect();
            parse_layer_freq(&format!("{ones:?}"), num_layers)
        }
        Some(Value::Str(expression)) => parse_layer_freq(expression, num_layers),
        Some(other) => Err(anyhow::anyhow!(
            "{} is neither an integer nor a list",
            other.describe()
        )),
    }
    .context("the checkpoint's args: moe_layer_freq")?;
    // Megatron keeps one load-balancing type and coefficient, or a list of them to combine.
    let load_balancing = match args.get("moe_router_load_balancing_type") {
        None | Some(Value::None) => "aux_loss",
        Some(Value::Str(kind)) => kind.as_str(),
        Some(Value::List(kinds)) if kinds.len() == 1 => kinds[0].as_str().unwrap_or(""),
        Some(other) => bail!(
            "the checkpoint's args: moe_router_load_balancing_type {}: one type is supported",
            other.describe()
        ),
    };
    let load_balancing = match load_balancing {
        "aux_loss" => LoadBalancing::AuxLoss,
        "seq_aux_loss" => LoadBalancing::SeqAuxLoss,
        "none" => LoadBalancing::None,
        other => bail!(
            "the checkpoint's args: moe_router_load_balancing_type {other} is not supported (aux_loss, seq_aux_loss, none are)"
        ),
    };
    let aux_loss_coeff = match args.get("moe_aux_loss_coeff") {
        None | Some(Value::None) => 0.0,
        Some(Value::List(values)) if values.len() == 1 => values[0].as_f64().unwrap_or(0.0),
        Some(value) => value.as_f64().with_context(|| {
            format!(
                "the checkpoint's args: moe_aux_loss_coeff {}: one number expected",
                value.describe()
            )
        })?,
    };
    let config = MoeConfig {
        num_experts,
        ffn_hidden_size: args
            .get("moe_ffn_hidden_size")
            .and_then(Value::as_i64)
            .unwrap_or(ffn_hidden_size),
        layer_pattern,
        topk: args
            .get("moe_router_topk")
            .and_then(Value::as_i64)
            .unwrap_or(2),
        score_function: match text("moe_router_score_function").unwrap_or("softmax") {
            "softmax" => ScoreFunction::Softmax,
            "sigmoid" => ScoreFunction::Sigmoid,
            other => {
                bail!("the checkpoint's args: moe_router_score_function {other} is not supported")
            }
        },
        pre_softmax: args
            .get("moe_router_pre_softmax")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        topk_scaling_factor: args
            .get("moe_router_topk_scaling_factor")
            .and_then(Value::as_f64),
        router_dtype: match text("moe_router_dtype") {
            None => None,
            Some("fp32") => Some(RouterDtype::Fp32),
            Some("fp64") => Some(RouterDtype::Fp64),
            Some(other) => {
                bail!("the checkpoint's args: moe_router_dtype {other} is not supported")
            }
        },
        load_balancing,
        aux_loss_coeff,
        z_loss_coeff: args.get("moe_z_loss_coeff").and_then(Value::as_f64),
        shared_expert_intermediate_size: args
            .get("moe_shared_expert_intermediate_size")
            .and_then(Value::as_i64),
        shared_expert_gate: args
            .get("moe_shared_expert_gate")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        token_dispatcher: TokenDispatcher::default(),
        grouped_gemm: false,
        capacity: None,
        expert_bias_update_rate: set("moe_router_enable_expert_bias").then(|| {
            args.get("moe_router_bias_update_rate")
                .and_then(Value::as_f64)
                .unwrap_or(1e-3)
        }),
    };
    config
        .validate(num_layers)
        .context("the checkpoint's args")?;
    Ok(Some(config))
}
