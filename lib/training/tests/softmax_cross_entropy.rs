//! The fused softmax cross entropy kernel (the loss of `--cross-entropy-loss-fusion` on one
//! rank): its losses and gradient equal libtorch's log-softmax path in float32 to a few units in
//! the last place of the logits' dtype, for every dtype, vocabulary widths that fill 16-byte
//! vectors and odd ones, targets at either end of a row and outside it, the fp16 held scale, a
//! loss without a gradient, and misaligned rows; and a GPT trained with the fused loss on the
//! kernel tracks the same run on libtorch's ops.

mod support;

use megatron_kernels::ops::relative_error;
use megatron_kernels::ops::softmax_cross_entropy::{reference, softmax_cross_entropy, VARIABLE};
use megatron_training::GptPretrainArgs;
use tch::{Device, Kind, Tensor};

#[test]
fn on_a_gpu_the_kernel_equals_libtorchs_log_softmax() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        // The dtype's precision: the gradient is rounded once to it.
        let tolerance = match kind {
            Kind::Float => 1e-5,
            Kind::Half => 2e-3,
            _ => 1e-2,
        };
        for vocab in [1, 7, 8, 1000, 50304] {
            let rows = 67;
            let logits = ((Tensor::arange(rows * vocab, (Kind::Float, cuda)) * 0.731).sin() * 9.0)
                .view([rows, vocab])
                .to_kind(kind);
            let mut targets: Vec<i64> = (0..rows).map(|r| (r * 7919) % vocab).collect();
            targets[0] = 0;
            targets[1] = vocab - 1;
            targets[2] = -100;
            targets[3] = vocab;
            let targets = Tensor::from_slice(&targets).to_device(cuda);
            let scale = if kind == Kind::Half { 1024.0 } else { 1.0 };
            let (want_losses, want_grad) = reference(&logits, &targets, scale);
            let only_loss = softmax_cross_entropy(&logits, &targets, None).unwrap();
            let grad = logits.copy();
            let losses = softmax_cross_entropy(&grad, &targets, Some(scale)).unwrap();
            let what = format!("{kind:?} rows of {vocab}");
            assert_eq!(losses.double_value(&[2]), 0.0, "{what}: a target outside");
            assert!(losses.equal(&only_loss), "{what}: the loss alone differs");
            let loss_error = relative_error(&losses, &want_losses);
            assert!(
                loss_error <= 1e-5,
                "{what}: losses differ by {loss_error:.3e}"
            );
            let grad_error =
                relative_error(&(grad.to_kind(Kind::Float) / scale), &(want_grad / scale));
            assert!(
                grad_error <= tolerance,
                "{what}: gradients differ by {grad_error:.3e}"
            );
            // Rows that start off a 16-byte boundary take the element-wise kernel.
            let shifted = Tensor::empty([rows * vocab + 1], (kind, cuda));
            let misaligned = shifted.narrow(0, 1, rows * vocab).view([rows, vocab]);
            misaligned.shallow_clone().copy_(&logits);
            let losses = softmax_cross_entropy(&misaligned, &targets, Some(scale)).unwrap();
            assert!(
                relative_error(&losses, &want_losses) <= 1e-5,
                "{what}: misaligned"
            );
            // The element-wise kernel sums in another order: the same values, not the same bits.
            let misaligned_error = relative_error(
                &(misaligned.to_kind(Kind::Float) / scale),
                &(grad.to_kind(Kind::Float) / scale),
            );
            assert!(
                misaligned_error <= tolerance,
                "{what}: misaligned rows' gradients differ by {misaligned_error:.3e}"
            );
        }
    }
}

#[test]
fn on_a_gpu_training_on_the_kernel_tracks_libtorchs_ops() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let mut flags = support::tiny_training(support::TINY_MODEL);
    flags.extend([
        "--bf16",
        "--cross-entropy-loss-fusion",
        "--train-iters",
        "8",
    ]);
    let (fused, plain) =
        support::gpu_lm_losses_with_and_without::<GptPretrainArgs>(&flags, VARIABLE);
    assert_ne!(fused, plain, "the variable changed nothing");
    support::assert_tracks(&fused, &plain, 8, 1e-3, "the softmax cross entropy kernel");
}
