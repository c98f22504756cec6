//! Reshaping our checkpoints: TP2·PP2 (also interleaved) → TP1·PP1 → TP2·PP2 gives back the
//! same files bit for bit — weights and the optimizer's float32 main parameters and Adam
//! moments — for SwiGLU, GQA, untied embeddings and a vocabulary whose padding changes with TP;
//! and a Mixture-of-Experts model's routers' expert biases kept through our format and
//! Megatron's two.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use megatron_checkpoint::{DType, DistCheckpoint, TorchFile};
use megatron_convert::{
    in_memory, load_megatron_rs, load_megatron_torch, load_torch_dist, reporting_progress,
    save_megatron_rs, save_megatron_torch_dist, save_megatron_torch_experts, ConversionProgress,
    LoadOptions, ModelState, OptimizerState, RunState, TargetLayout,
};
use megatron_models::layers::moe::config::{LoadBalancing, MoeConfig, ScoreFunction};
use megatron_models::{
    Activation, GptModel, ModelOptions, Normalization, PositionEmbeddingType, Recompute,
    TransformerConfig,
};
use megatron_parallel::ParallelState;
use megatron_store::{find_checkpoint, read_tensors};
use tch::{Device, Kind, Tensor};

fn llama_like(tied: bool) -> TransformerConfig {
    TransformerConfig {
        num_layers: 4,
        hidden_size: 32,
        num_attention_heads: 4,
        num_query_groups: 2,
        kv_channels: 8,
        ffn_hidden_size: 48,
        max_position_embeddings: 32,
        // Padded to 1152 for one rank, 1280 for two.
        vocab_size: 1100,
        make_vocab_size_divisible_by: 128,
        position_embedding_type: PositionEmbeddingType::Rope,
        rotary_base: 10000.0,
        rope_scaling: None,
        rotary_percent: 1.0,
        normalization: Normalization::RMSNorm,
        norm_epsilon: 1e-5,
        apply_layernorm_1p: false,
        activation: Activation::Swiglu,
        add_bias_linear: false,
        add_qkv_bias: false,
        untie_embeddings_and_output_weights: !tied,
        apply_residual_connection_post_layernorm: false,
        hidden_dropout: 0.0,
        attention_dropout: 0.0,
        init_method_std: 0.02,
        qk_layernorm: false,
        moe: None,
    }
}

/// A random model with random Adam state, as a converter's in-memory state.
fn random_state(config: TransformerConfig) -> ModelState {
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 7,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = GptModel::new(config.clone(), options, &ParallelState::single()).unwrap();
    let weights: BTreeMap<String, Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|p| (p.name, p.tensor.detach().copy()))
        .collect();
    let random = |scale: f64| -> BTreeMap<String, Tensor> {
        weights
            .iter()
            .map(|(k, v)| (k.clone(), v.randn_like() * scale))
            .collect()
    };
    let optimizer = OptimizerState {
        step: 5.0,
        main: in_memory(weights.iter().map(|(k, v)| (k.clone(), v.copy()))),
        exp_avg: in_memory(random(1e-3)),
        exp_avg_sq: in_memory(random(1e-3).into_iter().map(|(k, v)| (k, v.square()))),
    };
    ModelState {
        config,
        params_dtype: "float32".into(),
        weights: in_memory(weights),
        expert_biases: Default::default(),
        optimizer: Some(optimizer),
        run: RunState {
            iteration: 5,
            consumed_train_samples: 40,
            ..Default::default()
        },
        source_parallel: (1, 1),
        source: "random test model".into(),
    }
}

/// Every tensor of every file under `root`'s iteration directory.
fn files(root: &Path) -> BTreeMap<String, BTreeMap<String, Tensor>> {
    let checkpoint = find_checkpoint(root).unwrap().unwrap();
    let mut out = BTreeMap::new();
    for rank in std::fs::read_dir(&checkpoint.directory)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
    {
        for file in std::fs::read_dir(rank.path()).unwrap().flatten() {
            let name = format!(
                "{}/{}",
                rank.file_name().to_string_lossy(),
                file.file_name().to_string_lossy()
            );
            out.insert(
                name,
                read_tensors(&file.path(), Device::Cpu)
                    .unwrap()
                    .0
                    .into_iter()
                    .collect(),
            );
        }
    }
    out
}

fn reshape(from: &Path, to: &Path, target: TargetLayout) {
    let state = load_megatron_rs(&find_checkpoint(from).unwrap().unwrap(), true).unwrap();
    save_megatron_rs(&state, to, target).unwrap();
}

fn round_trip(config: TransformerConfig, virtual_stages: usize) {
    let dir = tempfile::tempdir().unwrap();
    let layout = TargetLayout {
        tensor: 2,
        pipeline: 2,
        virtual_stages,
    };
    let single = TargetLayout {
        tensor: 1,
        pipeline: 1,
        virtual_stages: 1,
    };
    let (a, b, c) = (
        dir.path().join("a"),
        dir.path().join("b"),
        dir.path().join("c"),
    );
    save_megatron_rs(&random_state(config), &a, layout).unwrap();
    reshape(&a, &b, single);
    reshape(&b, &c, layout);
    let (first, last) = (files(&a), files(&c));
    assert_eq!(
        first.keys().collect::<Vec<_>>(),
        last.keys().collect::<Vec<_>>()
    );
    assert!(first.keys().any(|k| k.ends_with("optimizer.safetensors")));
    for (file, tensors) in &first {
        assert_eq!(
            tensors.keys().collect::<Vec<_>>(),
            last[file].keys().collect::<Vec<_>>(),
            "{file}"
        );
        for (name, tensor) in tensors {
            assert!(
                tensor.equal(&last[file][name]),
                "{file}: {name} changed in the round trip"
            );
        }
    }
    let metadata = find_checkpoint(&b).unwrap().unwrap().metadata;
    assert_eq!(
        (
            metadata.tensor_model_parallel_size,
            metadata.pipeline_model_parallel_size
        ),
        (1, 1)
    );
    assert_eq!(
        (metadata.iteration, metadata.consumed_train_samples),
        (5, 40)
    );
}

#[test]
fn tp2_pp2_round_trips_bitwise_untied() {
    round_trip(llama_like(false), 1);
}

#[test]
fn tp2_pp2_interleaved_round_trips_bitwise_tied() {
    round_trip(llama_like(true), 2);
}

/// The byte counts a conversion reported, in order.
#[derive(Default)]
struct Reports(RefCell<Vec<u64>>);

impl ConversionProgress for Reports {
    fn total(&self, _: u64) {}
    fn written(&self, bytes: u64) {
        self.0.borrow_mut().push(bytes);
    }
}

#[test]
fn a_save_reports_its_tensor_bytes_as_it_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let state = random_state(llama_like(false));
    let single = TargetLayout {
        tensor: 1,
        pipeline: 1,
        virtual_stages: 1,
    };
    let reports = Rc::new(Reports::default());
    reporting_progress(reports.clone(), || {
        save_megatron_rs(&state, &dir.path().join("out"), single)
    })
    .unwrap();
    let written = reports.0.borrow().clone();
    // Weights and the three Adam buffers of every parameter, a report per tensor at least.
    assert!(
        written.len() >= 4 * state.weights.len(),
        "{}",
        written.len()
    );
    assert_eq!(written.iter().sum::<u64>(), state.bytes() as u64);
    // Outside `reporting_progress` nothing is reported.
    save_megatron_rs(&state, &dir.path().join("again"), single).unwrap();
    assert_eq!(reports.0.borrow().len(), written.len());
}

/// A model of two MoE layers (four experts, top-2, sigmoid scores) whose routers keep expert
/// biases (`--moe-router-enable-expert-bias`), random as the router's updates leave them.
fn with_expert_biases() -> ModelState {
    let mut config = llama_like(false);
    config.num_layers = 2;
    config.moe = Some(MoeConfig {
        num_experts: 4,
        ffn_hidden_size: 16,
        layer_pattern: vec![true, true],
        topk: 2,
        score_function: ScoreFunction::Sigmoid,
        pre_softmax: false,
        topk_scaling_factor: None,
        router_dtype: None,
        load_balancing: LoadBalancing::None,
        aux_loss_coeff: 0.0,
        z_loss_coeff: None,
        shared_expert_intermediate_size: None,
        capacity: None,
        expert_bias_update_rate: Some(1e-3),
        shared_expert_gate: false,
        token_dispatcher: Default::default(),
        grouped_gemm: false,
    });
    let mut state = random_state(config);
    state.expert_biases = in_memory((0..2).map(|layer| {
        (
            format!("decoder.layers.{layer}.mlp.router.expert_bias"),
            Tensor::randn([4], (Kind::Float, Device::Cpu)) * 1e-2,
        )
    }));
    state.validate().unwrap();
    state
}

/// The routers' expert biases survive our format (at two pipeline stages, in each stage's
/// `expert_bias.safetensors`) and Megatron's (`--ckpt-format torch`: the buffer
/// `decoder.layers.<i>.mlp.router.expert_bias` right after the router's weight in the rank
/// file; `torch_dist`: `decoder.layers.mlp.router.expert_bias` stacked over the layers, as
/// core_v0.14.0's `TopKRouter` registers and saves it), in float32, bit for bit.
#[test]
fn expert_biases_round_trip_through_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let state = with_expert_biases();
    let layout = |pipeline| TargetLayout {
        tensor: 1,
        pipeline,
        virtual_stages: 1,
    };
    let same = |read: &ModelState, what: &str| {
        assert_eq!(read.expert_biases.len(), 2, "{what}");
        for (name, bias) in &state.expert_biases {
            let back = read.expert_biases[name].read().unwrap();
            assert_eq!(back.kind(), Kind::Float, "{what}: {name}");
            assert!(back.equal(&bias.read().unwrap()), "{what}: {name}");
        }
    };
    let ours = dir.path().join("ours");
    save_megatron_rs(&state, &ours, layout(2)).unwrap();
    let read = load_megatron_rs(&find_checkpoint(&ours).unwrap().unwrap(), true).unwrap();
    same(&read, "ours");
    let options = LoadOptions {
        true_vocab_size: None,
        optimizer: true,
        make_vocab_size_divisible_by: None,
    };
    let torch = dir.path().join("torch");
    save_megatron_torch_experts(&read, &torch, layout(1), 2, true).unwrap();
    let rank_file =
        TorchFile::open(&torch.join("iter_0000005/mp_rank_00_001/model_optim_rng.pt")).unwrap();
    let model: Vec<String> = rank_file
        .root
        .get("model")
        .unwrap()
        .entries()
        .unwrap()
        .iter()
        .map(|(k, _)| k.as_str().unwrap().to_string())
        .collect();
    let router = model
        .iter()
        .position(|k| k == "decoder.layers.1.mlp.router.weight")
        .unwrap();
    assert_eq!(model[router + 1], "decoder.layers.1.mlp.router.expert_bias");
    let read = load_megatron_torch(&torch.join("iter_0000005"), &options).unwrap();
    same(&read, "torch");
    let dist = dir.path().join("dist");
    save_megatron_torch_dist(&read, &dist, layout(1), 2, true, 2).unwrap();
    let saved = DistCheckpoint::open(&dist.join("iter_0000005")).unwrap();
    let bias = &saved.tensors["decoder.layers.mlp.router.expert_bias"];
    assert_eq!((bias.dtype, bias.shape.clone()), (DType::F32, vec![2, 4]));
    same(
        &load_torch_dist(&dist.join("iter_0000005"), &options).unwrap(),
        "torch_dist",
    );
}
