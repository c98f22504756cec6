//! Reshaping our checkpoints: TP2·PP2 (also interleaved) → TP1·PP1 → TP2·PP2 gives back the
//! same files bit for bit — weights and the optimizer's float32 main parameters and Adam
//! moments — for SwiGLU, GQA, untied embeddings and a vocabulary whose padding changes with TP.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::rc::Rc;

use megatron_convert::{
    in_memory, load_megatron_rs, reporting_progress, save_megatron_rs, ConversionProgress,
    ModelState, OptimizerState, RunState, TargetLayout,
};
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
