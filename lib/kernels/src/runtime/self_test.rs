//! A quick check that a device can run what training needs: a bf16 matmul, flash/SDPA attention
//! forward and backward in bf16, and the autograd shim. Each check compares against an fp32
//! computation written out by hand, so a broken kernel or a silently missing backend fails.

use crate::autograd::{self, CustomFunction, SavedTensors};
use crate::ops::relative_error;
use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

/// The outcome of one check on one device.
pub struct CheckResult {
    pub name: &'static str,
    pub outcome: Result<String>,
}

/// Runs every check on `device`.
pub fn run(device: Device) -> Vec<CheckResult> {
    let checks: [(&'static str, fn(Device) -> Result<String>); 4] = [
        ("bf16 matmul", bf16_matmul),
        ("bf16 SDPA forward+backward", bf16_attention),
        ("autograd shim", shim_round_trip),
        ("recompute with dropout", recompute_with_dropout),
    ];
    checks
        .into_iter()
        .map(|(name, check)| CheckResult {
            name,
            outcome: check(device),
        })
        .collect()
}

fn bf16_matmul(device: Device) -> Result<String> {
    let a = Tensor::randn([256, 512], (Kind::Float, device));
    let b = Tensor::randn([512, 384], (Kind::Float, device));
    let got = a.to_kind(Kind::BFloat16).matmul(&b.to_kind(Kind::BFloat16));
    ensure!(got.kind() == Kind::BFloat16, "result is {:?}", got.kind());
    let error = relative_error(&got, &a.matmul(&b));
    ensure!(
        error < 2e-2,
        "bf16 matmul differs from fp32 by {error:.3e} (relative)"
    );
    Ok(format!("max rel. error {error:.1e}"))
}

/// Causal attention with explicit softmax in fp32: the reference for SDPA.
fn reference_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let seq = q.size()[2];
    let scale = 1.0 / (q.size()[3] as f64).sqrt();
    let scores = q.matmul(&k.transpose(-2, -1)) * scale;
    let future = Tensor::ones([seq, seq], (Kind::Bool, q.device())).triu(1);
    scores
        .masked_fill(&future, f64::NEG_INFINITY)
        .softmax(-1, Kind::Float)
        .matmul(v)
}

fn bf16_attention(device: Device) -> Result<String> {
    let shape = [2i64, 4, 128, 64];
    let make = || Tensor::randn(shape, (Kind::Float, device));
    let (q, k, v) = (make(), make(), make());
    let upstream = Tensor::randn(shape, (Kind::Float, device));

    let leaves: Vec<Tensor> = [&q, &k, &v]
        .iter()
        .map(|t| t.to_kind(Kind::BFloat16).set_requires_grad(true))
        .collect();
    let out = Tensor::scaled_dot_product_attention::<Tensor>(
        &leaves[0], &leaves[1], &leaves[2], None, 0.0, true, None, false,
    );
    autograd::backward(&[&out], &[&upstream.to_kind(Kind::BFloat16)], false)?;

    let ref_leaves: Vec<Tensor> = [&q, &k, &v]
        .iter()
        .map(|t| t.detach().set_requires_grad(true))
        .collect();
    let want = reference_attention(&ref_leaves[0], &ref_leaves[1], &ref_leaves[2]);
    autograd::backward(&[&want], &[&upstream], false)?;

    let mut worst = relative_error(&out, &want);
    ensure!(
        worst < 3e-2,
        "SDPA output differs from fp32 attention by {worst:.3e}"
    );
    for (name, (got, want)) in ["dq", "dk", "dv"]
        .iter()
        .zip(leaves.iter().zip(&ref_leaves))
    {
        let error = relative_error(&got.grad(), &want.grad());
        ensure!(
            error < 5e-2,
            "SDPA {name} differs from fp32 attention by {error:.3e}"
        );
        worst = worst.max(error);
    }
    Ok(format!("max rel. error {worst:.1e}"))
}

/// Doubles in forward, doubles the gradient in backward.
struct Double;

impl CustomFunction for Double {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![&inputs[0] * 2.0])
    }
    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(&grads[0] * 2.0)])
    }
}

fn shim_round_trip(device: Device) -> Result<String> {
    let x = Tensor::randn([1024], (Kind::Float, device)).set_requires_grad(true);
    let y = &autograd::apply(Double, &[&x]).context("applying a custom function")?[0];
    ensure!(y.device() == device, "output on {:?}", y.device());
    let upstream = Tensor::randn([1024], (Kind::Float, device));
    autograd::backward(&[y], &[&upstream], false)?;
    let error = relative_error(&x.grad(), &(&upstream * 2.0));
    ensure!(
        error == 0.0,
        "custom backward gave a gradient off by {error:.3e}"
    );
    Ok("custom function forward/backward ok".into())
}

/// Checkpointed dropout block: the recomputed backward must replay the forward's dropout mask,
/// which needs the device's generator state saved and restored through the shim.
fn recompute_with_dropout(device: Device) -> Result<String> {
    let w = Tensor::randn([64, 64], (Kind::Float, device)).set_requires_grad(true);
    let x = Tensor::randn([32, 64], (Kind::Float, device)).set_requires_grad(true);
    let upstream = Tensor::randn([32, 64], (Kind::Float, device));
    let block = |w: &Tensor| {
        let w = w.shallow_clone();
        move |xs: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![xs[0].matmul(&w).dropout(0.5, true)])
        }
    };
    let seed = 1234;
    tch::manual_seed(seed);
    let plain = &block(&w)(&[x.shallow_clone()])?[0];
    autograd::backward(&[plain], &[&upstream], false)?;
    let (dw, dx) = (w.grad().copy(), x.grad().copy());
    let _ = w.grad().zero_();
    let _ = x.grad().zero_();

    tch::manual_seed(seed);
    let recomputed = &autograd::recompute(block(&w), &[&x])?[0];
    let _ = Tensor::rand([1024], (Kind::Float, device));
    autograd::backward(&[recomputed], &[&upstream], false)?;
    ensure!(
        recomputed.equal(plain),
        "checkpointed forward differs from the plain forward"
    );
    let error = relative_error(&w.grad(), &dw).max(relative_error(&x.grad(), &dx));
    ensure!(error < 1e-5, "recomputed gradients differ by {error:.3e}");
    Ok(format!(
        "gradients equal to the plain block (max rel. error {error:.1e})"
    ))
}
