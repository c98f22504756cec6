//! Weight-decay parameter groups.

/// Megatron's rule (spec §4.3): no decay for biases and for every 1-D tensor (norm weights).
pub fn excluded_from_weight_decay(name: &str, shape: &[i64]) -> bool {
    name.ends_with(".bias") || shape.len() == 1
}

/// Megatron's `is_embedding_or_output_parameter`: the input word embeddings and the output
/// layer (and the last stage's copy of tied embeddings), which `--decoupled-lr` gives a learning
/// rate of their own. Position embeddings are not among them.
pub fn is_embedding_or_output(name: &str) -> bool {
    ["embedding.word_embeddings.weight", "output_layer.weight"]
        .iter()
        .any(|suffix| name == *suffix || name.ends_with(&format!(".{suffix}")))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamGroup {
    Decayed,
    NotDecayed,
}

impl ParamGroup {
    pub fn of(name: &str, shape: &[i64]) -> Self {
        if excluded_from_weight_decay(name, shape) {
            ParamGroup::NotDecayed
        } else {
            ParamGroup::Decayed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn biases_and_vectors_are_not_decayed() {
        assert_eq!(
            ParamGroup::of("decoder.layers.0.mlp.linear_fc1.bias", &[16]),
            ParamGroup::NotDecayed
        );
        assert_eq!(
            ParamGroup::of("decoder.final_layernorm.weight", &[8]),
            ParamGroup::NotDecayed
        );
        assert_eq!(
            ParamGroup::of("decoder.layers.0.mlp.linear_fc1.weight", &[16, 8]),
            ParamGroup::Decayed
        );
        assert_eq!(
            ParamGroup::of("embedding.word_embeddings.weight", &[128, 8]),
            ParamGroup::Decayed
        );
    }

    #[test]
    fn word_embeddings_and_output_layer_take_the_decoupled_rate() {
        for name in [
            "embedding.word_embeddings.weight",
            "model1.output_layer.weight",
            "output_layer.weight",
            "lm_head.output_layer.weight",
        ] {
            assert!(is_embedding_or_output(name), "{name}");
        }
        for name in [
            "embedding.position_embeddings.weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "output_layer.bias",
            "xoutput_layer.weight",
        ] {
            assert!(!is_embedding_or_output(name), "{name}");
        }
    }
}
