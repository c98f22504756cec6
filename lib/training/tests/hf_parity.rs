//! Our GPT against HuggingFace reference models with identical weights: logits must agree
//! in float32. Fixtures come from `scripts/reference/make_parity_fixtures.py` (their logits
//! were computed in float64).

use std::collections::HashMap;
use std::path::PathBuf;

use clap::Parser;
use megatron_models::gpt::hf;
use megatron_models::{AttentionMask, GptModel, ModelOptions, Recompute};
use megatron_parallel::ParallelState;
use megatron_store::read_tensors;
use megatron_training::args::ModelArgs;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
}

struct Fixture {
    model: GptModel,
    hf_state: HashMap<String, Tensor>,
    input_ids: Tensor,
    logits: Tensor,
}

fn fixture_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/parity")
        .join(case)
}

/// Builds the model from the fixture's Megatron flags, exactly as `pretrain_gpt` parses them.
fn load(case: &str) -> Fixture {
    let dir = fixture_dir(case);
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let args = config["megatron_args"].as_object().unwrap();
    let mut argv = vec!["test".to_string()];
    let mut vocab_size = 0;
    for (key, value) in args {
        if key == "vocab_size" {
            vocab_size = value.as_i64().unwrap();
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        match value {
            serde_json::Value::Bool(true) if key == "bias_gelu_fusion" => {}
            serde_json::Value::Bool(true) => argv.push(flag),
            serde_json::Value::Bool(false) => {}
            serde_json::Value::String(s) => argv.extend([flag, s.clone()]),
            other => argv.extend([flag, other.to_string()]),
        }
    }
    let flags = Flags::try_parse_from(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
    let gpt = flags.model.gpt_config(vocab_size).unwrap();
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 1234,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = GptModel::new(gpt, options, &ParallelState::single()).unwrap();
    let (hf_state, _) = read_tensors(&dir.join("model.safetensors"), Device::Cpu).unwrap();
    let (io, _) = read_tensors(&dir.join("io.safetensors"), Device::Cpu).unwrap();
    Fixture {
        model,
        hf_state,
        input_ids: io["input_ids"].shallow_clone(),
        logits: io["logits"].shallow_clone(),
    }
}

/// Max |ours - reference| over the true vocabulary, logits as `[b, s, V]`.
fn max_logit_difference(fixture: &Fixture) -> f64 {
    let (b, s) = (fixture.input_ids.size()[0], fixture.input_ids.size()[1]);
    let positions = Tensor::arange(s, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([b, s], false);
    let logits = tch::no_grad(|| {
        fixture
            .model
            .forward_full_logits(&fixture.input_ids, &positions, &AttentionMask::Causal)
    })
    .unwrap()
    .transpose(0, 1);
    let vocab = fixture.logits.size()[2];
    (logits.narrow(2, 0, vocab) - &fixture.logits)
        .abs()
        .max()
        .double_value(&[])
}

#[test]
fn gpt2_logits_equal_huggingface() {
    let fixture = load("gpt2");
    let state = hf::gpt2_to_megatron(&fixture.hf_state, &fixture.model.config).unwrap();
    fixture.model.load_parameters(&state).unwrap();
    let difference = max_logit_difference(&fixture);
    // The fixture's logits are small (|x| < 1): 1e-6 separates float32 rounding (~2e-7) from
    // any real mistake (erf instead of tanh GeLU alone moves them by ~6e-6).
    assert!(difference < 1e-6, "max |logit difference| = {difference:e}");
}

#[test]
fn llama_rope_rmsnorm_swiglu_gqa_logits_equal_huggingface() {
    let fixture = load("llama");
    let state = hf::llama_to_megatron(&fixture.hf_state, &fixture.model.config).unwrap();
    fixture.model.load_parameters(&state).unwrap();
    let difference = max_logit_difference(&fixture);
    assert!(difference < 1e-6, "max |logit difference| = {difference:e}");
}

#[test]
fn a_wrong_layout_is_caught() {
    // Loading GPT-2's q|k|v blocks without Megatron's per-head reordering must change logits:
    // guards against a parity test that passes whatever the layout.
    let fixture = load("gpt2");
    let mut state = hf::gpt2_to_megatron(&fixture.hf_state, &fixture.model.config).unwrap();
    let c_attn = &fixture.hf_state["transformer.h.0.attn.c_attn.weight"];
    state.insert(
        "decoder.layers.0.self_attention.linear_qkv.weight".into(),
        c_attn.tr().contiguous(),
    );
    fixture.model.load_parameters(&state).unwrap();
    assert!(max_logit_difference(&fixture) > 1e-3);
}

#[test]
fn missing_and_unknown_tensors_are_named() {
    let fixture = load("gpt2");
    let mut state = hf::gpt2_to_megatron(&fixture.hf_state, &fixture.model.config).unwrap();
    state.remove("decoder.final_layernorm.bias");
    let error = fixture
        .model
        .load_parameters(&state)
        .unwrap_err()
        .to_string();
    assert!(error.contains("decoder.final_layernorm.bias"), "{error}");
    state.insert(
        "decoder.final_layernorm.bias".into(),
        Tensor::zeros([64], (Kind::Float, Device::Cpu)),
    );
    state.insert(
        "decoder.layers.9.mlp.linear_fc1.weight".into(),
        Tensor::zeros([1], (Kind::Float, Device::Cpu)),
    );
    let error = fixture
        .model
        .load_parameters(&state)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("decoder.layers.9.mlp.linear_fc1.weight"),
        "{error}"
    );
}
