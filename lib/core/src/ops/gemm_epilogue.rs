//! GEMMs whose cuBLASLt epilogue applies the MLP's bias and tanh-GeLU (forward) or GeLU's
//! gradient and the bias gradient (backward), through `csrc/gemm_epilogue.cpp`: the fused
//! bias + GeLU of Megatron's `--bias-gelu-fusion` with no elementwise kernel of its own.
//!
//! [`usable_on`] checks once per device that this build has them and that they give what the
//! unfused ops give on a small problem, so a GPU or driver where cuBLASLt turns them down
//! falls back to the unfused ops with one warning instead of failing a run.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use crate::autograd::ffi;
use crate::error::check;

/// The operands' widths must be multiples of this (16-byte rows for cuBLASLt's vector loads).
const WIDTH_MULTIPLE: i64 = 8;

/// Whether tensors of this dtype and these widths (input, fc1 output) can take the epilogues.
pub fn supports(kind: Kind, widths: &[i64]) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half) && widths.iter().all(|w| w % WIDTH_MULTIPLE == 0)
}

/// `(gelu_tanh(input · weightᵀ + bias), input · weightᵀ + bias)` for a `[rows, in]` input.
pub fn linear_gelu_with_preactivation(
    input: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (input, weight, bias) = (input.contiguous(), weight.contiguous(), bias.contiguous());
    let mut out = std::ptr::null_mut();
    let mut preactivation = std::ptr::null_mut();
    // SAFETY: borrowed handles live for the call; on success the shim hands us two new ones.
    check(unsafe {
        ffi::mrs_linear_gelu_aux(
            ffi::handle(&input),
            ffi::handle(&weight),
            ffi::handle(&bias),
            &mut out,
            &mut preactivation,
        )
    })
    .context("fc1 with the bias + GeLU epilogue")?;
    // SAFETY: handles the shim allocated for us.
    Ok(unsafe { (Tensor::from_ptr(out), Tensor::from_ptr(preactivation)) })
}

/// `((grad · weight) ⊙ gelu_tanh'(preactivation), its sum over the rows)`: the gradient at
/// fc1's output and fc1's bias gradient, from the gradient at fc2's output (`[rows, out]`)
/// and fc2's weight (`[out, in]`).
pub fn gelu_backward_through(
    grad: &Tensor,
    weight: &Tensor,
    preactivation: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (grad, weight) = (grad.contiguous(), weight.contiguous());
    let mut out = std::ptr::null_mut();
    let mut bias_grad = std::ptr::null_mut();
    // SAFETY: as above.
    check(unsafe {
        ffi::mrs_matmul_dgelu_bgrad(
            ffi::handle(&grad),
            ffi::handle(&weight),
            ffi::handle(preactivation),
            &mut out,
            &mut bias_grad,
        )
    })
    .context("fc2's input gradient with the GeLU-gradient epilogue")?;
    // SAFETY: handles the shim allocated for us.
    Ok(unsafe { (Tensor::from_ptr(out), Tensor::from_ptr(bias_grad)) })
}

/// Whether the epilogues work on `device` in `kind`: built in, and equal to the unfused ops on
/// a small problem (checked once per device and dtype; a failure is reported once).
pub fn usable_on(device: Device, kind: Kind) -> bool {
    static CHECKED: OnceLock<Mutex<HashMap<(Device, Kind), bool>>> = OnceLock::new();
    if !device.is_cuda() || !supports(kind, &[]) {
        return false;
    }
    // SAFETY: a query without arguments.
    if unsafe { ffi::mrs_gemm_epilogues_available() } == 0 {
        return false;
    }
    let mut checked = CHECKED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    *checked.entry((device, kind)).or_insert_with(|| {
        match tch::no_grad(|| self_check(device, kind)) {
            Ok(()) => true,
            Err(e) => {
                eprintln!(
                    "warning: the MLP's bias + GeLU GEMM epilogues are off on {device:?} \
                     ({e:#}); using separate kernels"
                );
                false
            }
        }
    })
}

/// Both epilogues against the unfused ops on a small MLP, within the dtype's rounding.
fn self_check(device: Device, kind: Kind) -> Result<()> {
    let (rows, hidden, ffn) = (96i64, 64i64, 256i64);
    let values = |shape: &[i64], seed: f64| {
        let count: i64 = shape.iter().product();
        (Tensor::arange(count, (Kind::Float, device)) * seed)
            .sin()
            .view(shape)
    };
    let x = values(&[rows, hidden], 0.37);
    let w1 = values(&[ffn, hidden], 0.11) * 0.2;
    let b1 = values(&[ffn], 0.53) * 0.5;
    let w2 = values(&[hidden, ffn], 0.29) * 0.2;
    let dy = values(&[rows, hidden], 0.71);
    let to = |t: &Tensor| t.to_kind(kind);
    let (out, pre) = linear_gelu_with_preactivation(&to(&x), &to(&w1), &to(&b1))?;
    let expected_pre = to(&x).linear(&to(&w1), Some(&to(&b1))).to_kind(Kind::Float);
    let expected_out = expected_pre.gelu("tanh");
    let (dz, db) = gelu_backward_through(&to(&dy), &to(&w2), &pre)?;
    let da = to(&dy).matmul(&to(&w2)).to_kind(Kind::Float);
    let expected_dz = expected_pre.gelu_backward(&da, "tanh");
    let expected_db = expected_dz.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    for (name, got, want) in [
        ("the GeLU argument", &pre, &expected_pre),
        ("the GeLU output", &out, &expected_out),
        ("GeLU's gradient", &dz, &expected_dz),
        ("the bias gradient", &db, &expected_db),
    ] {
        let got = got.to_kind(Kind::Float);
        let scale = want.abs().max().double_value(&[]).max(1e-6);
        let error = (got - want).abs().max().double_value(&[]) / scale;
        ensure!(
            error < 2e-2,
            "{name} differs from the unfused ops by {error:.3e} (relative)"
        );
    }
    Ok(())
}
