//! GPT's tensors under Megatron's names over the years (spec §5.3) → the Megatron-core names we
//! use: what `checkpoint_convert` reads Megatron's GPT checkpoints through.

/// The core name of a Megatron model tensor (legacy nested or core flat, local or Transformer
/// Engine spec); `None` for entries that are not weights (`_extra_state`).
pub fn core_name(name: &str) -> Option<String> {
    if name.ends_with("_extra_state") {
        return None;
    }
    if name == "word_embeddings_for_head.weight" {
        return Some("output_layer.weight".into());
    }
    let name = name.strip_prefix("language_model.").unwrap_or(name);
    let (stack, rest) = match name.split_once('.') {
        Some(("encoder" | "transformer" | "decoder", rest)) => ("decoder", rest),
        _ => return Some(name.to_string()),
    };
    if let Some(norm) = rest
        .strip_prefix("final_norm.")
        .or_else(|| rest.strip_prefix("final_layernorm."))
    {
        return Some(format!("{stack}.final_layernorm.{norm}"));
    }
    let Some(layer) = rest.strip_prefix("layers.") else {
        return Some(format!("{stack}.{rest}"));
    };
    let (index, leaf) = layer.split_once('.')?;
    let leaf = match leaf {
        "self_attention.linear_qkv.layer_norm_weight" => "input_layernorm.weight".to_string(),
        "self_attention.linear_qkv.layer_norm_bias" => "input_layernorm.bias".to_string(),
        "mlp.linear_fc1.layer_norm_weight" => "pre_mlp_layernorm.weight".to_string(),
        "mlp.linear_fc1.layer_norm_bias" => "pre_mlp_layernorm.bias".to_string(),
        other => {
            let (module, parameter) = other.rsplit_once('.')?;
            if let Some(expert) = grouped_expert(module, parameter) {
                return Some(format!("{stack}.layers.{index}.{expert}"));
            }
            let module = match module {
                "input_norm" | "input_layernorm" => "input_layernorm",
                "post_attention_norm" | "post_attention_layernorm" | "pre_mlp_layernorm" => {
                    "pre_mlp_layernorm"
                }
                "self_attention.query_key_value" | "attention.query_key_value" => {
                    "self_attention.linear_qkv"
                }
                "self_attention.dense" | "attention.dense" => "self_attention.linear_proj",
                "mlp.dense_h_to_4h" => "mlp.linear_fc1",
                "mlp.dense_4h_to_h" => "mlp.linear_fc2",
                other => other,
            };
            format!("{module}.{parameter}")
        }
    };
    Some(format!("{stack}.layers.{index}.{leaf}"))
}

/// Transformer Engine's grouped experts (`mlp.experts.linear_fc1.weight3`, one parameter per
/// local expert in one module) under `SequentialMLP`'s names
/// (`mlp.experts.local_experts.3.linear_fc1.weight`).
fn grouped_expert(module: &str, parameter: &str) -> Option<String> {
    let linear = module.strip_prefix("mlp.experts.")?;
    if !matches!(linear, "linear_fc1" | "linear_fc2") {
        return None;
    }
    let (kind, expert) = match parameter.strip_prefix("weight") {
        Some(expert) => ("weight", expert),
        None => ("bias", parameter.strip_prefix("bias")?),
    };
    let expert: usize = expert.parse().ok()?;
    Some(format!(
        "mlp.experts.local_experts.{expert}.{linear}.{kind}"
    ))
}

/// Where a routed expert's tensor sits: `decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight`
/// → `(3, "decoder.layers.1.mlp.experts.local_experts.", "linear_fc1.weight")`.
pub fn expert_of(name: &str) -> Option<(usize, &str, &str)> {
    const EXPERTS: &str = ".mlp.experts.local_experts.";
    let at = name.find(EXPERTS)? + EXPERTS.len();
    let (index, leaf) = name[at..].split_once('.')?;
    Some((index.parse().ok()?, &name[..at], leaf))
}

/// `name` with its routed expert's number moved by `offset` (an expert-parallel rank's local
/// experts → the model's); other names as they are.
pub fn expert_moved(name: &str, offset: usize) -> String {
    match expert_of(name) {
        Some((expert, prefix, leaf)) => format!("{prefix}{}.{leaf}", expert + offset),
        None => name.to_string(),
    }
}

/// `decoder.layers.3.mlp...` → `(3, "mlp...")`.
pub fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("decoder.layers.")?;
    let (index, leaf) = rest.split_once('.')?;
    Some((index.parse().ok()?, leaf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_and_te_names_become_core_names() {
        for (old, new) in [
            (
                "language_model.embedding.word_embeddings.weight",
                "embedding.word_embeddings.weight",
            ),
            (
                "language_model.encoder.layers.1.input_norm.weight",
                "decoder.layers.1.input_layernorm.weight",
            ),
            (
                "language_model.transformer.layers.0.attention.query_key_value.bias",
                "decoder.layers.0.self_attention.linear_qkv.bias",
            ),
            (
                "language_model.encoder.layers.0.self_attention.dense.weight",
                "decoder.layers.0.self_attention.linear_proj.weight",
            ),
            (
                "language_model.encoder.layers.0.post_attention_layernorm.bias",
                "decoder.layers.0.pre_mlp_layernorm.bias",
            ),
            (
                "language_model.encoder.layers.2.mlp.dense_h_to_4h.weight",
                "decoder.layers.2.mlp.linear_fc1.weight",
            ),
            (
                "language_model.encoder.layers.2.mlp.dense_4h_to_h.bias",
                "decoder.layers.2.mlp.linear_fc2.bias",
            ),
            (
                "language_model.encoder.final_norm.weight",
                "decoder.final_layernorm.weight",
            ),
            ("language_model.output_layer.weight", "output_layer.weight"),
            ("word_embeddings_for_head.weight", "output_layer.weight"),
            (
                "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                "decoder.layers.0.input_layernorm.weight",
            ),
            (
                "decoder.layers.0.mlp.linear_fc1.layer_norm_bias",
                "decoder.layers.0.pre_mlp_layernorm.bias",
            ),
            (
                "decoder.layers.0.mlp.linear_fc2.weight",
                "decoder.layers.0.mlp.linear_fc2.weight",
            ),
            (
                "decoder.layers.1.mlp.experts.linear_fc1.weight3",
                "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
            ),
            (
                "decoder.layers.0.mlp.experts.linear_fc2.weight12",
                "decoder.layers.0.mlp.experts.local_experts.12.linear_fc2.weight",
            ),
            (
                "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
                "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
            ),
        ] {
            assert_eq!(core_name(old).as_deref(), Some(new), "{old}");
        }
        assert_eq!(
            core_name("decoder.layers.0.mlp.linear_fc1._extra_state"),
            None
        );
    }

    #[test]
    fn local_experts_move_to_the_models_numbers() {
        assert_eq!(
            expert_moved(
                "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight",
                2
            ),
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
        );
        assert_eq!(
            expert_moved("decoder.layers.1.mlp.router.weight", 2),
            "decoder.layers.1.mlp.router.weight"
        );
        assert_eq!(
            expert_of("decoder.layers.0.mlp.shared_experts.linear_fc1.weight"),
            None
        );
    }
}
