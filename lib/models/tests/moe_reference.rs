//! The Mixture-of-Experts layer against `scripts/reference/moe_reference.py`, a PyTorch layer
//! written from Megatron's definitions, on the same weights and input in float32: the output,
//! the auxiliary losses as the log reports them, and the gradients of the input, the router
//! and every expert, for top-1 and top-2, softmax (after or before the top-k) and sigmoid
//! scores, the top-k scaling, per-sequence balancing, the z-loss and the shared expert, the
//! expert bias (with the tokens it counts) and the expert capacity's drop policies and padding;
//! and
//! the output against transformers' `MixtralSparseMoeBlock` where the layer is Mixtral's.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use megatron_models::layers::moe::aux_loss::{set_aux_loss_backward_scale, take_tracked_losses};
use megatron_models::layers::moe::config::{
    Capacity, DropPolicy, LoadBalancing, MoeConfig, ScoreFunction, TokenDispatcher,
};
use megatron_models::layers::{MoeLayer, NamedParameter, NamedTensors, TensorParallel};
use megatron_models::param::Initializer;
use megatron_models::TransformerConfig;
use megatron_models::{Activation, Normalization};
use megatron_parallel::SingleRank;
use serde_json::json;
use tch::{Device, Kind, Tensor};

const HIDDEN: i64 = 16;
const SEQ: i64 = 6;
const BATCH: i64 = 3;
/// The gradient the auxiliary losses get in backward (the loss scale over the micro-batches
/// in training); not 1, so that a missing or doubled scale shows.
const AUX_SCALE: f64 = 0.375;

fn python() -> PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

fn reference_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/reference/moe_reference.py")
}

fn trunk() -> TransformerConfig {
    TransformerConfig {
        num_layers: 1,
        hidden_size: HIDDEN,
        num_attention_heads: 2,
        num_query_groups: 2,
        kv_channels: 8,
        ffn_hidden_size: 24,
        activation: Activation::Swiglu,
        normalization: Normalization::RMSNorm,
        add_bias_linear: false,
        add_qkv_bias: false,
        init_method_std: 0.3,
        ..TransformerConfig::gpt_345m()
    }
}

fn moe(topk: i64) -> MoeConfig {
    MoeConfig {
        num_experts: 4,
        ffn_hidden_size: 12,
        layer_pattern: vec![true],
        topk,
        score_function: ScoreFunction::Softmax,
        pre_softmax: false,
        topk_scaling_factor: None,
        router_dtype: None,
        load_balancing: LoadBalancing::AuxLoss,
        aux_loss_coeff: 0.01,
        z_loss_coeff: None,
        shared_expert_intermediate_size: None,
        capacity: None,
        expert_bias_update_rate: None,
        shared_expert_gate: false,
        token_dispatcher: TokenDispatcher::Allgather,
        grouped_gemm: false,
    }
}

fn named(layer: &MoeLayer) -> Vec<NamedParameter> {
    let mut params = Vec::new();
    layer.named_tensors(&mut NamedTensors::new(&mut params));
    params
}

/// How the router's weights are set.
#[derive(Clone, Copy, PartialEq)]
enum Routing {
    Random,
    /// Every token's first channel large and the router reading only it, with weights 1 and
    /// 0.8 for experts 0 and 1: top-2 sends every token to those two and none to the others.
    OnlyExpertsZeroAndOne,
}

/// Runs the layer and the reference on one case; returns the reference's outputs, and ours
/// as `ours.y`.
fn compare(case: &str, config: MoeConfig) -> HashMap<String, Tensor> {
    compare_routed(case, config, Routing::Random)
}

fn compare_routed(case: &str, config: MoeConfig, routing: Routing) -> HashMap<String, Tensor> {
    let init = Initializer::new(Kind::Float, Device::Cpu, 0, 1, 1234).scope("mlp");
    let parallel = TensorParallel {
        group: Arc::new(SingleRank),
        sequence_parallel: false,
    };
    let layer = MoeLayer::new(
        &init,
        &trunk(),
        &config,
        0.2,
        parallel,
        Arc::new(SingleRank),
    );
    let params = named(&layer);
    for param in &params {
        let _ = param.tensor.shallow_clone().set_requires_grad(true);
    }
    tch::manual_seed(99);
    // A bias large enough to change some tokens' choice.
    let expert_bias = layer.router.expert_bias.as_ref().map(|bias| {
        let values = Tensor::randn([config.num_experts], (Kind::Float, Device::Cpu)) * 0.2;
        tch::no_grad(|| bias.bias.shallow_clone().copy_(&values));
        Vec::<f32>::try_from(&values).unwrap()
    });
    let x = Tensor::randn([SEQ, BATCH, HIDDEN], (Kind::Float, Device::Cpu));
    if routing == Routing::OnlyExpertsZeroAndOne {
        tch::no_grad(|| {
            let weight = layer.router.weight.tensor();
            let _ = weight.shallow_clone().zero_();
            let _ = weight.get(0).get(0).fill_(1.0);
            let _ = weight.get(1).get(0).fill_(0.8);
            let _ = x.select(2, 0).fill_(10.0);
        });
    }
    let g = Tensor::randn([SEQ, BATCH, HIDDEN], (Kind::Float, Device::Cpu));
    let input = x.copy().set_requires_grad(true);
    assert_eq!(
        layer.experts.runs_grouped(&input),
        config.grouped_gemm,
        "{case}: whether the experts run as a grouped GEMM"
    );

    take_tracked_losses();
    let y = layer.forward(&input, true).unwrap();
    (&y * &g).sum(Kind::Float).backward();
    let tracked = take_tracked_losses();

    let dir = tempfile::tempdir().unwrap();
    let mut inputs: Vec<(String, Tensor)> = params
        .iter()
        .map(|p| (p.name.clone(), p.tensor.detach()))
        .collect();
    inputs.push(("x".into(), x));
    inputs.push(("g".into(), g));
    Tensor::write_safetensors(&inputs, dir.path().join("inputs.safetensors")).unwrap();
    let load_balancing = match config.load_balancing {
        LoadBalancing::AuxLoss => "aux_loss",
        LoadBalancing::SeqAuxLoss => "seq_aux_loss",
        LoadBalancing::None => "none",
    };
    let settings = json!({
        "num_experts": config.num_experts,
        "topk": config.topk,
        "score_function": match config.score_function {
            ScoreFunction::Softmax => "softmax",
            ScoreFunction::Sigmoid => "sigmoid",
        },
        "pre_softmax": config.pre_softmax,
        "topk_scaling_factor": config.topk_scaling_factor,
        "load_balancing": load_balancing,
        "aux_loss_coeff": config.aux_loss_coeff,
        "z_loss_coeff": config.z_loss_coeff,
        "seq_length": SEQ,
        "aux_backward_scale": AUX_SCALE,
        "expert_bias": expert_bias,
        "capacity_factor": config.capacity.map(|c| c.factor),
        "drop_policy": config.capacity.map(|c| match c.drop_policy {
            DropPolicy::Probs => "probs",
            DropPolicy::Position => "position",
        }),
        "pad_to_capacity": config.capacity.is_some_and(|c| c.pad_to_capacity),
    });
    std::fs::write(dir.path().join("config.json"), settings.to_string()).unwrap();
    let out = Command::new(python())
        .arg(reference_script())
        .arg(dir.path())
        .output()
        .expect("running the reference script");
    assert!(
        out.status.success(),
        "{case}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut reference: HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.path().join("outputs.safetensors"))
            .unwrap()
            .into_iter()
            .collect();

    let close = |what: &str, ours: &Tensor, theirs: &Tensor| {
        assert_eq!(ours.size(), theirs.size(), "{case}: {what} shape");
        let diff = (ours - theirs).abs().max().double_value(&[]);
        assert!(diff <= 1e-5, "{case}: {what} differs by {diff}");
    };
    close("output", &y.detach(), &reference["y"]);
    if let Some(bias) = &layer.router.expert_bias {
        close(
            "tokens counted per expert",
            &bias.tokens,
            &reference["tokens_per_expert"],
        );
    }
    close("input gradient", &input.grad(), &reference["grad.x"]);
    for param in &params {
        let grad = param.tensor.grad();
        assert!(grad.defined(), "{case}: {} has no gradient", param.name);
        close(
            &format!("gradient of {}", param.name),
            &grad,
            &reference[&format!("grad.{}", param.name)],
        );
    }
    if routing == Routing::OnlyExpertsZeroAndOne {
        for param in params
            .iter()
            .filter(|p| p.name.contains("local_experts.2.") || p.name.contains("local_experts.3."))
        {
            assert_eq!(
                param.tensor.grad().abs().sum(Kind::Float).double_value(&[]),
                0.0,
                "{case}: {} got a gradient without tokens",
                param.name
            );
        }
    }
    let losses = ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"];
    for name in losses {
        match (tracked.get(name), reference.get(name)) {
            (Some(ours), Some(theirs)) => {
                let theirs = theirs.double_value(&[0]);
                assert!(
                    (ours - theirs).abs() <= 1e-6,
                    "{case}: {name} {ours} vs {theirs}"
                );
            }
            (None, None) => {}
            (ours, theirs) => panic!("{case}: {name} ours {ours:?}, reference {theirs:?}"),
        }
    }
    reference.insert("ours.y".into(), y.detach());
    reference
}

#[test]
fn moe_layer_matches_megatrons_definitions_in_value_and_gradient() {
    set_aux_loss_backward_scale(AUX_SCALE);
    let cases = [
        ("top-1 softmax", moe(1)),
        ("top-2 softmax", moe(2)),
        (
            "top-2 pre-softmax scaled",
            MoeConfig {
                pre_softmax: true,
                topk_scaling_factor: Some(2.5),
                ..moe(2)
            },
        ),
        (
            "top-2 sigmoid with z-loss",
            MoeConfig {
                score_function: ScoreFunction::Sigmoid,
                z_loss_coeff: Some(1e-3),
                ..moe(2)
            },
        ),
        (
            "top-1 sigmoid",
            MoeConfig {
                score_function: ScoreFunction::Sigmoid,
                ..moe(1)
            },
        ),
        (
            "top-2 per-sequence balancing, shared expert",
            MoeConfig {
                load_balancing: LoadBalancing::SeqAuxLoss,
                shared_expert_intermediate_size: Some(20),
                ..moe(2)
            },
        ),
        (
            "top-3 without balancing",
            MoeConfig {
                load_balancing: LoadBalancing::None,
                ..moe(3)
            },
        ),
    ];
    for (case, config) in cases {
        compare(case, config);
    }
}

/// Experts that receive no tokens run on an empty batch: the layer still matches the
/// reference, and their gradients are zero.
#[test]
fn experts_without_tokens_work() {
    set_aux_loss_backward_scale(AUX_SCALE);
    let config = MoeConfig {
        z_loss_coeff: Some(1e-3),
        ..moe(2)
    };
    compare_routed("degenerate routing", config, Routing::OnlyExpertsZeroAndOne);
}

/// `--moe-grouped-gemm` (libtorch's grouped GEMM, which runs on the CPU in float32 too)
/// matches the same definitions, experts without tokens included.
#[test]
fn grouped_gemm_experts_match_megatrons_definitions() {
    set_aux_loss_backward_scale(AUX_SCALE);
    let grouped = |config: MoeConfig| MoeConfig {
        grouped_gemm: true,
        ..config
    };
    compare("grouped top-1 softmax", grouped(moe(1)));
    compare(
        "grouped top-2 sigmoid with z-loss",
        grouped(MoeConfig {
            score_function: ScoreFunction::Sigmoid,
            z_loss_coeff: Some(1e-3),
            ..moe(2)
        }),
    );
    compare_routed(
        "grouped, degenerate routing",
        grouped(moe(2)),
        Routing::OnlyExpertsZeroAndOne,
    );
}

/// `--moe-router-enable-expert-bias`: the bias picks the experts, the probabilities stay the
/// sigmoid scores, and the router counts the tokens it sent to each expert.
#[test]
fn expert_bias_steers_the_choice_only() {
    set_aux_loss_backward_scale(AUX_SCALE);
    let biased = |topk| MoeConfig {
        score_function: ScoreFunction::Sigmoid,
        expert_bias_update_rate: Some(1e-3),
        ..moe(topk)
    };
    compare("sigmoid top-2 with expert bias", biased(2));
    compare("sigmoid top-1 with expert bias", biased(1));
}

/// `--moe-expert-capacity-factor`: Megatron's capacity with either drop policy, with and
/// without padding (the padded case counted through the expert bias, which sees every expert
/// at its capacity), and beside the grouped GEMM.
#[test]
fn expert_capacity_drops_and_pads_as_megatron() {
    set_aux_loss_backward_scale(AUX_SCALE);
    let with_capacity = |factor, drop_policy, pad_to_capacity| MoeConfig {
        capacity: Some(Capacity {
            factor,
            drop_policy,
            pad_to_capacity,
        }),
        ..moe(2)
    };
    compare(
        "capacity 0.75, drop by probability",
        with_capacity(0.75, DropPolicy::Probs, false),
    );
    compare(
        "capacity 0.75, drop by position",
        with_capacity(0.75, DropPolicy::Position, false),
    );
    compare(
        "capacity 1.0, by probability, padded, grouped GEMM",
        MoeConfig {
            grouped_gemm: true,
            ..with_capacity(1.0, DropPolicy::Probs, true)
        },
    );
    let reference = compare(
        "capacity 0.5, by position, padded, expert bias",
        MoeConfig {
            score_function: ScoreFunction::Sigmoid,
            expert_bias_update_rate: Some(1e-3),
            ..with_capacity(0.5, DropPolicy::Position, true)
        },
    );
    // 18 tokens top-2 over 4 experts at 0.5: ceil(18 · 2 / 4 · 0.5) = 5 each.
    let counted = Vec::<f32>::try_from(&reference["tokens_per_expert"]).unwrap();
    assert_eq!(counted, [5.0; 4]);
}

#[test]
fn moe_layer_equals_transformers_mixtral_block() {
    for topk in [1, 2] {
        let case = format!("mixtral top-{topk}");
        let config = MoeConfig {
            load_balancing: LoadBalancing::None,
            ..moe(topk)
        };
        let reference = compare(&case, config);
        let ours = &reference["ours.y"];
        let hf = reference.get("y_hf").expect("the reference ran Mixtral");
        let diff = (ours - hf).abs().max().double_value(&[]);
        assert!(diff <= 1e-5, "{case}: Mixtral differs by {diff}");
    }
}
