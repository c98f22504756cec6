//! The cross entropy of rows of logits and its gradient in one kernel, for the fused output
//! layer + loss (`--cross-entropy-loss-fusion`) on one tensor-parallel rank. For each row the
//! kernel reads the logits once to find the row's maximum and the sum of the exponentials (an
//! online softmax, in float32), then once more (from L2, mostly) to overwrite them with the
//! gradient `(softmax − one_hot(target)) · scale`, rounded once from float32 to the logits'
//! dtype; the loss `log Σ exp − logit[target]` is written in float32. libtorch's path makes four
//! passes over float32 copies of the logits (the conversion, the log-softmax, its exponential
//! into the gradient, the targets' entries), which took 4.5 ms of a GPT-345M step on an H100.
//!
//! The arithmetic is libtorch's up to summation order: the exponentials in float32 with `expf`,
//! the maximum subtracted first, the target's entry `p − 1` computed in float32 before it is
//! rounded. A target outside the row (another rank's, or an ignored label) has loss 0 and
//! leaves the gradient a plain softmax.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{aligned, dtype_name, kernel_arg, passes_self_check, relative_error, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Set to `0`, the environment variable that keeps the fused loss on libtorch's log-softmax
/// (Megatron has no flag for this).
pub const VARIABLE: &str = "MEGATRON_RS_FUSED_SOFTMAX_CROSS_ENTROPY";

/// Threads per block; a block takes one row.
const BLOCK_THREADS: u32 = 512;

/// The kernels' CUDA source (`lib/kernels/cuda/softmax_cross_entropy.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "softmax_cross_entropy",
    source: include_str!("../../cuda/softmax_cross_entropy.cu"),
    headers: super::HEADERS,
    functions: &[
        "softmax_cross_entropy_bf16_8",
        "softmax_cross_entropy_bf16_1",
        "softmax_cross_entropy_f16_8",
        "softmax_cross_entropy_f16_1",
        "softmax_cross_entropy_f32_8",
        "softmax_cross_entropy_f32_1",
    ],
    prefer_shared_memory: false,
};

/// Elements of a vector access.
const VEC: i64 = 8;

/// For each row of `logits` (`[rows, vocab]`, contiguous, bf16, fp16 or float32 on a CUDA
/// device) and its target (`[rows]` int64): the loss `log Σ exp(row) − row[target]` in float32
/// (0 where the target lies outside the row). With `grad_scale`, the logits are overwritten
/// with the gradient `(softmax(row) − one_hot(target)) · grad_scale`.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    grad_scale: Option<f64>,
) -> Result<Tensor> {
    let (kind, device) = (logits.kind(), logits.device());
    let Device::Cuda(index) = device else {
        bail!("the fused softmax cross entropy runs on CUDA devices, not {device:?}");
    };
    let (rows, vocab) = logits.size2()?;
    ensure!(
        logits.is_contiguous(),
        "the fused softmax cross entropy needs contiguous logits"
    );
    ensure!(
        targets.size() == [rows] && targets.kind() == Kind::Int64 && targets.device() == device,
        "the fused softmax cross entropy got targets {:?} {:?} on {:?} for {rows} rows on {device:?}",
        targets.kind(),
        targets.size(),
        targets.device()
    );
    ensure!(
        vocab <= i32::MAX as i64 && rows <= i32::MAX as i64,
        "{rows} rows of {vocab} logits are more than one launch takes"
    );
    let losses = Tensor::empty([rows], (Kind::Float, device));
    if rows == 0 {
        return Ok(losses);
    }
    let targets = targets.contiguous();
    let vector = if vocab % VEC == 0 && aligned(logits) {
        VEC
    } else {
        1
    };
    let module = kernels(&SOURCE, index)?;
    let function = format!("softmax_cross_entropy_{}_{vector}", dtype_name(kind)?);
    let [mut logits_ptr, mut targets_ptr, mut losses_ptr] =
        [logits, &targets, &losses].map(|t| t.data_ptr() as u64);
    let mut vocab_arg = vocab as i32;
    let mut scale = grad_scale.unwrap_or(1.0) as f32;
    let mut with_grad = i32::from(grad_scale.is_some());
    let mut args = [
        kernel_arg(&mut logits_ptr),
        kernel_arg(&mut targets_ptr),
        kernel_arg(&mut losses_ptr),
        kernel_arg(&mut vocab_arg),
        kernel_arg(&mut scale),
        kernel_arg(&mut with_grad),
    ];
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // the vocabulary and the flag as i32, the scale as f32); the logits are contiguous
    // [rows, vocab] of the kernel's dtype, 16-byte aligned with whole vectors per row when the
    // vector kernel runs; targets int64 [rows] and losses float32 [rows], all on this device;
    // one block per row. The contiguous copy of the targets is reused by the caching allocator
    // only for work queued on this stream after the kernel.
    unsafe {
        module.launch(
            &function,
            (rows as u32, 1, 1),
            (BLOCK_THREADS, 1, 1),
            &mut args,
        )?;
    }
    Ok(losses)
}

/// The same losses and gradient from libtorch's ops, in float32 (the reference of the
/// self-check and the tests): `(losses, gradient)`.
pub fn reference(logits: &Tensor, targets: &Tensor, grad_scale: f64) -> (Tensor, Tensor) {
    let vocab = logits.size()[1];
    let log_probs = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let inside = targets.ge(0).logical_and(&targets.lt(vocab));
    let local = targets.masked_fill(&inside.logical_not(), 0).unsqueeze(-1);
    let losses = log_probs
        .gather(-1, &local, false)
        .squeeze_dim(-1)
        .neg()
        .masked_fill(&inside.logical_not(), 0.0);
    let one_hot = Tensor::zeros_like(&log_probs).scatter(
        -1,
        &local,
        &inside.to_kind(Kind::Float).unsqueeze(-1),
    );
    (losses, (log_probs.exp() - one_hot) * grad_scale)
}

/// Whether the kernel should run for `kind` logits on `device`: a CUDA device, a dtype it takes,
/// [`VARIABLE`] not `0`, and [`self_check`] passed there (once per device and dtype; a failure
/// is reported once and libtorch's ops are used).
pub fn usable_on(device: Device, kind: Kind) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    dtype_name(kind).is_ok()
        && !turned_off(VARIABLE)
        && passes_self_check(
            "the fused softmax cross entropy",
            device,
            kind,
            0,
            "libtorch's log-softmax",
            || self_check(index, kind),
        )
}

/// Runs the kernel on CUDA device `device` on made-up rows of `kind` (a vector-aligned width and
/// an odd one, targets at both ends and one outside) and compares losses and gradients with
/// [`reference`].
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    for vocab in [4096, 1001] {
        let rows = 5;
        let logits = ((Tensor::arange(rows * vocab, (Kind::Float, cuda)) * 0.37).sin() * 6.0)
            .view([rows, vocab])
            .to_kind(kind);
        let targets = Tensor::from_slice(&[0, vocab - 1, 7, -1, vocab / 2]).to_device(cuda);
        let (want_losses, want_grad) = reference(&logits, &targets, 1.0);
        let grad = logits.copy();
        let losses = softmax_cross_entropy(&grad, &targets, Some(1.0))?;
        for (what, got, want) in [
            ("loss", &losses, &want_losses),
            ("gradient", &grad, &want_grad),
        ] {
            let error = relative_error(got, want);
            ensure!(
                error <= 2e-2,
                "the {what} over rows of {vocab} differs from libtorch's by {error:.3e} (relative)"
            );
        }
    }
    Ok(())
}
