//! Megatron's Transformer-Engine flags: FP8 GEMMs in the transformer layers' linears.

use anyhow::{bail, ensure, Result};
use clap::Args;

use super::training::MixedPrecisionArgs;
use megatron_models::fp8::{AmaxAlgorithm, Fp8Format, Fp8Plan, Fp8Recipe, Fp8Scaling};

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct Fp8Args {
    /// Run the transformer layers' linears (QKV, attention projection, fc1, fc2) as fp8 GEMMs:
    /// e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients). Needs --bf16.
    #[arg(long = "fp8-format", value_parser = ["e4m3", "hybrid"])]
    pub fp8_format: Option<String>,
    /// How scales are chosen: delayed (from the amax history of earlier steps) or tensorwise
    /// (from each tensor itself); mxfp8 and blockwise are not implemented.
    #[arg(long, default_value = "delayed", value_parser = ["tensorwise", "delayed", "mxfp8", "blockwise"])]
    pub fp8_recipe: String,
    /// Delayed scaling: scales are divided by 2^margin.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub fp8_margin: i32,
    /// Deprecated and ignored, as in Megatron.
    #[arg(long, default_value_t = 1)]
    pub fp8_interval: i64,
    /// Delayed scaling: how many uses of a tensor its amax history covers.
    #[arg(long, default_value_t = 1)]
    pub fp8_amax_history_len: usize,
    /// Delayed scaling: the amax a scale comes from, the most recent or the history's max.
    #[arg(long, default_value = "most_recent", value_parser = ["most_recent", "max"])]
    pub fp8_amax_compute_algo: String,
    /// Compute the weight gradients in bf16 instead of fp8.
    #[arg(long)]
    pub no_fp8_wgrad: bool,
    /// Accepted; changes nothing here: parameters are kept and all-gathered in bf16 and cast to
    /// fp8 at each use.
    #[arg(long)]
    pub fp8_param_gather: bool,
    /// Keep the first and last transformer layers in bf16 when training in fp8.
    #[arg(long)]
    pub first_last_layers_bf16: bool,
    /// With --first-last-layers-bf16: how many layers at the start stay in bf16.
    #[arg(long, default_value_t = 1)]
    pub num_layers_at_start_in_bf16: usize,
    /// With --first-last-layers-bf16: how many layers at the end stay in bf16.
    #[arg(long, default_value_t = 1)]
    pub num_layers_at_end_in_bf16: usize,
    /// Accepted for compatibility: dropout always draws from our own generators.
    #[arg(long)]
    pub te_rng_tracker: bool,
    /// Accepted for compatibility: dropout always draws from our own generators.
    #[arg(long)]
    pub inference_rng_tracker: bool,
}

impl Fp8Args {
    /// The fp8 plan the flags ask for (`None` without `--fp8-format`), checked as Megatron's
    /// `TransformerConfig` does, for a model of `num_layers` layers over `pipeline` stages.
    pub fn plan(
        &self,
        precision: &MixedPrecisionArgs,
        num_layers: usize,
        pipeline: usize,
    ) -> Result<Option<Fp8Plan>> {
        let Some(format) = self.fp8_format.as_deref() else {
            return Ok(None);
        };
        let format = match format {
            "e4m3" => Fp8Format::E4m3,
            "hybrid" => Fp8Format::Hybrid,
            other => bail!("--fp8-format {other:?}: expected e4m3 or hybrid"),
        };
        ensure!(
            precision.bf16,
            "--fp8-format needs --bf16: the fp8 GEMMs take bf16 activations and give bf16 outputs"
        );
        let scaling = match self.fp8_recipe.as_str() {
            "delayed" => {
                ensure!(
                    self.fp8_amax_history_len > 0,
                    "--fp8-amax-history-len must be at least 1"
                );
                Fp8Scaling::Delayed {
                    history_len: self.fp8_amax_history_len,
                    algorithm: match self.fp8_amax_compute_algo.as_str() {
                        "max" => AmaxAlgorithm::Max,
                        _ => AmaxAlgorithm::MostRecent,
                    },
                    margin: self.fp8_margin,
                }
            }
            "tensorwise" => Fp8Scaling::Tensorwise,
            other => bail!(
                "--fp8-recipe {other} is not implemented here (only per-tensor scaling is, not \
                 block scaling); use delayed or tensorwise"
            ),
        };
        if self.fp8_param_gather {
            eprintln!(
                "note: --fp8-param-gather changes nothing here: parameters are kept and \
                 all-gathered in bf16, and cast to fp8 at each use"
            );
        }
        let (start, end) = if self.first_last_layers_bf16 {
            let per_stage = num_layers / pipeline.max(1);
            for (flag, value) in [
                (
                    "--num-layers-at-start-in-bf16",
                    self.num_layers_at_start_in_bf16,
                ),
                (
                    "--num-layers-at-end-in-bf16",
                    self.num_layers_at_end_in_bf16,
                ),
            ] {
                ensure!(
                    value <= per_stage,
                    "{flag} {value} must be between 0 and the number of layers per pipeline \
                     stage ({per_stage})"
                );
            }
            (
                self.num_layers_at_start_in_bf16,
                self.num_layers_at_end_in_bf16,
            )
        } else {
            (0, 0)
        };
        Ok(Some(Fp8Plan {
            recipe: Fp8Recipe {
                format,
                scaling,
                wgrad: !self.no_fp8_wgrad,
            },
            bf16_layers_at_start: start,
            bf16_layers_at_end: end,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        precision: MixedPrecisionArgs,
        #[command(flatten)]
        fp8: Fp8Args,
    }

    /// The plan for an 8-layer model over 2 pipeline stages.
    fn plan(args: &[&str]) -> Result<Option<Fp8Plan>> {
        let flags = Flags::try_parse_from(std::iter::once("pretrain").chain(args.iter().copied()))?;
        flags.fp8.plan(&flags.precision, 8, 2)
    }

    #[test]
    fn without_fp8_format_there_is_no_plan() {
        assert_eq!(
            plan(&["--bf16", "--fp8-recipe", "tensorwise"]).unwrap(),
            None
        );
    }

    #[test]
    fn megatrons_defaults_give_hybrid_delayed_scaling_over_one_step() {
        let plan = plan(&["--bf16", "--fp8-format", "hybrid"])
            .unwrap()
            .unwrap();
        assert_eq!(
            plan,
            Fp8Plan {
                recipe: Fp8Recipe {
                    format: Fp8Format::Hybrid,
                    scaling: Fp8Scaling::Delayed {
                        history_len: 1,
                        algorithm: AmaxAlgorithm::MostRecent,
                        margin: 0,
                    },
                    wgrad: true,
                },
                bf16_layers_at_start: 0,
                bf16_layers_at_end: 0,
            }
        );
    }

    #[test]
    fn every_flag_reaches_the_plan() {
        let plan = plan(&[
            "--bf16",
            "--fp8-format",
            "e4m3",
            "--fp8-amax-history-len",
            "1024",
            "--fp8-amax-compute-algo",
            "max",
            "--fp8-margin",
            "-1",
            "--fp8-interval",
            "4",
            "--no-fp8-wgrad",
            "--fp8-param-gather",
            "--first-last-layers-bf16",
            "--num-layers-at-end-in-bf16",
            "2",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(plan.recipe.format, Fp8Format::E4m3);
        assert_eq!(
            plan.recipe.scaling,
            Fp8Scaling::Delayed {
                history_len: 1024,
                algorithm: AmaxAlgorithm::Max,
                margin: -1,
            }
        );
        assert!(!plan.recipe.wgrad);
        assert_eq!((plan.bf16_layers_at_start, plan.bf16_layers_at_end), (1, 2));
        let tensorwise = super::tests::plan(&[
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "tensorwise",
        ]);
        assert_eq!(
            tensorwise.unwrap().unwrap().recipe.scaling,
            Fp8Scaling::Tensorwise
        );
    }

    #[test]
    fn what_is_not_supported_is_refused_with_a_reason() {
        let error = |args: &[&str]| plan(args).unwrap_err().to_string();
        assert!(error(&["--fp8-format", "hybrid"]).contains("needs --bf16"));
        assert!(error(&["--fp16", "--fp8-format", "e4m3"]).contains("needs --bf16"));
        for recipe in ["mxfp8", "blockwise"] {
            let message = error(&["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", recipe]);
            assert!(
                message.contains(&format!("--fp8-recipe {recipe} is not implemented")),
                "{message}"
            );
        }
        let message = error(&[
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--first-last-layers-bf16",
            "--num-layers-at-start-in-bf16",
            "5",
        ]);
        assert!(
            message.contains("layers per pipeline stage (4)"),
            "{message}"
        );
        assert!(error(&["--bf16", "--fp8-format", "e5m2"]).contains("e5m2"));
        let message = error(&[
            "--bf16",
            "--fp8-format",
            "hybrid",
            "--fp8-amax-history-len",
            "0",
        ]);
        assert!(message.contains("at least 1"), "{message}");
    }
}
