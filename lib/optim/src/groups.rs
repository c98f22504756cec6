//! Weight-decay parameter groups.

/// Megatron's rule (spec §4.3): no decay for biases and for every 1-D tensor (norm weights).
pub fn excluded_from_weight_decay(name: &str, shape: &[i64]) -> bool {
    name.ends_with(".bias") || shape.len() == 1
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
}
