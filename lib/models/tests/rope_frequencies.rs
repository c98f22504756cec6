//! Our RoPE angles and YaRN attention factor against Megatron's formulas, written out in torch
//! (float32 as Megatron computes them) in the test environment's python: the base
//! frequencies, Llama 3.x's bands (`RotaryEmbedding._apply_scaling`), linear interpolation of
//! the positions (`seq_len_interpolation_factor`) and YaRN (`YarnRotaryEmbedding`).

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_models::layers::RotaryEmbedding;
use megatron_models::{Llama3Scaling, RopeScaling, YarnScaling};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// Megatron's formulas; reads {dim, base, positions, scaling} and prints the angles
/// `[positions, dim/2]` and the factor on cos and sin.
const MEGATRON_FORMULAS: &str = r#"
import json, math, sys, torch
p = json.loads(sys.argv[1])
dim, base, s = p["dim"], p["base"], p["scaling"]
inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
pos = torch.arange(p["positions"], dtype=torch.float32)
factor_on_tables = 1.0
kind = s["rope_type"] if s else None
if kind == "llama3":
    old = s["original_max_position_embeddings"]
    wave = 2 * math.pi / inv
    long_waves = torch.where(wave > old / s["low_freq_factor"], inv / s["factor"], inv)
    blend = (old / wave - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    mixed = (1 - blend) * long_waves / s["factor"] + blend * long_waves
    middle = ~(wave < old / s["high_freq_factor"]) * ~(wave > old / s["low_freq_factor"])
    inv = torch.where(middle, mixed, long_waves)
elif kind == "linear":
    pos = pos * (1 / s["factor"])
elif kind == "yarn":
    def channel(turns):
        return dim * math.log(s["original_max_position_embeddings"] / (turns * 2 * math.pi)) / (2 * math.log(base))
    low, high = channel(s["beta_fast"]), channel(s["beta_slow"])
    if s["correction_range_round_to_int"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1.0 - ramp
    stretched = 1.0 / (s["factor"] * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inv = stretched * (1 - keep) + inv * keep
    m = lambda scale, k: 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
    factor_on_tables = m(s["factor"], s["mscale"]) / m(s["factor"], s["mscale_all_dim"])
angles = torch.outer(pos, inv)
print(json.dumps({"angles": angles.flatten().tolist(), "factor": factor_on_tables}))
"#;

fn python() -> PathBuf {
    std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python"))
}

fn megatron(dim: i64, base: f64, positions: i64, scaling: Option<RopeScaling>) -> (Tensor, f64) {
    let input = json!({"dim": dim, "base": base, "positions": positions, "scaling": scaling});
    let out = Command::new(python())
        .args(["-c", MEGATRON_FORMULAS, &input.to_string()])
        .output()
        .expect("running MEGATRON_RS_TEST_PYTHON (torch)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    let angles: Vec<f32> = reply["angles"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    (
        Tensor::from_slice(&angles).view([positions, dim / 2]),
        reply["factor"].as_f64().unwrap(),
    )
}

fn check(dim: i64, base: f64, scaling: Option<RopeScaling>) {
    let positions = 100;
    let (expected, expected_factor) = megatron(dim, base, positions, scaling);
    let rope = RotaryEmbedding::new(dim, base, scaling, false);
    let angles =
        Tensor::arange(positions, (Kind::Float, Device::Cpu)).outer(&rope.inv_freq(Device::Cpu));
    let worst = (&angles - &expected).abs().max().double_value(&[]);
    assert!(worst < 2e-5, "{scaling:?}: max |Δ angle| {worst:e}");
    let factor = match scaling {
        Some(RopeScaling::Yarn(yarn)) => yarn.attention_factor(),
        _ => 1.0,
    };
    assert!(
        (factor - expected_factor).abs() < 1e-12,
        "{scaling:?}: {factor} vs {expected_factor}"
    );
    // The scaling shows: unscaled angles are far from these.
    if scaling.is_some() {
        let plain = RotaryEmbedding::new(dim, base, None, false).inv_freq(Device::Cpu);
        let plain = Tensor::arange(positions, (Kind::Float, Device::Cpu)).outer(&plain);
        assert!(
            (&plain - &expected).abs().max().double_value(&[]) > 1e-2,
            "{scaling:?}"
        );
    }
}

#[test]
fn base_frequencies_follow_megatron() {
    check(64, 10000.0, None);
    check(128, 500000.0, None);
}

#[test]
fn llama3_frequencies_follow_megatron() {
    check(
        128,
        500000.0,
        Some(RopeScaling::Llama3(Llama3Scaling::megatron(8.0))),
    );
    let short = Llama3Scaling {
        original_max_position_embeddings: 64,
        high_freq_factor: 8.0,
        ..Llama3Scaling::megatron(16.0)
    };
    check(64, 10000.0, Some(RopeScaling::Llama3(short)));
}

#[test]
fn linear_interpolation_follows_megatron() {
    check(64, 10000.0, Some(RopeScaling::Linear { factor: 4.0 }));
    check(32, 1000000.0, Some(RopeScaling::Linear { factor: 2.5 }));
}

#[test]
fn yarn_frequencies_and_attention_factor_follow_megatron() {
    check(
        64,
        10000.0,
        Some(RopeScaling::Yarn(YarnScaling::megatron(40.0))),
    );
    let custom = YarnScaling {
        original_max_position_embeddings: 32,
        beta_fast: 8.0,
        beta_slow: 0.5,
        mscale: 0.707,
        mscale_all_dim: 0.5,
        correction_range_round_to_int: false,
        ..YarnScaling::megatron(4.0)
    };
    check(128, 100.0, Some(RopeScaling::Yarn(custom)));
    // Both ends at the same channel: the ramp widened by a thousandth.
    let degenerate = YarnScaling {
        original_max_position_embeddings: 64,
        beta_fast: 2.0,
        beta_slow: 2.0,
        correction_range_round_to_int: false,
        ..YarnScaling::megatron(4.0)
    };
    check(16, 10000.0, Some(RopeScaling::Yarn(degenerate)));
}
