//! Expert parallelism in the Mixture-of-Experts layer, on ranks-as-threads: two ranks, each
//! holding two of four experts and routing its own tokens, give every rank the output, input
//! gradient and router gradient one rank holding all four experts gives on the same tokens,
//! and each expert the gradient summed over both ranks' tokens, with either dispatcher, and
//! when all tokens go to the experts of one rank (the other receives none, Megatron #1877).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use megatron_models::layers::moe::aux_loss::{set_aux_loss_backward_scale, take_tracked_losses};
use megatron_models::layers::moe::config::{
    LoadBalancing, MoeConfig, ScoreFunction, TokenDispatcher,
};
use megatron_models::layers::{MoeLayer, NamedParameter, NamedTensors, TensorParallel};
use megatron_models::param::Initializer;
use megatron_models::TransformerConfig;
use megatron_models::{Activation, Normalization};
use megatron_parallel::{Communicator, SingleRank, ThreadWorld};
use tch::{Device, Kind, Tensor};

const HIDDEN: i64 = 16;
const SEQ: i64 = 6;
const BATCH: i64 = 3;
const RANKS: usize = 2;

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

fn moe(dispatcher: TokenDispatcher) -> MoeConfig {
    MoeConfig {
        num_experts: 4,
        ffn_hidden_size: 12,
        layer_pattern: vec![true],
        topk: 2,
        score_function: ScoreFunction::Softmax,
        pre_softmax: false,
        topk_scaling_factor: None,
        router_dtype: None,
        load_balancing: LoadBalancing::AuxLoss,
        aux_loss_coeff: 0.01,
        z_loss_coeff: Some(1e-3),
        shared_expert_intermediate_size: None,
        shared_expert_gate: false,
        token_dispatcher: dispatcher,
        grouped_gemm: false,
        capacity: None,
        expert_bias_update_rate: None,
    }
}

/// What one rank computed: its output, its input's gradient, its parameters' gradients by
/// name, and its auxiliary losses.
struct RankResult {
    y: Tensor,
    dx: Tensor,
    grads: HashMap<String, Tensor>,
    losses: Vec<(&'static str, f64)>,
}

/// Each rank's tokens and output gradient `[SEQ, BATCH, HIDDEN]`, drawn before any rank runs
/// (the ranks' threads share libtorch's generator), as plain values the threads can share.
fn inputs() -> Vec<(Vec<f32>, Vec<f32>)> {
    tch::manual_seed(100);
    let draw = || {
        let t = Tensor::randn([SEQ * BATCH * HIDDEN], (Kind::Float, Device::Cpu));
        Vec::<f32>::try_from(&t).unwrap()
    };
    (0..RANKS).map(|_| (draw(), draw())).collect()
}

/// Runs the layer of `config` over `experts` on rank `rank`'s tokens; with `degenerate`,
/// every token's first channel large and the router reading only it, so that every token
/// picks experts 0 and 1.
fn run(
    config: &MoeConfig,
    experts: Arc<dyn Communicator>,
    (x, g): &(Vec<f32>, Vec<f32>),
    degenerate: bool,
) -> anyhow::Result<RankResult> {
    set_aux_loss_backward_scale(0.375);
    let init = Initializer::new(Kind::Float, Device::Cpu, 0, 1, 1234).scope("mlp");
    let parallel = TensorParallel {
        group: Arc::new(SingleRank),
        sequence_parallel: false,
    };
    let layer = MoeLayer::new(&init, &trunk(), config, 0.2, parallel, experts);
    let mut params: Vec<NamedParameter> = Vec::new();
    layer.named_tensors(&mut NamedTensors::new(&mut params));
    for param in &params {
        let _ = param.tensor.shallow_clone().set_requires_grad(true);
    }
    let x = Tensor::from_slice(x).view([SEQ, BATCH, HIDDEN]);
    let g = Tensor::from_slice(g).view([SEQ, BATCH, HIDDEN]);
    if degenerate {
        tch::no_grad(|| {
            let weight = layer.router.weight.tensor();
            let _ = weight.shallow_clone().zero_();
            let _ = weight.get(0).get(0).fill_(1.0);
            let _ = weight.get(1).get(0).fill_(0.8);
            let _ = x.select(2, 0).fill_(10.0);
        });
    }
    let input = x.set_requires_grad(true);
    take_tracked_losses();
    let y = layer.forward(&input, true)?;
    (&y * &g).sum(Kind::Float).backward();
    let losses = take_tracked_losses().into_iter().collect();
    Ok(RankResult {
        y: y.detach(),
        dx: input.grad(),
        grads: params
            .iter()
            .map(|p| (p.name.clone(), p.tensor.grad()))
            .collect(),
        losses,
    })
}

/// Within 1e-5 of the largest reference value: the sums over tokens run in other orders.
fn assert_close(what: &str, ours: &Tensor, reference: &Tensor) {
    assert_eq!(ours.size(), reference.size(), "{what}");
    let scale = reference.abs().max().double_value(&[]).max(1e-12);
    let diff = (ours - reference).abs().max().double_value(&[]);
    assert!(
        diff <= 1e-5 * scale,
        "{what} differs by {diff:e} (largest value {scale:e})"
    );
}

fn compare(dispatcher: TokenDispatcher, degenerate: bool) {
    let case = format!("{dispatcher:?}, degenerate routing {degenerate}");
    let config = moe(dispatcher);
    // The reference: one rank with every expert, over each rank's tokens in turn.
    let inputs = inputs();
    let references: Vec<RankResult> = inputs
        .iter()
        .map(|input| run(&config, Arc::new(SingleRank), input, degenerate).unwrap())
        .collect();
    let world = ThreadWorld::new(RANKS, Duration::from_secs(60));
    let parallel = world
        .run(|rank| {
            let group = world.group("expert", &[0, 1], rank)?;
            run(&config, group, &inputs[rank], degenerate)
        })
        .unwrap();
    for (rank, (ours, reference)) in parallel.iter().zip(&references).enumerate() {
        assert_close(
            &format!("{case}: rank {rank} output"),
            &ours.y,
            &reference.y,
        );
        assert_close(
            &format!("{case}: rank {rank} input gradient"),
            &ours.dx,
            &reference.dx,
        );
        let router = "router.weight";
        assert_close(
            &format!("{case}: rank {rank} router gradient"),
            &ours.grads[router],
            &reference.grads[router],
        );
        assert_eq!(ours.losses.len(), 2, "{case}: {:?}", ours.losses);
        for ((name, ours), (_, theirs)) in ours.losses.iter().zip(&reference.losses) {
            assert!((ours - theirs).abs() <= 1e-6, "{case}: rank {rank} {name}");
        }
        // This rank holds experts 2·rank and 2·rank + 1, under their global names; each one's
        // gradient sums both ranks' tokens.
        let experts: Vec<&String> = ours
            .grads
            .keys()
            .filter(|name| name.starts_with("experts."))
            .collect();
        assert_eq!(experts.len(), 4, "{case}: {experts:?}");
        for name in experts {
            let e: usize = name.split('.').nth(2).unwrap().parse().unwrap();
            assert_eq!(e / 2, rank, "{case}: rank {rank} holds {name}");
            let summed = &references[0].grads[name] + &references[1].grads[name];
            assert_close(&format!("{case}: {name}"), &ours.grads[name], &summed);
            if degenerate && e >= 2 {
                assert_eq!(
                    ours.grads[name].abs().max().double_value(&[]),
                    0.0,
                    "{case}: {name} received no tokens"
                );
            }
        }
    }
}

#[test]
fn all_to_all_dispatch_over_two_ranks_equals_one_rank() {
    compare(TokenDispatcher::Alltoall, false);
}

#[test]
fn all_gather_dispatch_over_two_ranks_equals_one_rank() {
    compare(TokenDispatcher::Allgather, false);
}

/// Every token picks experts 0 and 1, both on rank 0: rank 1 receives no tokens.
#[test]
fn a_rank_whose_experts_receive_no_tokens_works() {
    compare(TokenDispatcher::Alltoall, true);
    compare(TokenDispatcher::Allgather, true);
}
