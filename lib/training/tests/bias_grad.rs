//! The bias-gradient kernels (`ops::bias_grad`): on a GPU the fused GeLU gradient of fc1's backward equals libtorch's tanh-GeLU
//! backward, and the bias gradients both kernels add to a float32 buffer equal the column sums
//! (of that gradient, or of a linear's output gradient), for bf16 and fp16, widths from 8 to
//! 4096, one row to many, and inputs off a 16-byte boundary; the same inputs give the same bits
//! twice; the packed QKV gradient equals the concatenation of its parts, whatever their memory
//! order, with the plain kernel's column sums of it bit for bit; and a GPT trained with them
//! tracks the same run on libtorch's ops.

mod support;

use megatron_kernels::ops::bias_grad::{
    add_bias_grad, gelu_backward_with_bias_grad, made_up_qkv_grad, pack_qkv_grad, reference,
    VARIABLE,
};
use megatron_kernels::ops::relative_error;
use megatron_training::GptPretrainArgs;
use tch::{Device, Kind, Tensor};

fn values(rows: i64, columns: i64, step: f64, scale: f64, kind: Kind) -> Tensor {
    ((Tensor::arange(rows * columns, (Kind::Float, Device::Cuda(0))) * step).sin() * scale)
        .view([rows, columns])
        .to_kind(kind)
}

#[test]
fn on_a_gpu_the_kernels_equal_libtorchs_gelu_backward_and_bias_sums() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    for kind in [Kind::BFloat16, Kind::Half] {
        for (rows, columns) in [(1, 8), (300, 1032), (8192, 4096), (77, 4096)] {
            let what = format!("{kind:?} [{rows}, {columns}]");
            let grad = values(rows, columns, 0.37, 1.0, kind);
            let preactivation = values(rows, columns, 0.11, 4.0, kind);
            let (want, want_sums) = reference(&grad, &preactivation);
            let start = Tensor::full([columns], 0.5, (Kind::Float, Device::Cuda(0)));
            let main = start.copy();
            let got = gelu_backward_with_bias_grad(&grad, &preactivation, &main).unwrap();
            // ATen rounds the same float32 derivative once; the last bit may differ where the
            // two compute tanh differently.
            let error = relative_error(&got, &want);
            assert!(
                error <= 8e-3,
                "{what}: GeLU gradients differ by {error:.3e}"
            );
            let sums_error = relative_error(&(&main - &start), &want_sums);
            assert!(
                sums_error <= 1e-3,
                "{what}: bias gradients differ by {sums_error:.3e}"
            );
            let again = start.copy();
            let repeated = gelu_backward_with_bias_grad(&grad, &preactivation, &again).unwrap();
            assert!(
                repeated.equal(&got) && again.equal(&main),
                "{what}: not deterministic"
            );
            // Inputs that start off a 16-byte boundary are copied, not misread.
            let storage = Tensor::empty([rows * columns + 1], (kind, Device::Cuda(0)));
            let shifted = storage.narrow(0, 1, rows * columns).view([rows, columns]);
            shifted.shallow_clone().copy_(&grad);
            let main_shifted = start.copy();
            let from_shifted =
                gelu_backward_with_bias_grad(&shifted, &preactivation, &main_shifted).unwrap();
            assert!(from_shifted.equal(&got), "{what}: misaligned input");

            // The plain bias gradient: column sums of the gradient itself.
            let plain_sums =
                grad.to_kind(Kind::Float)
                    .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
            let plain = start.copy();
            add_bias_grad(&grad, &plain).unwrap();
            let plain_error = relative_error(&(&plain - &start), &plain_sums);
            assert!(
                plain_error <= 1e-3,
                "{what}: plain bias gradients differ by {plain_error:.3e}"
            );
            let plain_again = start.copy();
            add_bias_grad(&grad, &plain_again).unwrap();
            assert!(
                plain_again.equal(&plain),
                "{what}: plain sums not deterministic"
            );
            let plain_shifted = start.copy();
            add_bias_grad(&shifted, &plain_shifted).unwrap();
            assert!(
                plain_shifted.equal(&plain),
                "{what}: misaligned plain input"
            );
        }
    }
}

/// Query, key and value gradients `[s, b, groups, width]` of a GPT-shaped layer as attention's
/// backward leaves them (`[b, heads, s, d]` memory order) or as views of one tensor.
fn attention_like_parts(
    packed: &Tensor,
    s: i64,
    b: i64,
    groups: i64,
    query_width: i64,
    head_dim: i64,
    strided: bool,
) -> [Tensor; 3] {
    let packed = packed.view([s, b, groups, query_width + 2 * head_dim]);
    let parts = packed.split_with_sizes([query_width, head_dim, head_dim], -1);
    let part = |t: &Tensor| {
        if strided {
            t.shallow_clone()
        } else {
            t.permute([1, 2, 0, 3]).contiguous().permute([2, 0, 1, 3])
        }
    };
    [part(&parts[0]), part(&parts[1]), part(&parts[2])]
}

#[test]
fn on_a_gpu_the_packed_qkv_gradient_is_the_concatenation_with_its_column_sums() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    for kind in [Kind::BFloat16, Kind::Half] {
        let (want, query, key, value) = made_up_qkv_grad(cuda, kind);
        let main = Tensor::zeros([want.size()[1]], (Kind::Float, cuda));
        let got = pack_qkv_grad(&query, &key, &value, &main).unwrap();
        assert!(got.equal(&want), "{kind:?}: made-up parts");
        // (s, b, groups, query width, head dim): GPT-1.3B's shape, a grouped-query one, one
        // row, rows that fill no block.
        for (s, b, groups, query_width, head_dim) in [
            (1024, 8, 32, 64, 64),
            (128, 3, 4, 4 * 128, 128),
            (1, 1, 2, 8, 8),
            (67, 5, 3, 16, 8),
        ] {
            let columns = groups * (query_width + 2 * head_dim);
            let packed = values(s * b, columns, 0.31, 2.0, kind);
            for strided in [true, false] {
                let what = format!("{kind:?} {s}×{b}, {groups} groups of {query_width} + 2×{head_dim}, strided {strided}");
                let [q, k, v] =
                    attention_like_parts(&packed, s, b, groups, query_width, head_dim, strided);
                let start = Tensor::full([columns], 0.25, (Kind::Float, cuda));
                let main = start.copy();
                let got = pack_qkv_grad(&q, &k, &v, &main).unwrap();
                assert!(got.equal(&packed), "{what}: packed gradient");
                let plain = start.copy();
                add_bias_grad(&packed, &plain).unwrap();
                assert!(main.equal(&plain), "{what}: bias gradient");
            }
        }
        // Parts off a 16-byte boundary are copied, not misread.
        let (s, b, groups, query_width, head_dim) = (16, 2, 4, 64, 64);
        let columns = groups * (query_width + 2 * head_dim);
        let storage = Tensor::empty([s * b * columns + 1], (kind, cuda));
        let shifted = storage.narrow(0, 1, s * b * columns).view([s * b, columns]);
        shifted
            .shallow_clone()
            .copy_(&values(s * b, columns, 0.17, 1.0, kind));
        let [q, k, v] = attention_like_parts(&shifted, s, b, groups, query_width, head_dim, true);
        let main = Tensor::zeros([columns], (Kind::Float, cuda));
        let got = pack_qkv_grad(&q, &k, &v, &main).unwrap();
        assert!(got.equal(&shifted), "{kind:?}: misaligned parts");
    }
}

#[test]
fn on_a_gpu_training_on_the_kernels_tracks_libtorchs_ops() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let mut flags = support::tiny_training(support::TINY_MODEL);
    flags.extend(["--bf16", "--train-iters", "8"]);
    let (fused, plain) =
        support::gpu_lm_losses_with_and_without::<GptPretrainArgs>(&flags, VARIABLE);
    support::assert_tracks(&fused, &plain, 8, 2e-3, "the bias-gradient kernels");
}
