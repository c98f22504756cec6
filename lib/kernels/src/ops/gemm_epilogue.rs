//! fc1's GEMM with the MLP's bias and tanh-GeLU in its cuBLASLt epilogue, through
//! `csrc/gemm_epilogue.cpp`: the fused bias + GeLU of Megatron's `--bias-gelu-fusion` with no
//! elementwise kernel of its own. It also writes GeLU's argument, which backward needs.
//!
//! [`usable_on`] checks once per device that this build has it and that it gives what the
//! unfused ops give on a small problem, so a GPU or driver where cuBLASLt turns it down falls
//! back to the unfused ops with one warning instead of failing a run.

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::passes_self_check;
use crate::autograd::ffi;
use crate::error::check;

/// The operands' widths must be multiples of this (16-byte rows for cuBLASLt's vector loads).
const WIDTH_MULTIPLE: i64 = 8;

/// Whether tensors of this dtype and these widths (input, fc1 output) can take the epilogue.
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

/// Whether the epilogue works on `device` in `kind`: built in, and equal to the unfused ops on
/// a small problem (checked once per device and dtype; a failure is reported once).
pub fn usable_on(device: Device, kind: Kind) -> bool {
    // SAFETY: a query without arguments.
    let built_in = unsafe { ffi::mrs_gemm_epilogues_available() } != 0;
    device.is_cuda()
        && supports(kind, &[])
        && built_in
        && passes_self_check(
            "the MLP's bias + GeLU GEMM epilogue",
            device,
            kind,
            0,
            "separate kernels",
            || self_check(device, kind),
        )
}

/// The epilogue against the unfused ops on a small problem, within the dtype's rounding.
fn self_check(device: Device, kind: Kind) -> Result<()> {
    let (rows, hidden, ffn) = (96i64, 64i64, 256i64);
    let values = |shape: &[i64], seed: f64| {
        let count: i64 = shape.iter().product();
        (Tensor::arange(count, (Kind::Float, device)) * seed)
            .sin()
            .view(shape)
            .to_kind(kind)
    };
    let x = values(&[rows, hidden], 0.37);
    let w = values(&[ffn, hidden], 0.11) * 0.2;
    let b = values(&[ffn], 0.53) * 0.5;
    let (out, pre) = linear_gelu_with_preactivation(&x, &w, &b)?;
    let expected_pre = x.linear(&w, Some(&b)).to_kind(Kind::Float);
    let expected_out = expected_pre.gelu("tanh");
    for (name, got, want) in [
        ("the GeLU argument", &pre, &expected_pre),
        ("the GeLU output", &out, &expected_out),
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
