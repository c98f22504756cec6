//! Megatron's Mixture-of-Experts flags (`--num-experts`, `--moe-*`, the expert parallelism).

use anyhow::Result;
use clap::Args;
use megatron_cli::{bail_usage, ranges, usage_error};

use megatron_models::layers::moe::config::{
    parse_layer_freq, Capacity, DropPolicy, LoadBalancing, MoeConfig, RouterDtype, ScoreFunction,
    TokenDispatcher,
};
use megatron_models::Recompute;

use super::ParallelArgs;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct MoeArgs {
    /// Number of experts in each Mixture-of-Experts layer [default: none, a dense model].
    #[arg(long)]
    pub num_experts: Option<i64>,
    /// Which layers are Mixtures of Experts: an integer N (layers 0, N, 2N, … are) or a
    /// Python list of 0s and 1s, one per layer, e.g. "([1]*3+[0]*1)*3".
    #[arg(long, default_value = "1")]
    pub moe_layer_freq: String,
    /// Hidden size of each expert's MLP [default: --ffn-hidden-size].
    #[arg(long)]
    pub moe_ffn_hidden_size: Option<i64>,
    /// Hidden size of the shared expert every token also passes through [default: none].
    #[arg(long)]
    pub moe_shared_expert_intermediate_size: Option<i64>,
    /// Scales the shared expert's output per token by a sigmoid gate of the token
    /// (`mlp.shared_experts.gate_weight`, Qwen2-MoE's shared_expert_gate).
    #[arg(long)]
    pub moe_shared_expert_gate: bool,
    /// Number of experts each token is routed to.
    #[arg(long, default_value_t = 2)]
    pub moe_router_topk: i64,
    /// softmax or sigmoid: how the router's logits become scores.
    #[arg(long, default_value = "softmax", value_parser = ["softmax", "sigmoid"])]
    pub moe_router_score_function: String,
    /// Softmax over all experts before the top-k selection (by default, over the chosen k
    /// after it).
    #[arg(long)]
    pub moe_router_pre_softmax: bool,
    /// Multiplies the chosen experts' probabilities [default: none].
    #[arg(long, value_parser = ranges::positive, allow_hyphen_values = true)]
    pub moe_router_topk_scaling_factor: Option<f64>,
    /// fp32 or fp64: the precision of the router's logits and probabilities [default: the
    /// activations' dtype].
    #[arg(long, value_parser = ["fp32", "fp64"])]
    pub moe_router_dtype: Option<String>,
    /// aux_loss (Switch Transformer's load-balancing loss over the micro-batch), seq_aux_loss
    /// (the same per sequence) or none.
    #[arg(long, default_value = "aux_loss", value_parser = load_balancing_type)]
    pub moe_router_load_balancing_type: String,
    /// Coefficient of the load-balancing loss (1e-2 is a usual start).
    #[arg(long, default_value_t = 0.0, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub moe_aux_loss_coeff: f64,
    /// Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the router's
    /// sigmoid scores for the top-k choice only (not to the probabilities), moved after each
    /// step by --moe-router-bias-update-rate toward the experts that got fewer of the step's
    /// tokens (counted over all ranks). Needs --moe-router-score-function sigmoid; saved in
    /// checkpoints.
    #[arg(long)]
    pub moe_router_enable_expert_bias: bool,
    /// How far the expert bias moves per step (--moe-router-enable-expert-bias).
    #[arg(long, default_value_t = 1e-3, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub moe_router_bias_update_rate: f64,
    /// Coefficient of the router's z-loss [default: none] (1e-3 is a usual start).
    #[arg(long, value_parser = ranges::non_negative, allow_hyphen_values = true)]
    pub moe_z_loss_coeff: Option<f64>,
    /// allgather (every expert-parallel rank gathers all the group's tokens) or alltoall (each
    /// token goes only to the ranks of its experts): how tokens reach the experts of other
    /// ranks; the same results, and the same on one rank. flex (DeepEP) is not supported.
    #[arg(long, default_value = "allgather", value_parser = token_dispatcher_type)]
    pub moe_token_dispatcher_type: String,
    /// Run each linear of the local experts as one grouped GEMM over all of them (libtorch's
    /// grouped matmul) instead of one GEMM per expert: on GPUs in bf16 (Hopper's kernel; older
    /// cards get libtorch's fallback), on the CPU in fp32/bf16/fp16, with expert widths and
    /// hidden size whose rows are multiples of 16 bytes. Elsewhere (fp32 or fp16 on a GPU, fp8,
    /// odd widths) the experts run one after the other, with the same results; the parameters
    /// and checkpoints are the same either way.
    #[arg(long)]
    pub moe_grouped_gemm: bool,
    /// Megatron's fused token permutation. Here the tokens of one rank are always permuted by a
    /// sort of their experts on the device, without waiting for it, and the grouped GEMM takes
    /// the per-expert offsets on the device, so this flag changes nothing (accepted for
    /// Megatron's scripts).
    #[arg(long)]
    pub moe_permute_fusion: bool,
    /// Expert parallelism: each MoE layer's experts are split over this many ranks, folded into
    /// the data-parallel ranks (times the tensor-parallel ones) as Megatron does; must divide
    /// --num-experts.
    #[arg(long, default_value_t = 1, value_parser = at_least_one)]
    pub expert_model_parallel_size: usize,
    /// Tensor parallelism inside each expert [default: --tensor-model-parallel-size]: only 1 is
    /// supported, so with tensor parallelism give --expert-tensor-parallel-size 1.
    #[arg(long, value_parser = expert_tensor_parallel_size)]
    pub expert_tensor_parallel_size: Option<usize>,
    /// Not supported: the DeepEP dispatcher (refused when given).
    #[arg(long)]
    pub moe_enable_deepep: bool,
    /// Expert capacity: each expert takes at most ceil(tokens × topk / experts × factor) of a
    /// micro-batch's tokens and drops the others routed to it (--moe-token-drop-policy)
    /// [default: none, dropless; a negative factor is dropless too, as in Megatron].
    #[arg(long, allow_hyphen_values = true)]
    pub moe_expert_capacity_factor: Option<f64>,
    /// probs (drop an expert's tokens of the lowest probabilities) or position (drop the tokens
    /// at the end of the micro-batch), with --moe-expert-capacity-factor.
    #[arg(long, default_value = "probs", value_parser = ["probs", "position"])]
    pub moe_token_drop_policy: String,
    /// Fill every expert's batch up to its capacity with tokens of probability zero (the same
    /// outputs; batch sizes known without reading the routing), with
    /// --moe-expert-capacity-factor.
    #[arg(long)]
    pub moe_pad_expert_input_to_capacity: bool,
}

impl MoeArgs {
    /// The expert-parallel size the job's groups are built with; `None` for a dense model.
    pub fn expert_parallel(&self) -> Option<usize> {
        self.num_experts.map(|_| self.expert_model_parallel_size)
    }

    /// The checks Megatron makes of the MoE flags against the parallel sizes: experts split
    /// evenly over the expert-parallel ranks, whole experts on each (expert tensor
    /// parallelism 1), and sequence parallelism with tensor parallelism.
    pub fn check_parallel(&self, parallel: &ParallelArgs) -> Result<()> {
        let Some(num_experts) = self.num_experts else {
            if self.expert_model_parallel_size > 1 {
                bail_usage!("--expert-model-parallel-size needs --num-experts");
            }
            return Ok(());
        };
        let ep = self.expert_model_parallel_size as i64;
        if num_experts % ep != 0 {
            bail_usage!(
                "--num-experts {num_experts} is not divisible by --expert-model-parallel-size {ep}"
            );
        }
        let tp = parallel.tensor_model_parallel_size;
        let etp = self.expert_tensor_parallel_size.unwrap_or(tp);
        if etp != 1 {
            bail_usage!(
                "--expert-tensor-parallel-size {etp}{}: only 1 is supported (experts whole on \
                 each rank); give --expert-tensor-parallel-size 1",
                if self.expert_tensor_parallel_size.is_none() {
                    " (its default, --tensor-model-parallel-size)"
                } else {
                    ""
                }
            );
        }
        if tp > 1 && !parallel.sequence_parallel {
            bail_usage!(
                "--num-experts with --tensor-model-parallel-size {tp} needs --sequence-parallel \
                 (as Megatron requires in training)"
            );
        }
        Ok(())
    }

    /// Refuses full activation recomputation with Mixture-of-Experts layers: the recomputed
    /// router would attach its auxiliary losses on the autograd engine's thread, which does not
    /// know the step's loss scale.
    pub fn refuse_full_recompute(&self, recompute: Recompute) -> Result<()> {
        if self.num_experts.is_some() && matches!(recompute, Recompute::Full { .. }) {
            bail_usage!(
                "--num-experts with --recompute-granularity full: Mixture-of-Experts layers \
                 are not recomputed yet"
            );
        }
        Ok(())
    }

    /// Refuses `--num-experts` for a family without Mixture-of-Experts layers.
    pub fn refuse_for(&self, family: &str) -> Result<()> {
        if self.num_experts.is_some() {
            bail_usage!("--num-experts: {family} has no Mixture-of-Experts layers (GPT has)");
        }
        Ok(())
    }

    /// The Mixture-of-Experts architecture for a model of `num_layers` layers whose dense MLPs
    /// are `ffn_hidden_size` wide; `None` without `--num-experts`. Flags that do not fit are
    /// usage errors.
    pub fn config(
        &self,
        num_layers: usize,
        ffn_hidden_size: i64,
        add_bias_linear: bool,
    ) -> Result<Option<MoeConfig>> {
        if self.moe_enable_deepep {
            bail_usage!(
                "--moe-enable-deepep is not supported: DeepEP's flex dispatcher is not implemented"
            );
        }
        let Some(num_experts) = self.num_experts else {
            return Ok(None);
        };
        if add_bias_linear {
            bail_usage!(
                "--num-experts needs --disable-bias-linear: Megatron's experts scale their \
                 activations by the router's probabilities before fc2, which takes no bias"
            );
        }
        let capacity = self
            .moe_expert_capacity_factor
            .filter(|factor| *factor >= 0.0)
            .map(|factor| Capacity {
                factor,
                drop_policy: match self.moe_token_drop_policy.as_str() {
                    "position" => DropPolicy::Position,
                    _ => DropPolicy::Probs,
                },
                pad_to_capacity: self.moe_pad_expert_input_to_capacity,
            });
        if self.moe_pad_expert_input_to_capacity && capacity.is_none() {
            bail_usage!(
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (as \
                 Megatron requires)"
            );
        }
        let load_balancing = match self.moe_router_load_balancing_type.as_str() {
            "aux_loss" => LoadBalancing::AuxLoss,
            "seq_aux_loss" => LoadBalancing::SeqAuxLoss,
            _ => LoadBalancing::None,
        };
        let config = MoeConfig {
            num_experts,
            ffn_hidden_size: self.moe_ffn_hidden_size.unwrap_or(ffn_hidden_size),
            layer_pattern: parse_layer_freq(&self.moe_layer_freq, num_layers)
                .map_err(usage_error)?,
            topk: self.moe_router_topk,
            score_function: match self.moe_router_score_function.as_str() {
                "sigmoid" => ScoreFunction::Sigmoid,
                _ => ScoreFunction::Softmax,
            },
            pre_softmax: self.moe_router_pre_softmax,
            topk_scaling_factor: self.moe_router_topk_scaling_factor,
            router_dtype: match self.moe_router_dtype.as_deref() {
                Some("fp32") => Some(RouterDtype::Fp32),
                Some(_) => Some(RouterDtype::Fp64),
                None => None,
            },
            load_balancing,
            aux_loss_coeff: self.moe_aux_loss_coeff,
            z_loss_coeff: self.moe_z_loss_coeff,
            shared_expert_intermediate_size: self.moe_shared_expert_intermediate_size,
            capacity,
            expert_bias_update_rate: self
                .moe_router_enable_expert_bias
                .then_some(self.moe_router_bias_update_rate),
            shared_expert_gate: self.moe_shared_expert_gate,
            token_dispatcher: match self.moe_token_dispatcher_type.as_str() {
                "alltoall" => TokenDispatcher::Alltoall,
                _ => TokenDispatcher::Allgather,
            },
            grouped_gemm: self.moe_grouped_gemm,
        };
        config.validate(num_layers).map_err(usage_error)?;
        Ok(Some(config))
    }
}

fn load_balancing_type(value: &str) -> Result<String, String> {
    match value {
        "aux_loss" | "seq_aux_loss" | "none" => Ok(value.into()),
        "sinkhorn" => Err("sinkhorn load balancing is not supported".into()),
        _ => Err("expected aux_loss, seq_aux_loss or none".into()),
    }
}

fn token_dispatcher_type(value: &str) -> Result<String, String> {
    match value {
        "allgather" | "alltoall" => Ok(value.into()),
        "flex" => Err("the flex dispatcher (DeepEP) is not supported".into()),
        _ => Err("expected allgather or alltoall".into()),
    }
}

fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn expert_tensor_parallel_size(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(1) => Ok(1),
        Ok(0) => Err("must be at least 1".into()),
        Ok(_) => Err("tensor parallelism inside experts is not supported: only 1 is".into()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::ModelArgs;
    use clap::Parser;
    use megatron_cli::is_usage_error;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        model: ModelArgs,
    }

    const SHAPE: [&str; 11] = [
        "pretrain",
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "32",
        "--disable-bias-linear",
        "--swiglu",
    ];

    fn parse(extra: &[&str]) -> Result<Flags, clap::Error> {
        Flags::try_parse_from(SHAPE.iter().chain(extra))
    }

    fn config(extra: &[&str]) -> Result<Option<MoeConfig>> {
        Ok(parse(extra).unwrap().model.gpt_config(1000)?.moe)
    }

    #[test]
    fn moe_flags_take_megatrons_defaults() {
        assert_eq!(config(&[]).unwrap(), None);
        let moe = config(&["--num-experts", "8"]).unwrap().unwrap();
        assert_eq!(
            moe,
            MoeConfig {
                num_experts: 8,
                ffn_hidden_size: 128,
                layer_pattern: vec![true; 4],
                topk: 2,
                score_function: ScoreFunction::Softmax,
                pre_softmax: false,
                topk_scaling_factor: None,
                router_dtype: None,
                load_balancing: LoadBalancing::AuxLoss,
                aux_loss_coeff: 0.0,
                z_loss_coeff: None,
                shared_expert_intermediate_size: None,
                capacity: None,
                expert_bias_update_rate: None,
                shared_expert_gate: false,
                token_dispatcher: TokenDispatcher::Allgather,
                grouped_gemm: false,
            }
        );
        let moe = config(&[
            "--num-experts",
            "8",
            "--moe-layer-freq",
            "([0]+[1])*2",
            "--moe-ffn-hidden-size",
            "32",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-dtype",
            "fp32",
            "--moe-router-load-balancing-type",
            "seq_aux_loss",
            "--moe-aux-loss-coeff",
            "0.01",
            "--moe-token-dispatcher-type",
            "alltoall",
            "--expert-model-parallel-size",
            "1",
            "--expert-tensor-parallel-size",
            "1",
            "--moe-grouped-gemm",
            "--moe-permute-fusion",
        ])
        .unwrap()
        .unwrap();
        assert!(moe.grouped_gemm);
        let biased = config(&[
            "--num-experts",
            "8",
            "--moe-router-score-function",
            "sigmoid",
            "--moe-router-enable-expert-bias",
            "--moe-expert-capacity-factor",
            "1.25",
            "--moe-token-drop-policy",
            "position",
            "--moe-pad-expert-input-to-capacity",
        ])
        .unwrap()
        .unwrap();
        assert_eq!(biased.expert_bias_update_rate, Some(1e-3));
        assert_eq!(
            biased.capacity,
            Some(Capacity {
                factor: 1.25,
                drop_policy: DropPolicy::Position,
                pad_to_capacity: true
            })
        );
        let dropless = config(&["--num-experts", "8", "--moe-expert-capacity-factor", "-1"])
            .unwrap()
            .unwrap();
        assert_eq!(dropless.capacity, None);
        assert_eq!(moe.layer_pattern, vec![false, true, false, true]);
        assert_eq!(moe.ffn_hidden_size, 32);
        assert_eq!(moe.score_function, ScoreFunction::Sigmoid);
        assert_eq!(moe.router_dtype, Some(RouterDtype::Fp32));
        assert_eq!(moe.load_balancing, LoadBalancing::SeqAuxLoss);
        assert_eq!(moe.aux_loss_coeff, 0.01);
        assert_eq!(moe.token_dispatcher, TokenDispatcher::Alltoall);
    }

    fn check_parallel(extra: &[&str], parallel: &[&str]) -> Result<()> {
        #[derive(Parser)]
        struct WithParallel {
            #[command(flatten)]
            model: ModelArgs,
            #[command(flatten)]
            parallel: ParallelArgs,
        }
        let flags =
            WithParallel::try_parse_from(SHAPE.iter().chain(extra).chain(parallel)).unwrap();
        flags.model.moe.check_parallel(&flags.parallel)
    }

    /// Expert parallelism is accepted where Megatron accepts it; what does not fit is a usage
    /// error naming the flags.
    #[test]
    fn expert_parallel_flags_are_checked_against_the_parallel_sizes() {
        let experts = ["--num-experts", "4"];
        check_parallel(&experts, &["--expert-model-parallel-size", "2"]).unwrap();
        check_parallel(
            &experts,
            &[
                "--expert-model-parallel-size",
                "4",
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--expert-tensor-parallel-size",
                "1",
            ],
        )
        .unwrap();
        for (extra, parallel, needle) in [
            (
                &experts[..],
                &["--expert-model-parallel-size", "3"][..],
                "--num-experts 4 is not divisible by --expert-model-parallel-size 3",
            ),
            (
                &experts,
                &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                "--expert-tensor-parallel-size 2 (its default, --tensor-model-parallel-size)",
            ),
            (
                &experts,
                &[
                    "--tensor-model-parallel-size",
                    "2",
                    "--expert-tensor-parallel-size",
                    "1",
                ],
                "needs --sequence-parallel",
            ),
            (
                &[],
                &["--expert-model-parallel-size", "2"],
                "--expert-model-parallel-size needs --num-experts",
            ),
        ] {
            let error = check_parallel(extra, parallel).unwrap_err();
            assert!(is_usage_error(&error), "{error}");
            assert!(error.to_string().contains(needle), "{error}");
        }
    }

    /// Flags that do not fit are usage errors naming the flag; Megatron flags not implemented
    /// here are refused by name.
    #[test]
    fn bad_moe_flags_are_usage_errors_naming_them() {
        for (extra, needle) in [
            (
                &["--num-experts", "4", "--moe-router-topk", "5"][..],
                "--moe-router-topk 5 must be between 1 and --num-experts 4",
            ),
            (
                &["--num-experts", "4", "--moe-layer-freq", "[1,1]"],
                "--moe-layer-freq",
            ),
            (
                &["--num-experts", "4", "--moe-enable-deepep"],
                "--moe-enable-deepep",
            ),
            (
                &["--num-experts", "4", "--moe-pad-expert-input-to-capacity"],
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor",
            ),
            (
                &["--num-experts", "4", "--moe-router-enable-expert-bias"],
                "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid",
            ),
            (&["--num-experts", "0"], "--num-experts must be positive"),
        ] {
            let error = config(extra).unwrap_err();
            assert!(is_usage_error(&error), "{extra:?}: {error}");
            assert!(error.to_string().contains(needle), "{extra:?}: {error}");
        }
        let with_bias =
            Flags::try_parse_from(SHAPE[..9].iter().chain(&["--num-experts", "4"])).unwrap();
        let error = with_bias.model.gpt_config(1000).unwrap_err();
        assert!(is_usage_error(&error), "{error}");
        assert!(
            error.to_string().contains("--disable-bias-linear"),
            "{error}"
        );
        for (extra, needle) in [
            (&["--moe-token-dispatcher-type", "flex"][..], "flex"),
            (&["--expert-model-parallel-size", "0"], "at least 1"),
            (&["--expert-tensor-parallel-size", "2"], "inside experts"),
            (
                &["--moe-router-load-balancing-type", "sinkhorn"],
                "sinkhorn",
            ),
        ] {
            let error = parse(extra).err().unwrap().to_string();
            assert!(
                error.contains(extra[0]) && error.contains(needle),
                "{error}"
            );
        }
    }
}
