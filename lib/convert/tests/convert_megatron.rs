//! Megatron-LM's own checkpoints (../shared/golden/megatron_checkpoints) converted to ours:
//! the architecture comes from their args, every weight and optimizer tensor lands under its
//! name, and our model runs forward on the result with the logits of the source.

use std::path::{Path, PathBuf};

use megatron_convert::{
    load_megatron_rs, load_megatron_torch, load_torch_dist, save_megatron_rs, save_megatron_torch,
    verify, LazyTensor, LoadOptions, TargetLayout,
};
use megatron_models::{Activation, Normalization, PositionEmbeddingType};
use megatron_store::find_checkpoint;
use tch::Kind;

fn goldens() -> PathBuf {
    let shared = std::env::var_os("MEGATRON_RS_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    shared.join("golden/megatron_checkpoints")
}

fn with_optimizer() -> LoadOptions {
    LoadOptions {
        true_vocab_size: None,
        optimizer: true,
        make_vocab_size_divisible_by: None,
    }
}

#[test]
fn gpt_torch_weights_and_adam_state_map_to_our_names() {
    let state =
        load_megatron_torch(&goldens().join("gpt_torch/iter_0000003"), &with_optimizer()).unwrap();
    let config = &state.config;
    assert_eq!(
        (
            config.num_layers,
            config.hidden_size,
            config.num_attention_heads
        ),
        (2, 64, 4)
    );
    assert_eq!(
        config.vocab_size, 8193,
        "NullTokenizer --vocab-size 8192 plus its end of document"
    );
    assert_eq!(config.padded_vocab_size(1), 8320);
    assert_eq!(
        config.activation,
        Activation::GeluErf,
        "--no-bias-gelu-fusion"
    );
    assert_eq!(
        config.position_embedding_type,
        PositionEmbeddingType::LearnedAbsolute
    );
    assert_eq!(state.params_dtype, "bfloat16");
    assert_eq!(state.run.iteration, 3);
    assert_eq!(state.run.consumed_train_samples, 12);
    let scheduler = state.run.opt_param_scheduler.as_ref().unwrap();
    assert_eq!(scheduler["num_steps"], 12);
    assert_eq!(state.weights.len(), 28);
    let optimizer = state
        .optimizer
        .as_ref()
        .expect("gpt_torch was saved with its optimizer");
    assert_eq!(optimizer.step, 3.0);
    // Megatron copies each fp32 main parameter into the bf16 model after the step: if a main
    // parameter landed under another tensor's name, this would not hold.
    for (name, weight) in &state.weights {
        let (main, weight) = (optimizer.main[name].read().unwrap(), weight.read().unwrap());
        assert_eq!(main.size(), weight.size(), "{name}");
        assert!(
            main.to_kind(Kind::BFloat16).equal(&weight),
            "main parameter of {name}"
        );
        let (exp_avg, exp_avg_sq) = (
            optimizer.exp_avg[name].read().unwrap(),
            optimizer.exp_avg_sq[name].read().unwrap(),
        );
        assert!(exp_avg_sq.min().double_value(&[]) >= 0.0, "{name}");
        assert!(exp_avg.abs().max().double_value(&[]) > 0.0, "{name}");
    }
}

/// The distributed optimizer's state of both distributed-optimizer goldens lands on every
/// parameter: its float32 main weights round to the saved bfloat16 weights (a parameter read
/// from another one's place in the flat buffers would not), its moments are finite and the
/// second ones non-negative, and the two goldens (the same run saved in two formats) agree.
#[test]
fn distributed_optimizer_state_lands_on_every_parameter() {
    let torch = load_megatron_torch(
        &goldens().join("distopt_torch/iter_0000005"),
        &with_optimizer(),
    )
    .unwrap();
    let dist = load_torch_dist(
        &goldens().join("distopt_torch_dist/iter_0000005"),
        &with_optimizer(),
    )
    .unwrap();
    for state in [&torch, &dist] {
        let optimizer = state.optimizer.as_ref().unwrap();
        assert_eq!(optimizer.step, 5.0, "{}", state.source);
        assert_eq!(state.run.iteration, 5);
        assert_eq!(optimizer.main.len(), 28, "{}", state.source);
        for (name, weight) in &state.weights {
            let main = optimizer.main[name].read().unwrap();
            let weight = weight.read().unwrap();
            assert_eq!(main.size(), weight.size(), "{name}");
            assert_eq!(main.kind(), Kind::Float, "{name}");
            assert!(
                main.to_kind(Kind::BFloat16).equal(&weight),
                "{}: {name}: main parameters do not round to the weights",
                state.source
            );
            let exp_avg = optimizer.exp_avg[name].read().unwrap();
            let exp_avg_sq = optimizer.exp_avg_sq[name].read().unwrap();
            assert_eq!(exp_avg.size(), weight.size(), "{name}");
            assert!(bool::try_from(exp_avg.isfinite().all()).unwrap(), "{name}");
            assert!(bool::try_from(exp_avg_sq.ge(0.0).all()).unwrap(), "{name}");
            assert!(
                f64::try_from(exp_avg_sq.sum(Kind::Double)).unwrap() > 0.0,
                "{name}: no second moment"
            );
        }
    }
    let (a, b) = (
        torch.optimizer.as_ref().unwrap(),
        dist.optimizer.as_ref().unwrap(),
    );
    for (name, moment) in &a.exp_avg_sq {
        let (x, y) = (moment.read().unwrap(), b.exp_avg_sq[name].read().unwrap());
        let relative = f64::try_from((&x - &y).abs().max()).unwrap()
            / f64::try_from(x.abs().max()).unwrap().max(1e-30);
        assert!(
            relative < 0.05,
            "{name}: the two goldens' second moments differ by {relative}"
        );
    }
}

/// core_v0.14.0's torch_dist `dp_zero_gather_scatter` optimizer state (one object per
/// model-parallel rank holding `get_parameter_state_dp_zero`'s buffers and one its parameter
/// groups), made by `tests/fixtures/dp_zero_gather_scatter.py` from the `distopt_torch` golden's
/// `distrib_optim.pt`, reads as that golden does: the same step and every parameter's main
/// weights and moments bit for bit, though here the parameters' order in the buffers comes from
/// the model's architecture rather than a rank file's.
#[test]
fn dp_zero_gather_scatter_state_reads_as_distrib_optim_pt() {
    let out = tempfile::tempdir().unwrap();
    let iteration = out.path().join("iter_0000005");
    let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"));
    let made = std::process::Command::new(python)
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/dp_zero_gather_scatter.py"),
        )
        .arg(goldens().join("distopt_torch/iter_0000005"))
        .arg(goldens().join("distopt_torch_dist/iter_0000005"))
        .arg(&iteration)
        .output()
        .expect(
            "running tests/fixtures/dp_zero_gather_scatter.py (MEGATRON_RS_TEST_PYTHON with torch)",
        );
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let dp_zero = load_torch_dist(&iteration, &with_optimizer()).unwrap();
    let torch = load_megatron_torch(
        &goldens().join("distopt_torch/iter_0000005"),
        &with_optimizer(),
    )
    .unwrap();
    let (a, b) = (
        dp_zero.optimizer.as_ref().unwrap(),
        torch.optimizer.as_ref().unwrap(),
    );
    assert_eq!(a.step, 5.0);
    assert_eq!(a.step, b.step);
    for (mine, theirs) in [
        (&a.main, &b.main),
        (&a.exp_avg, &b.exp_avg),
        (&a.exp_avg_sq, &b.exp_avg_sq),
    ] {
        assert_eq!(mine.len(), 28);
        let mut names: Vec<_> = mine.keys().collect();
        names.sort();
        let mut expected: Vec<_> = theirs.keys().collect();
        expected.sort();
        assert_eq!(names, expected);
        for (name, value) in mine {
            assert!(
                value.read().unwrap().equal(&theirs[name].read().unwrap()),
                "{name} differs from distrib_optim.pt's"
            );
        }
    }
}

/// What a seeded Python, numpy and torch give, checked against the `rng_state` of the rank
/// file argv[1] (seed argv[2], tensor rank argv[3]): Megatron's load sets each generator from
/// it (`random.setstate`, `np.random.set_state`, `torch.set_rng_state`), which must accept
/// them, and they must be the states Megatron's own start leaves.
const RNG_STATE_AS_MEGATRONS: &str = r#"
import pickle, random, sys, types
import numpy as np, torch
class Stubs(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith("megatron"):
            return type(name, (), {"__init__": lambda self, *a, **k: None,
                                   "__setstate__": lambda self, state: None})
        return super().find_class(module, name)
stubs = types.ModuleType("stubs"); stubs.Unpickler = Stubs; stubs.load = pickle.load
saved = torch.load(sys.argv[1], map_location="cpu", weights_only=False, pickle_module=stubs)
seed, tensor_rank = int(sys.argv[2]), int(sys.argv[3])
(state,) = saved["rng_state"]
random.setstate(state["random_rng_state"])
np.random.set_state(state["np_rng_state"])
torch.set_rng_state(state["torch_rng_state"])
drawn = (random.random(), np.random.rand(), torch.rand(1).item())
random.seed(seed); np.random.seed(seed); torch.manual_seed(seed)
assert drawn == (random.random(), np.random.rand(), torch.rand(1).item()), drawn
def cuda(s):
    return torch.tensor(list(s.to_bytes(8, "little")) + [0] * 8, dtype=torch.uint8)
assert torch.equal(state["cuda_rng_state"], cuda(seed))
tracker = state["rng_tracker_states"]
assert sorted(tracker) == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
assert torch.equal(tracker["model-parallel-rng"], cuda(seed + 2718 + tensor_rank))
print("ok")
"#;

/// `--ckpt-format torch` exports carry `rng_state` (per rank, a list of one state), so
/// Megatron's `pretrain_gpt.py` loads them without `--no-load-rng`: the generators as its own
/// start seeds them for the rank (`--seed` 1234 of the golden run), which Python, numpy and
/// torch accept and draw from as from their own seeding.
#[test]
fn torch_exports_carry_the_rng_state_megatron_loads() {
    let state =
        load_megatron_torch(&goldens().join("gpt_torch/iter_0000003"), &with_optimizer()).unwrap();
    let out = tempfile::tempdir().unwrap();
    save_megatron_torch(
        &state,
        out.path(),
        TargetLayout {
            tensor: 2,
            pipeline: 1,
            virtual_stages: 1,
        },
    )
    .unwrap();
    let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"));
    for rank in [0, 1] {
        let checked = std::process::Command::new(&python)
            .arg("-c")
            .arg(RNG_STATE_AS_MEGATRONS)
            .arg(
                out.path()
                    .join(format!("iter_0000003/mp_rank_{rank:02}/model_optim_rng.pt")),
            )
            .args(["1234", &rank.to_string()])
            .output()
            .expect("running python (MEGATRON_RS_TEST_PYTHON with torch and numpy)");
        assert_eq!(
            String::from_utf8_lossy(&checked.stdout).trim(),
            "ok",
            "{}",
            String::from_utf8_lossy(&checked.stderr)
        );
    }
}

#[test]
fn gpt_torch_converts_to_ours_with_the_same_logits() {
    let state =
        load_megatron_torch(&goldens().join("gpt_torch/iter_0000003"), &with_optimizer()).unwrap();
    let out = tempfile::tempdir().unwrap();
    let root = out.path().join("ours");
    save_megatron_rs(
        &state,
        &root,
        TargetLayout {
            tensor: 1,
            pipeline: 1,
            virtual_stages: 1,
        },
    )
    .unwrap();
    let checkpoint = find_checkpoint(&root).unwrap().unwrap();
    assert_eq!(checkpoint.metadata.iteration, 3);
    let written = load_megatron_rs(&checkpoint, true).unwrap();
    assert_eq!(verify::max_logit_difference(&state, &written).unwrap(), 0.0);
    let tokens = verify::sample_tokens(&state, 2);
    let logits = verify::logits(&verify::model_of(&written).unwrap(), &tokens).unwrap();
    assert!(logits.isfinite().all().int64_value(&[]) == 1);
    let (a, b) = (state.optimizer.unwrap(), written.optimizer.unwrap());
    let same = |x: &LazyTensor, y: &LazyTensor| x.read().unwrap().equal(&y.read().unwrap());
    for (name, main) in &a.main {
        assert!(same(main, &b.main[name]), "{name}");
        assert!(same(&a.exp_avg_sq[name], &b.exp_avg_sq[name]), "{name}");
    }
}

#[test]
fn llama_torch_converts_with_swiglu_gqa_rope_and_untied_output() {
    let state = load_megatron_torch(
        &goldens().join("llama_torch/iter_0000003"),
        &with_optimizer(),
    )
    .unwrap();
    let config = &state.config;
    assert_eq!(config.activation, Activation::Swiglu);
    assert_eq!(config.normalization, Normalization::RMSNorm);
    assert_eq!(config.position_embedding_type, PositionEmbeddingType::Rope);
    assert_eq!(config.num_query_groups, 2);
    assert!(config.untie_embeddings_and_output_weights && !config.add_bias_linear);
    assert!(state.optimizer.is_none(), "saved with --no-save-optim");
    let out = tempfile::tempdir().unwrap();
    let root = out.path().join("ours");
    save_megatron_rs(
        &state,
        &root,
        TargetLayout {
            tensor: 2,
            pipeline: 1,
            virtual_stages: 1,
        },
    )
    .unwrap();
    let written = load_megatron_rs(&find_checkpoint(&root).unwrap().unwrap(), false).unwrap();
    assert_eq!(verify::max_logit_difference(&state, &written).unwrap(), 0.0);
}

#[test]
fn torch_dist_converts_and_runs_forward() {
    let dist = load_torch_dist(
        &goldens().join("gpt_torch_dist/iter_0000003"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(dist.weights.len(), 28);
    assert_eq!(dist.config.vocab_size, 8193);
    let out = tempfile::tempdir().unwrap();
    let root = out.path().join("ours");
    save_megatron_rs(
        &dist,
        &root,
        TargetLayout {
            tensor: 1,
            pipeline: 2,
            virtual_stages: 1,
        },
    )
    .unwrap();
    let written = load_megatron_rs(&find_checkpoint(&root).unwrap().unwrap(), false).unwrap();
    assert_eq!(verify::max_logit_difference(&dist, &written).unwrap(), 0.0);
    // The same run saved in the torch format has the same architecture.
    let torch = load_megatron_torch(
        &goldens().join("gpt_torch/iter_0000003"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(torch.config, dist.config);
}

/// Megatron's torch format written in a TP2·PP2 layout reads back as the same model: the
/// loader joins `mp_rank_XX_YYY` shards (SwiGLU's interleaved gate/up, GQA, untied output,
/// the vocabulary padded for two ranks) and makes pipeline-local layers global.
#[test]
fn megatron_torch_tp2_pp2_reads_back_as_the_same_model() {
    use megatron_convert::save_megatron_torch;
    for golden in ["gpt_torch", "llama_torch"] {
        // gpt_torch has its optimizer state, which goes along into every rank file.
        let options = with_optimizer();
        let state =
            load_megatron_torch(&goldens().join(golden).join("iter_0000003"), &options).unwrap();
        let out = tempfile::tempdir().unwrap();
        let layout = TargetLayout {
            tensor: 2,
            pipeline: 2,
            virtual_stages: 1,
        };
        save_megatron_torch(&state, out.path(), layout).unwrap();
        assert!(out
            .path()
            .join("iter_0000003/mp_rank_01_001/model_optim_rng.pt")
            .is_file());
        let back = load_megatron_torch(&out.path().join("iter_0000003"), &options).unwrap();
        assert_eq!(back.config, state.config, "{golden}");
        assert_eq!(back.source_parallel, (2, 2));
        assert_eq!(back.weights.len(), state.weights.len(), "{golden}");
        for (name, tensor) in &state.weights {
            assert!(
                tensor
                    .read()
                    .unwrap()
                    .equal(&back.weights[name].read().unwrap()),
                "{golden}: {name}"
            );
        }
        assert_eq!(
            state.optimizer.is_some(),
            back.optimizer.is_some(),
            "{golden}"
        );
        if let (Some(a), Some(b)) = (&state.optimizer, &back.optimizer) {
            assert_eq!(a.step, b.step);
            for (x, y) in [
                (&a.main, &b.main),
                (&a.exp_avg, &b.exp_avg),
                (&a.exp_avg_sq, &b.exp_avg_sq),
            ] {
                assert_eq!(x.len(), y.len());
                for (name, tensor) in x {
                    assert!(
                        tensor.read().unwrap().equal(&y[name].read().unwrap()),
                        "{golden}: optimizer state of {name}"
                    );
                }
            }
        }
    }
}

/// Every RoPE scaling travels through Megatron's args (`--use-rope-scaling`,
/// `--rotary-seq-len-interpolation-factor`, `--position-embedding-type yarn` with its flags); a
/// Llama-3 scaling Megatron's flags cannot express is refused by name instead of being saved
/// wrong.
#[test]
fn megatron_torch_carries_rope_scaling() {
    use megatron_convert::save_megatron_torch;
    use megatron_models::{Llama3Scaling, RopeScaling, YarnScaling};
    let options = LoadOptions::default();
    let mut state =
        load_megatron_torch(&goldens().join("llama_torch/iter_0000003"), &options).unwrap();
    assert_eq!(state.config.rope_scaling, None);
    let layout = TargetLayout {
        tensor: 1,
        pipeline: 1,
        virtual_stages: 1,
    };
    let yarn = YarnScaling {
        original_max_position_embeddings: 64,
        beta_fast: 16.0,
        beta_slow: 2.0,
        mscale: 0.707,
        mscale_all_dim: 0.707,
        correction_range_round_to_int: false,
        ..YarnScaling::megatron(40.0)
    };
    for scaling in [
        RopeScaling::Llama3(Llama3Scaling::megatron(32.0)),
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Yarn(yarn),
        RopeScaling::Yarn(YarnScaling::megatron(8.0)),
    ] {
        state.config.rope_scaling = Some(scaling);
        let out = tempfile::tempdir().unwrap();
        save_megatron_torch(&state, out.path(), layout).unwrap();
        let back = load_megatron_torch(&out.path().join("iter_0000003"), &options).unwrap();
        assert_eq!(back.config.rope_scaling, Some(scaling));
    }
    state.config.rope_scaling = Some(RopeScaling::Llama3(Llama3Scaling {
        original_max_position_embeddings: 16,
        ..Llama3Scaling::megatron(8.0)
    }));
    let refused = tempfile::tempdir().unwrap();
    let error = format!(
        "{:#}",
        save_megatron_torch(&state, refused.path(), layout).unwrap_err()
    );
    assert!(
        error.contains("original_max_position_embeddings"),
        "{error}"
    );
}
