//! How RoPE is stretched for contexts longer than the one a model was trained on: Llama 3.x's
//! frequency bands (Megatron's `--use-rope-scaling`), linear position interpolation
//! (`--rotary-seq-len-interpolation-factor`) and YaRN (`--position-embedding-type yarn` /
//! `--rope-type yarn` with `--rotary-scaling-factor`, `--yarn-*`, `--mscale*`). The parameters
//! only; [`crate::layers::RotaryEmbedding`] turns them into frequencies.

use anyhow::{bail, ensure, Result};
use megatron_cli::ranges;
use serde::{Deserialize, Deserializer, Serialize};

/// One RoPE scaling, tagged by HuggingFace's `rope_type` name in our checkpoint metadata.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    Llama3(Llama3Scaling),
    /// Positions divided by `factor` (Megatron's `--rotary-seq-len-interpolation-factor`,
    /// HF's `rope_type: "linear"`): every frequency divided by it.
    Linear {
        factor: f64,
    },
    Yarn(YarnScaling),
}

/// Llama-3.x frequency scaling: wavelengths longer than `original_max_position_embeddings /
/// low_freq_factor` are stretched by `factor`, shorter than `… / high_freq_factor` kept, and
/// the band between interpolated smoothly.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: i64,
}

/// YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
/// divided by `factor`, those turning more than `beta_fast` times kept, a linear ramp over the
/// channels between; cos and sin are multiplied by [`YarnScaling::attention_factor`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct YarnScaling {
    pub factor: f64,
    pub original_max_position_embeddings: i64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// Whether the ramp's ends are rounded outwards to whole channels (HF's `truncate`).
    pub correction_range_round_to_int: bool,
}

impl Llama3Scaling {
    /// Megatron's `--rope-scaling-factor`: the other parameters are fixed at Llama 3.1's.
    pub fn megatron(factor: f64) -> Self {
        Llama3Scaling {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }
    }

    /// Whether Megatron's flags can express it (only the factor is a flag there).
    pub fn is_megatron_expressible(&self) -> bool {
        *self == Self::megatron(self.factor)
    }
}

impl YarnScaling {
    /// Megatron's defaults for the parameters its flags leave unset (`YarnRotaryEmbedding`).
    pub fn megatron(factor: f64) -> Self {
        YarnScaling {
            factor,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
            correction_range_round_to_int: true,
        }
    }

    /// The factor on cos and sin (so `attention_factor²` on the attention logits), as
    /// Megatron computes it: `m(factor, mscale) / m(factor, mscale_all_dim)` with
    /// `m(s, k) = 0.1·k·ln s + 1` for `s > 1`, else 1. transformers agrees where both
    /// `mscale` and `mscale_all_dim` are non-zero or both are at Megatron's defaults (1, 0);
    /// [`YarnScaling::hf_attention_factor`] is its rule.
    pub fn attention_factor(&self) -> f64 {
        yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
    }

    /// transformers' rule: the ratio only when both `mscale` and `mscale_all_dim` are given
    /// and non-zero, else `m(factor, 1)`.
    pub fn hf_attention_factor(
        factor: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    ) -> f64 {
        match (mscale, mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                yarn_mscale(factor, m) / yarn_mscale(factor, all)
            }
            _ => yarn_mscale(factor, 1.0),
        }
    }
}

fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The context-stretching factor, whatever the type.
    pub fn factor(&self) -> f64 {
        match self {
            RopeScaling::Llama3(s) => s.factor,
            RopeScaling::Linear { factor } => *factor,
            RopeScaling::Yarn(s) => s.factor,
        }
    }

    /// Megatron's flag that selects this scaling, for messages.
    pub fn flag(&self) -> &'static str {
        match self {
            RopeScaling::Llama3(_) => "--use-rope-scaling",
            RopeScaling::Linear { .. } => "--rotary-seq-len-interpolation-factor",
            RopeScaling::Yarn(_) => "--position-embedding-type yarn",
        }
    }

    pub fn validate(&self) -> Result<()> {
        match self {
            RopeScaling::Llama3(s) => ensure!(
                s.factor > 0.0
                    && s.low_freq_factor > 0.0
                    && s.high_freq_factor > s.low_freq_factor
                    && s.original_max_position_embeddings > 0,
                "llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings > 0 (got {s:?})"
            ),
            RopeScaling::Linear { factor } => ensure!(
                *factor > 0.0,
                "--rotary-seq-len-interpolation-factor must be positive (got {factor})"
            ),
            RopeScaling::Yarn(s) => ensure!(
                s.factor > 0.0
                    && s.original_max_position_embeddings > 0
                    && s.beta_fast > 0.0
                    && s.beta_slow > 0.0,
                "yarn rope scaling needs positive --rotary-scaling-factor, --yarn-original-max-position-embeddings, --yarn-beta-fast and --yarn-beta-slow (got {s:?})"
            ),
        }
        Ok(())
    }
}

/// Megatron's RoPE scaling flags (names and defaults of `megatron/training/arguments.py`; the
/// YaRN ones as Megatron's GPT models take them since `--position-embedding-type yarn`).
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct RopeScalingArgs {
    /// Llama-3.x RoPE frequency scaling (low/high frequency factors 1 and 4, original context
    /// 8192, as in Megatron).
    #[arg(long)]
    pub use_rope_scaling: bool,
    /// The factor of --use-rope-scaling.
    #[arg(long, default_value_t = 8.0, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub rope_scaling_factor: f64,
    /// Linear RoPE interpolation: positions are divided by this factor (HF's rope_type
    /// "linear").
    #[arg(long, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub rotary_seq_len_interpolation_factor: Option<f64>,
    /// rope or yarn: Megatron core_v0.14's spelling of --position-embedding-type yarn.
    #[arg(long, value_parser = ["rope", "yarn"])]
    pub rope_type: Option<String>,
    /// YaRN's context-stretching factor.
    #[arg(long, default_value_t = 1.0, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub rotary_scaling_factor: f64,
    /// YaRN: the numerator's coefficient of the attention factor 0.1·k·ln(factor) + 1.
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    pub mscale: f64,
    /// YaRN: the denominator's coefficient of the attention factor.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    pub mscale_all_dim: f64,
    /// YaRN: the context the model was trained on [default: 4096].
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub yarn_original_max_position_embeddings: Option<i64>,
    /// YaRN: frequencies turning more often than this over the original context are kept
    /// [default: 32].
    #[arg(long, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub yarn_beta_fast: Option<f64>,
    /// YaRN: frequencies turning less often than this are fully stretched [default: 1].
    #[arg(long, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub yarn_beta_slow: Option<f64>,
    /// YaRN: round the ramp's end channels outwards to integers (the default).
    #[arg(long, overrides_with = "no_yarn_correction_range_round_to_int")]
    pub yarn_correction_range_round_to_int: bool,
    /// YaRN: keep the ramp's end channels fractional.
    #[arg(long)]
    pub no_yarn_correction_range_round_to_int: bool,
}

impl Default for RopeScalingArgs {
    fn default() -> Self {
        RopeScalingArgs {
            use_rope_scaling: false,
            rope_scaling_factor: 8.0,
            rotary_seq_len_interpolation_factor: None,
            rope_type: None,
            rotary_scaling_factor: 1.0,
            mscale: 1.0,
            mscale_all_dim: 0.0,
            yarn_original_max_position_embeddings: None,
            yarn_beta_fast: None,
            yarn_beta_slow: None,
            yarn_correction_range_round_to_int: false,
            no_yarn_correction_range_round_to_int: false,
        }
    }
}

impl RopeScalingArgs {
    /// Whether YaRN is selected, by `--position-embedding-type yarn` or `--rope-type yarn`.
    pub fn yarn_selected(&self, position_embedding_type: &str) -> bool {
        position_embedding_type == "yarn" || self.rope_type.as_deref() == Some("yarn")
    }

    /// The scaling the flags select; more than one kind at once is refused (our RoPE applies
    /// one).
    pub fn scaling(&self, position_embedding_type: &str) -> Result<Option<RopeScaling>> {
        let mut chosen = Vec::new();
        if self.use_rope_scaling {
            chosen.push(RopeScaling::Llama3(Llama3Scaling::megatron(
                self.rope_scaling_factor,
            )));
        }
        if let Some(factor) = self.rotary_seq_len_interpolation_factor {
            chosen.push(RopeScaling::Linear { factor });
        }
        if self.yarn_selected(position_embedding_type) {
            let defaults = YarnScaling::megatron(self.rotary_scaling_factor);
            chosen.push(RopeScaling::Yarn(YarnScaling {
                original_max_position_embeddings: self
                    .yarn_original_max_position_embeddings
                    .unwrap_or(defaults.original_max_position_embeddings),
                beta_fast: self.yarn_beta_fast.unwrap_or(defaults.beta_fast),
                beta_slow: self.yarn_beta_slow.unwrap_or(defaults.beta_slow),
                mscale: self.mscale,
                mscale_all_dim: self.mscale_all_dim,
                correction_range_round_to_int: !self.no_yarn_correction_range_round_to_int,
                ..defaults
            }));
        }
        match chosen.as_slice() {
            [] => Ok(None),
            [one] => {
                one.validate()?;
                Ok(Some(*one))
            }
            [first, second, ..] => bail!(
                "{} and {} select two RoPE scalings; give one",
                first.flag(),
                second.flag()
            ),
        }
    }
}

/// Reads `rope_scaling` from checkpoint metadata: tagged by `rope_type`, or untagged Llama-3
/// parameters as metadata written before the other types existed holds them.
pub fn deserialize_stored<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<RopeScaling>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Stored {
        Tagged(RopeScaling),
        UntaggedLlama3(Llama3Scaling),
    }
    Ok(
        Option::<Stored>::deserialize(deserializer)?.map(|stored| match stored {
            Stored::Tagged(scaling) => scaling,
            Stored::UntaggedLlama3(scaling) => RopeScaling::Llama3(scaling),
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Holder {
        #[serde(default, deserialize_with = "deserialize_stored")]
        rope_scaling: Option<RopeScaling>,
    }

    #[test]
    fn metadata_before_rope_types_reads_as_llama3() {
        let old = r#"{"rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#;
        let holder: Holder = serde_json::from_str(old).unwrap();
        assert_eq!(
            holder.rope_scaling,
            Some(RopeScaling::Llama3(Llama3Scaling::megatron(8.0)))
        );
        let holder: Holder = serde_json::from_str("{}").unwrap();
        assert_eq!(holder.rope_scaling, None);
    }

    #[test]
    fn every_type_survives_metadata() {
        for scaling in [
            RopeScaling::Llama3(Llama3Scaling::megatron(32.0)),
            RopeScaling::Linear { factor: 4.0 },
            RopeScaling::Yarn(YarnScaling {
                mscale: 0.707,
                mscale_all_dim: 0.707,
                ..YarnScaling::megatron(40.0)
            }),
        ] {
            let text = serde_json::json!({ "rope_scaling": scaling }).to_string();
            let holder: Holder = serde_json::from_str(&text).unwrap();
            assert_eq!(holder.rope_scaling, Some(scaling), "{text}");
        }
    }

    #[test]
    fn yarn_attention_factor_follows_megatron_and_names_where_hf_differs() {
        let defaults = YarnScaling::megatron(4.0);
        let expected = 0.1 * 4.0f64.ln() + 1.0;
        assert!((defaults.attention_factor() - expected).abs() < 1e-15);
        assert_eq!(YarnScaling::hf_attention_factor(4.0, None, None), expected);
        // DeepSeek-style: both given, the ratio in both.
        let both = YarnScaling {
            mscale: 0.707,
            mscale_all_dim: 0.707,
            ..defaults
        };
        assert_eq!(both.attention_factor(), 1.0);
        assert_eq!(
            YarnScaling::hf_attention_factor(4.0, Some(0.707), Some(0.707)),
            1.0
        );
        // mscale alone: Megatron scales by it, transformers ignores it.
        let alone = YarnScaling {
            mscale: 0.5,
            ..defaults
        };
        assert!((alone.attention_factor() - (0.05 * 4.0f64.ln() + 1.0)).abs() < 1e-15);
        assert_eq!(
            YarnScaling::hf_attention_factor(4.0, Some(0.5), Some(0.0)),
            expected
        );
        // No stretching, no factor.
        assert_eq!(YarnScaling::megatron(1.0).attention_factor(), 1.0);
    }
}
