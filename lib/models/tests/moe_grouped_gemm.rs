//! `--moe-grouped-gemm` against the per-expert loop on the same weights and input: the output
//! and the gradients of the input, the router and every expert. On the CPU in float32
//! (libtorch's grouped GEMM runs there too) they agree within 1e-5, for SwiGLU and GeLU experts
//! and with experts that receive no tokens; on a GPU in bf16 (Hopper's grouped kernel against
//! cuBLAS per expert) within bf16's rounding.

use std::sync::Arc;

use megatron_models::layers::moe::aux_loss::set_aux_loss_backward_scale;
use megatron_models::layers::moe::config::{
    Capacity, DropPolicy, LoadBalancing, MoeConfig, ScoreFunction, TokenDispatcher,
};
use megatron_models::layers::moe::{host_wait_reason, GroupOrder};
use megatron_models::layers::{MoeLayer, NamedParameter, NamedTensors, TensorParallel};
use megatron_models::param::Initializer;
use megatron_models::{Activation, Normalization, TransformerConfig};
use megatron_parallel::SingleRank;
use tch::{Device, Kind, Tensor};

fn trunk(hidden: i64, activation: Activation) -> TransformerConfig {
    TransformerConfig {
        num_layers: 1,
        hidden_size: hidden,
        num_attention_heads: 2,
        num_query_groups: 2,
        kv_channels: hidden / 2,
        ffn_hidden_size: 2 * hidden,
        activation,
        normalization: Normalization::RMSNorm,
        add_bias_linear: false,
        add_qkv_bias: false,
        init_method_std: 0.3,
        ..TransformerConfig::gpt_345m()
    }
}

fn moe(experts: i64, ffn: i64, topk: i64, grouped_gemm: bool) -> MoeConfig {
    MoeConfig {
        num_experts: experts,
        ffn_hidden_size: ffn,
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
        grouped_gemm,
    }
}

/// What one forward and backward gives: the output, the input's gradient, and each
/// parameter's gradient by name.
struct Pass {
    output: Tensor,
    input_grad: Tensor,
    grads: Vec<(String, Tensor)>,
}

#[derive(Clone, Copy)]
struct Case {
    hidden: i64,
    ffn: i64,
    experts: i64,
    topk: i64,
    tokens: [i64; 2],
    activation: Activation,
    /// Every token sent to experts 0 and 1 only, the others getting none.
    only_two_experts: bool,
    /// The parameters moved into one buffer as the optimizer lays them out (Megatron's
    /// reversed order, aligned offsets), where the grouped GEMMs read the experts' weights in
    /// descending order.
    optimizer_layout: bool,
}

/// Moves `params` into one flat buffer as the optimizer does: in reverse, each at an offset of
/// a multiple of 64 elements, each parameter becoming a view of the buffer.
fn lay_out_as_the_optimizer(params: &[NamedParameter]) {
    let aligned = |n: i64| (n + 63) / 64 * 64;
    let total: i64 = params
        .iter()
        .map(|p| aligned(p.tensor.numel() as i64))
        .sum();
    let first = &params[0].tensor;
    let buffer = Tensor::zeros([total], (first.kind(), first.device()));
    let mut offset = 0;
    for param in params.iter().rev() {
        let numel = param.tensor.numel() as i64;
        let place = buffer
            .narrow(0, offset, numel)
            .view(param.tensor.size().as_slice());
        tch::no_grad(|| place.shallow_clone().copy_(&param.tensor));
        param.tensor.shallow_clone().set_data(&place);
        offset += aligned(numel);
    }
}

fn run(case: &Case, grouped_gemm: bool, kind: Kind, device: Device) -> Pass {
    let init = Initializer::new(kind, device, 0, 1, 1234).scope("mlp");
    let parallel = TensorParallel {
        group: Arc::new(SingleRank),
        sequence_parallel: false,
    };
    let config = moe(case.experts, case.ffn, case.topk, grouped_gemm);
    let layer = MoeLayer::new(
        &init,
        &trunk(case.hidden, case.activation),
        &config,
        0.2,
        parallel,
        Arc::new(SingleRank),
    );
    let mut params: Vec<NamedParameter> = Vec::new();
    layer.named_tensors(&mut NamedTensors::new(&mut params));
    if case.optimizer_layout {
        lay_out_as_the_optimizer(&params);
    }
    tch::manual_seed(99);
    let shape = [case.tokens[0], case.tokens[1], case.hidden];
    let x = Tensor::randn(shape, (Kind::Float, device));
    if case.only_two_experts {
        tch::no_grad(|| {
            let weight = layer.router.weight.tensor();
            let _ = weight.shallow_clone().zero_();
            let _ = weight.get(0).get(0).fill_(1.0);
            let _ = weight.get(1).get(0).fill_(0.8);
            let _ = x.select(2, 0).fill_(10.0);
        });
    }
    let g = Tensor::randn(shape, (Kind::Float, device));
    let input = x.to_kind(kind).set_requires_grad(true);
    assert_eq!(
        layer.experts.runs_grouped(&input),
        grouped_gemm,
        "whether the grouped kernel runs"
    );
    // The experts' weights are read where they lie, in their order there (no copy).
    let order = match case.optimizer_layout {
        true => GroupOrder::Descending,
        false => GroupOrder::Ascending,
    };
    assert_eq!(
        layer.experts.grouped_order(&input).unwrap(),
        grouped_gemm.then_some(order)
    );
    let y = layer.forward(&input, true).unwrap();
    (y.to_kind(Kind::Float) * &g).sum(Kind::Float).backward();
    Pass {
        output: y.detach().to_kind(Kind::Float),
        input_grad: input.grad().to_kind(Kind::Float),
        grads: params
            .iter()
            .map(|p| {
                let grad = p.tensor.grad();
                assert!(grad.defined(), "{} has no gradient", p.name);
                (p.name.clone(), grad.to_kind(Kind::Float))
            })
            .collect(),
    }
}

/// The grouped and the looped passes agree: each tensor's largest difference at most
/// `tolerance` times its largest magnitude (at least 1).
fn assert_agree(what: &str, grouped: &Pass, looped: &Pass, tolerance: f64) {
    let close = |name: &str, ours: &Tensor, theirs: &Tensor| {
        assert_eq!(ours.size(), theirs.size(), "{what}: {name} shape");
        let scale = theirs.abs().max().double_value(&[]).max(1.0);
        let diff = (ours - theirs).abs().max().double_value(&[]);
        assert!(
            diff <= tolerance * scale,
            "{what}: {name} differs by {diff} (largest magnitude {scale})"
        );
    };
    close("output", &grouped.output, &looped.output);
    close("input gradient", &grouped.input_grad, &looped.input_grad);
    assert_eq!(grouped.grads.len(), looped.grads.len());
    for ((name, ours), (other, theirs)) in grouped.grads.iter().zip(&looped.grads) {
        assert_eq!(name, other);
        close(&format!("gradient of {name}"), ours, theirs);
    }
}

#[test]
fn grouped_gemm_equals_the_per_expert_loop_in_float32() {
    set_aux_loss_backward_scale(0.375);
    let base = Case {
        hidden: 16,
        ffn: 12,
        experts: 4,
        topk: 2,
        tokens: [6, 3],
        activation: Activation::Swiglu,
        only_two_experts: false,
        optimizer_layout: false,
    };
    let cases = [
        ("SwiGLU top-2", base),
        (
            "SwiGLU top-2, in the optimizer's buffer",
            Case {
                optimizer_layout: true,
                ..base
            },
        ),
        (
            "experts without tokens, in the optimizer's buffer",
            Case {
                only_two_experts: true,
                optimizer_layout: true,
                ..base
            },
        ),
        (
            "GeLU top-1",
            Case {
                activation: Activation::GeluTanh,
                topk: 1,
                ..base
            },
        ),
        (
            "SwiGLU, experts without tokens",
            Case {
                only_two_experts: true,
                ..base
            },
        ),
        (
            "eight experts top-3",
            Case {
                experts: 8,
                topk: 3,
                tokens: [10, 2],
                ..base
            },
        ),
    ];
    for (what, case) in cases {
        let grouped = run(&case, true, Kind::Float, Device::Cpu);
        let looped = run(&case, false, Kind::Float, Device::Cpu);
        assert_agree(what, &grouped, &looped, 1e-5);
    }
}

/// Widths whose rows are not a multiple of 16 bytes are not the kernel's: the experts run one
/// after the other, with the same results.
#[test]
fn unaligned_experts_fall_back_to_the_loop() {
    let case = Case {
        hidden: 16,
        ffn: 6,
        experts: 4,
        topk: 2,
        tokens: [4, 2],
        activation: Activation::GeluTanh,
        only_two_experts: false,
        optimizer_layout: false,
    };
    let init = Initializer::new(Kind::Float, Device::Cpu, 0, 1, 1).scope("mlp");
    let layer = MoeLayer::new(
        &init,
        &trunk(case.hidden, case.activation),
        &moe(case.experts, case.ffn, case.topk, true),
        0.2,
        TensorParallel {
            group: Arc::new(SingleRank),
            sequence_parallel: false,
        },
        Arc::new(SingleRank),
    );
    let x = Tensor::randn([4, 2, 16], (Kind::Float, Device::Cpu));
    assert!(!layer.experts.runs_grouped(&x));
    let y = layer.forward(&x, false).unwrap();
    assert_eq!(y.size(), [4, 2, 16]);
}

/// A CUDA graph may hold the MoE layers `host_wait_reason` clears: dropless routing on one
/// expert-parallel rank with the experts as grouped GEMMs in a dtype and shape the kernel
/// takes. On the CPU, where the kernel also runs in float32, the verdict is the layer's own
/// choice of the grouped path.
#[test]
fn only_dropless_grouped_experts_on_one_rank_keep_their_counts_on_the_device() {
    let model = |moe: MoeConfig| TransformerConfig {
        moe: Some(moe),
        ..trunk(64, Activation::Swiglu)
    };
    let gpu = Device::Cuda(0);
    let grouped = model(moe(4, 48, 2, true));
    assert_eq!(host_wait_reason(&grouped, Kind::BFloat16, gpu, 1), None);
    assert_eq!(
        host_wait_reason(&trunk(64, Activation::Swiglu), Kind::Half, gpu, 2),
        None,
        "a dense model"
    );
    let waits = [
        ("fp16", grouped.clone(), Kind::Half, 1),
        ("float32 on a GPU", grouped.clone(), Kind::Float, 1),
        ("expert parallelism", grouped.clone(), Kind::BFloat16, 2),
        (
            "the per-expert loop",
            model(moe(4, 48, 2, false)),
            Kind::BFloat16,
            1,
        ),
        // 44 bf16 elements are 88 bytes, not a multiple of 16.
        (
            "unaligned experts",
            model(moe(4, 44, 2, true)),
            Kind::BFloat16,
            1,
        ),
        (
            "an expert capacity",
            model(MoeConfig {
                capacity: Some(Capacity {
                    factor: 1.0,
                    drop_policy: DropPolicy::Probs,
                    pad_to_capacity: true,
                }),
                ..moe(4, 48, 2, true)
            }),
            Kind::BFloat16,
            1,
        ),
    ];
    for (what, config, kind, expert_parallel) in waits {
        assert!(
            host_wait_reason(&config, kind, gpu, expert_parallel).is_some(),
            "{what}"
        );
    }
    for (kind, ffn, grouped_gemm) in [
        (Kind::Float, 48, true),
        (Kind::BFloat16, 48, true),
        (Kind::BFloat16, 44, true),
        (Kind::Float, 42, true),
        (Kind::Float, 48, false),
    ] {
        let config = moe(4, ffn, 2, grouped_gemm);
        let layer = MoeLayer::new(
            &Initializer::new(kind, Device::Cpu, 0, 1, 5).scope("mlp"),
            &trunk(64, Activation::Swiglu),
            &config,
            0.2,
            TensorParallel {
                group: Arc::new(SingleRank),
                sequence_parallel: false,
            },
            Arc::new(SingleRank),
        );
        let tokens = Tensor::zeros([6, 64], (kind, Device::Cpu));
        assert_eq!(
            host_wait_reason(&model(config), kind, Device::Cpu, 1).is_none(),
            layer.experts.runs_grouped(&tokens),
            "{kind:?}, experts of width {ffn}, grouped GEMM {grouped_gemm}"
        );
    }
}

/// On a GPU in bf16, Hopper's grouped kernel: a Mixtral-like layer of 8 experts (top-2) over
/// 2048 tokens, with experts that receive no tokens too.
#[test]
fn grouped_gemm_equals_the_per_expert_loop_in_bf16_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    set_aux_loss_backward_scale(1.0);
    let base = Case {
        hidden: 256,
        ffn: 512,
        experts: 8,
        topk: 2,
        tokens: [512, 4],
        activation: Activation::Swiglu,
        only_two_experts: false,
        optimizer_layout: false,
    };
    for (what, case) in [
        ("bf16 SwiGLU top-2", base),
        (
            "bf16, experts without tokens",
            Case {
                only_two_experts: true,
                ..base
            },
        ),
        (
            "bf16, in the optimizer's buffer",
            Case {
                optimizer_layout: true,
                ..base
            },
        ),
    ] {
        let device = Device::Cuda(0);
        let grouped = run(&case, true, Kind::BFloat16, device);
        let looped = run(&case, false, Kind::BFloat16, device);
        assert_agree(what, &grouped, &looped, 2e-2);
    }
}
