//! The fused rotary embedding (`apply_rope_fusion`, off with `--no-rope-fusion`): the kernel
//! rotates like the same arithmetic in float32 to the activation dtype's rounding, forward and
//! backward, for every dtype, whole and partial rotary widths, strided query views and odd
//! shapes; the channels it does not rotate pass through bit for bit; through autograd the
//! rotation and its gradient are libtorch's ops' in float32; and a RoPE GPT trained on the kernel
//! tracks the same run on libtorch's ops.

mod support;

use megatron_kernels::ops::relative_error;
use megatron_kernels::ops::rope::{reference, rotate, Direction};
use megatron_models::layers::RotaryEmbedding;
use megatron_training::GptPretrainArgs;
use tch::{Device, Kind, Tensor};

/// Made-up `[s, b, heads, d]` activations of `kind`, as a view into a wider packed tensor
/// (strides like the attention's query part of the QKV projection).
fn strided_heads(s: i64, b: i64, heads: i64, d: i64, kind: Kind) -> Tensor {
    let cuda = Device::Cuda(0);
    let packed = ((Tensor::arange(s * b * heads * (d + 8), (Kind::Float, cuda)) * 0.731).sin()
        * 4.0)
        .view([s, b, heads, d + 8])
        .to_kind(kind);
    packed.narrow(-1, 8, d)
}

#[test]
fn on_a_gpu_the_kernel_rotates_like_float32_arithmetic() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        // One rounding to the dtype.
        let tolerance = match kind {
            Kind::Float => 1e-6,
            Kind::Half => 1e-3,
            _ => 8e-3,
        };
        for (s, b, heads, d, r) in [
            (1024, 2, 16, 64, 64),
            (37, 3, 5, 128, 128),
            (19, 1, 4, 64, 32),
            (8, 2, 2, 16, 8),
            (3, 2, 3, 80, 2),
        ] {
            let what = format!("{kind:?} [{s}, {b}, {heads}, {d}] rotating {r}");
            let embedding = RotaryEmbedding::new(r, 10000.0, None, true);
            let tables = embedding.tables(0, s, cuda);
            let inv_freq = (Tensor::arange_start_step(0, r, 2, (Kind::Float, cuda)) / r as f64
                * -(10000f64.ln()))
            .exp();
            let angles = Tensor::arange(s, (Kind::Float, cuda))
                .outer(&inv_freq)
                .repeat([1, 2]);
            let (cos, sin) = (angles.cos(), angles.sin());
            let x = strided_heads(s, b, heads, d, kind);
            for direction in [Direction::Forward, Direction::Backward] {
                let got = rotate(&x, &cos, &sin, direction).unwrap();
                assert!(got.is_contiguous(), "{what}: the output is not contiguous");
                assert_eq!(got.size(), [s, b, heads, d]);
                let want = reference(&x, &cos, &sin, direction);
                let error = relative_error(&got, &want);
                assert!(
                    error <= tolerance,
                    "{what} {direction:?}: differs by {error:.3e}"
                );
                assert!(
                    got.narrow(-1, r, d - r).equal(&x.narrow(-1, r, d - r)),
                    "{what}: the channels past {r} changed"
                );
            }
            // The backward is the forward's transpose: rotating back restores x up to rounding.
            let there = rotate(&x, &cos, &sin, Direction::Forward).unwrap();
            let back = rotate(&there, &cos, &sin, Direction::Backward).unwrap();
            assert!(
                relative_error(&back, &x) <= 2.0 * tolerance,
                "{what}: round trip"
            );
            // The model's tables give the same rotation as the angles computed here.
            let unfused = RotaryEmbedding::new(r, 10000.0, None, false)
                .tables(0, s, cuda)
                .apply(&x.to_kind(Kind::Float))
                .unwrap();
            let fused = tables.apply(&x).unwrap();
            assert!(
                relative_error(&fused, &unfused) <= tolerance,
                "{what}: the model's tables"
            );
        }
    }
}

#[test]
fn on_a_gpu_the_fused_rotation_backpropagates_like_libtorchs_ops() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    let (s, b, heads, d, r) = (33, 2, 4, 64, 32);
    // Only the rotation differs between the two passes: in float32 the same products up to fused
    // multiply-adds; in bf16 libtorch's ops round the tables and each product first.
    for (kind, tolerance) in [(Kind::Float, 1e-6), (Kind::BFloat16, 2e-2)] {
        let weights = strided_heads(s, b, heads, d, Kind::Float).cos();
        let grads: Vec<(Tensor, Tensor)> = [true, false]
            .iter()
            .map(|&fused| {
                let x = strided_heads(s, b, heads, d, kind)
                    .detach()
                    .set_requires_grad(true);
                let tables = RotaryEmbedding::new(r, 10000.0, None, fused).tables(0, s, cuda);
                let y = tables.apply(&x).unwrap();
                (y.to_kind(Kind::Float) * &weights)
                    .sum(Kind::Float)
                    .backward();
                (y.detach(), x.grad())
            })
            .collect();
        let [(fused_y, fused_grad), (plain_y, plain_grad)] = [&grads[0], &grads[1]];
        let what = format!("{kind:?}");
        assert!(
            relative_error(fused_y, plain_y) <= tolerance,
            "{what}: outputs"
        );
        let error = relative_error(fused_grad, plain_grad);
        assert!(
            error <= tolerance,
            "{what}: input gradients differ by {error:.3e}"
        );
        assert_eq!(fused_grad.kind(), kind);
        // The gradient of the passed-through channels is the incoming one.
        assert!(fused_grad
            .narrow(-1, r, d - r)
            .equal(&weights.narrow(-1, r, d - r).to_kind(kind)));
    }
}

#[test]
fn on_a_gpu_training_on_the_fused_rope_tracks_libtorchs_ops() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let mut flags = support::tiny_training(support::TINY_MODEL);
    flags.extend([
        "--bf16",
        "--position-embedding-type",
        "rope",
        "--rotary-percent",
        "0.5",
        "--train-iters",
        "8",
    ]);
    let fused = support::gpu_lm_losses::<GptPretrainArgs>(&flags);
    let plain = support::gpu_lm_losses::<GptPretrainArgs>(
        &[flags.as_slice(), &["--no-rope-fusion"]].concat(),
    );
    assert_ne!(fused, plain, "--no-rope-fusion changed nothing");
    support::assert_tracks(&fused, &plain, 8, 1e-3, "the fused rotary embedding");
}
