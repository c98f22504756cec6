//! Tensor operations libtorch has but tch-rs does not bind, reached through the C++ shim, and
//! small CUDA kernels of our own compiled at run time ([`crate::runtime::nvrtc`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::runtime::nvrtc::CudaHeader;

/// A header of `lib/kernels/cuda/`, under the name the sources `#include`.
macro_rules! cuda_header {
    ($name:literal) => {
        CudaHeader {
            name: $name,
            text: include_str!(concat!("../../cuda/", $name)),
        }
    };
}

/// The headers of our kernel sources (`lib/kernels/cuda/*.cuh`), by the names the sources
/// include them by; every [`crate::runtime::nvrtc::KernelSource`] of ours hands NVRTC all of
/// them.
const HEADERS: &[CudaHeader] = &[
    cuda_header!("scalars.cuh"),
    cuda_header!("vectors8.cuh"),
    cuda_header!("column_totals.cuh"),
    cuda_header!("dependent_launch.cuh"),
    cuda_header!("online_softmax.cuh"),
    cuda_header!("decode_gemv_parts.cuh"),
];

/// Row groups (`blockDim.y`) of `column_totals_into_main` and its kin (`column_totals.cuh`), 32
/// columns a block.
const COLUMN_TOTAL_GROUPS: u32 = 16;

/// Whether one of our kernels (`kernel`, as the warning names it) may run on `device` for
/// `kind` and `width` (0 where the width does not matter): its self-check `check` passed there,
/// run once per kernel, device, dtype and width; a failure is reported once, with what runs
/// `instead`, and the kernel stays off for that case.
fn passes_self_check(
    kernel: &'static str,
    device: tch::Device,
    kind: tch::Kind,
    width: i64,
    instead: &str,
    check: impl FnOnce() -> anyhow::Result<()>,
) -> bool {
    type Verdicts = HashMap<(&'static str, tch::Device, tch::Kind, i64), bool>;
    static VERDICTS: OnceLock<Mutex<Verdicts>> = OnceLock::new();
    let mut verdicts = VERDICTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    *verdicts
        .entry((kernel, device, kind, width))
        .or_insert_with(|| match tch::no_grad(check) {
            Ok(()) => true,
            Err(e) => {
                let case = if width > 0 {
                    format!("{kind:?} rows of {width}")
                } else {
                    format!("{kind:?}")
                };
                eprintln!(
                    "warning: {kernel} is off for {case} on {device:?} ({e:#}); using {instead}"
                );
                false
            }
        })
}

/// Whether the environment variable `variable` is `0`, which keeps one of our kernels off.
fn turned_off(variable: &str) -> bool {
    std::env::var(variable).is_ok_and(|v| v == "0")
}

/// The inputs of our kernels' self-checks, the same on every run: element `i` of a `shape`
/// tensor is `sin(i · step) · scale`, in `kind` on `device`. Draws no random numbers, so seeded
/// sampling does not depend on whether a check ran.
fn self_check_inputs(
    kind: tch::Kind,
    device: tch::Device,
) -> impl Fn(&[i64], f64, f64) -> tch::Tensor {
    move |shape, step, scale| {
        let count: i64 = shape.iter().product();
        ((tch::Tensor::arange(count, (tch::Kind::Float, device)) * step).sin() * scale)
            .to_kind(kind)
            .view(shape)
    }
}

/// Largest difference between `got` and `want` relative to `want`'s largest magnitude (the
/// measure of our kernels' self-checks and tests).
pub fn relative_error(got: &tch::Tensor, want: &tch::Tensor) -> f64 {
    let want = want.to_kind(tch::Kind::Double);
    let scale = want.abs().max().double_value(&[]).max(1e-12);
    (got.to_kind(tch::Kind::Double) - want)
        .abs()
        .max()
        .double_value(&[])
        / scale
}

/// A kernel parameter as the driver's launch takes it: a pointer to its value.
fn kernel_arg<T>(value: &mut T) -> *mut std::ffi::c_void {
    value as *mut T as *mut std::ffi::c_void
}

/// How our kernels' function names call activations of `kind`: `bf16`, `f16` or `f32`.
fn dtype_name(kind: tch::Kind) -> anyhow::Result<&'static str> {
    Ok(match kind {
        tch::Kind::BFloat16 => "bf16",
        tch::Kind::Half => "f16",
        tch::Kind::Float => "f32",
        other => anyhow::bail!("our kernels take bf16, fp16 or fp32 activations, not {other:?}"),
    })
}

/// `a / b` rounded up, for positive `b` and non-negative `a` (kernel grids and row blocks).
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Whether `tensor`'s data starts on a 16-byte boundary, as the kernels' vector loads need.
fn aligned(tensor: &tch::Tensor) -> bool {
    (tensor.data_ptr() as usize).is_multiple_of(16)
}

/// `tensor` contiguous and starting on a 16-byte boundary: itself where it already is, else a
/// copy (the kernels read rows as 16-byte loads).
fn contiguous_aligned(tensor: &tch::Tensor) -> tch::Tensor {
    let tensor = tensor.contiguous();
    if aligned(&tensor) {
        tensor
    } else {
        tensor.copy()
    }
}

pub mod add_norm;
pub mod argmax;
pub mod bias_grad;
pub mod decode_attention;
pub mod decode_embedding;
pub mod decode_gemv;
pub mod flash_varlen;
pub mod fp8_cast;
pub mod gemm_epilogue;
pub mod multi_tensor;
mod normalization;
pub mod optimizer_kernels;
pub mod paged_attention;
pub mod rope;
pub mod softmax_cross_entropy;

pub use multi_tensor::{
    foreach_add_, foreach_copy_, foreach_mul_, foreach_zero_, fused_adamw, set_deterministic,
    total_norm, unscale_and_check_finite, AdamwHyper,
};
pub use normalization::Normalization;
