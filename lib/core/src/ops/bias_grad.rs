//! Bias gradients summed by one NVRTC kernel into the optimizer's float32 buffer:
//! - the backward of fc1's bias + tanh-GeLU ([`crate::model::layers::linear_gelu`]) in one
//!   pass: the GeLU gradient `g · gelu'(x)` written in the activations' dtype, and at once its
//!   column sums, fc1's bias gradient. libtorch takes a GeLU backward kernel and then a GEMV that
//!   reads the whole gradient again (1.6 + 0.7 ms of a GPT-345M step on an H100);
//! - the bias gradient of a narrow linear ([`add_bias_grad`], up to [`NARROW_BIAS_COLUMNS`]
//!   columns: the attention projection's and fc2's), where libtorch's GEMV reaches under half
//!   the memory bandwidth (23.5 µs against 12.0 for `[8192, 2048]` bf16 on an H100; from 3,072
//!   columns on the two are even and the GEMV is ahead by 7–10% at 4,096 and 8,192).
//!
//! Each block takes 256 columns (8 per thread, 16-byte accesses) of a run of rows and writes
//! one float32 partial row of its column sums; `column_totals_into_main` adds the partial rows
//! in block order, so the same inputs give the same bits. The derivative is ATen's tanh-GeLU
//! backward in float32.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{
    contiguous_aligned, dtype_name, kernel_arg, passes_self_check, relative_error, turned_off,
    COLUMN_TOTAL_GROUPS,
};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Set to `0`, the environment variable that keeps the bias gradients on libtorch's GEMV (and
/// fc1's GeLU gradient on libtorch's kernel); Megatron has no flag for this.
pub const VARIABLE: &str = "MEGATRON_RS_FUSED_BIAS_GRAD";

/// The widest linear whose bias gradient [`add_bias_grad`] sums ([`sums_bias_of`]; see the
/// module's figures).
const NARROW_BIAS_COLUMNS: i64 = 2048;

/// Elements per thread (one 16-byte access of bf16/fp16).
const VEC: i64 = 8;
/// Threads across the columns and down the rows of a block.
const COLUMN_THREADS: i64 = 32;
const ROW_THREADS: i64 = 8;
/// Rows a block covers at least; more when that keeps the partial rows under [`MAX_PARTIALS`].
const MIN_ROWS_PER_BLOCK: i64 = 64;
const MAX_PARTIALS: i64 = 64;

pub const SOURCE: KernelSource = KernelSource {
    name: "bias_grad",
    source: concat!(
        cuda_scalars!(),
        vectors8!(),
        column_totals!(),
        r#"
constexpr int VEC = 8;
constexpr int COLUMN_THREADS = 32;
constexpr int ROW_THREADS = 8;

// ATen's tanh-GeLU gradient: g · (½(1 + tanh u) + ½x(1 − tanh²u)·β(1 + 3κx²)), u = β(x + κx³).
__device__ __forceinline__ float gelu_tanh_grad(float g, float x) {
    const float beta = 0.7978845608028654f;
    const float kappa = 0.044715f;
    const float x_sq = x * x;
    const float inner = beta * (x + kappa * x_sq * x);
    const float tanh_inner = tanhf(inner);
    const float left = 0.5f * x;
    const float right = 1.0f + tanh_inner;
    const float left_derivative = 0.5f * right;
    const float right_derivative =
        left * (1.0f - tanh_inner * tanh_inner) * beta * (1.0f + 3.0f * kappa * x_sq);
    return g * (left_derivative + right_derivative);
}

// With GELU, grad_in = gelu'(preactivation) · grad_out over rows [blockIdx.y · rows_per_block,
// +rows_per_block) and columns [blockIdx.x · 256, +256), and partial[blockIdx.y] gets those rows'
// column sums of grad_in as rounded to T (what a GEMV over the stored gradient would sum).
// Without, only the column sums of grad_out (the bias gradient of a linear without activation);
// preactivation and grad_in are not touched.
template <typename T, bool GELU>
__device__ void gelu_bias_grad(const T* __restrict__ grad_out,
                               const T* __restrict__ preactivation, T* __restrict__ grad_in,
                               float* __restrict__ partial, long long rows, int columns,
                               int rows_per_block) {
    __shared__ float sums[ROW_THREADS][COLUMN_THREADS * VEC];
    const int column = (blockIdx.x * COLUMN_THREADS + threadIdx.x) * VEC;
    const long long first = (long long)blockIdx.y * rows_per_block;
    const long long last = min(first + rows_per_block, rows);
    float sum[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum[k] = 0.f;
    if (column < columns) {
        // Two rows an iteration, their loads issued together, keep more bytes in flight.
        long long r = first + threadIdx.y;
        for (; r + ROW_THREADS < last; r += 2 * ROW_THREADS) {
            const long long at[2] = {r * columns + column, (r + ROW_THREADS) * columns + column};
            float g[2][VEC], x[2][VEC];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                load8(grad_out + at[j], g[j]);
                if constexpr (GELU) load8(preactivation + at[j], x[j]);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if constexpr (GELU) {
                    float out[VEC];
#pragma unroll
                    for (int k = 0; k < VEC; ++k) {
                        out[k] = rounded<T>(gelu_tanh_grad(g[j][k], x[j][k]));
                        sum[k] += out[k];
                    }
                    store8(grad_in + at[j], out);
                } else {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) sum[k] += g[j][k];
                }
            }
        }
        if (r < last) {
            const long long at = r * columns + column;
            float g[VEC];
            load8(grad_out + at, g);
            if constexpr (GELU) {
                float x[VEC], out[VEC];
                load8(preactivation + at, x);
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    out[k] = rounded<T>(gelu_tanh_grad(g[k], x[k]));
                    sum[k] += out[k];
                }
                store8(grad_in + at, out);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) sum[k] += g[k];
            }
        }
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) sums[threadIdx.y][threadIdx.x * VEC + k] = sum[k];
    __syncthreads();
    if (threadIdx.y == 0 && column < columns) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            float total = 0.f;
            for (int y = 0; y < ROW_THREADS; ++y) total += sums[y][threadIdx.x * VEC + k];
            partial[(long long)blockIdx.y * columns + column + k] = total;
        }
    }
}

#define GELU_BIAS_GRAD(SUFFIX, T)                                                              \
    extern "C" __global__ void __launch_bounds__(COLUMN_THREADS * ROW_THREADS)                 \
        gelu_bias_grad_##SUFFIX(const T* grad_out, const T* preactivation, T* grad_in,         \
                                float* partial, long long rows, int columns,                   \
                                int rows_per_block) {                                          \
        gelu_bias_grad<T, true>(grad_out, preactivation, grad_in, partial, rows, columns,      \
                                rows_per_block);                                               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(COLUMN_THREADS * ROW_THREADS)                 \
        bias_grad_##SUFFIX(const T* grad_out, const T* preactivation, T* grad_in,              \
                           float* partial, long long rows, int columns, int rows_per_block) {  \
        gelu_bias_grad<T, false>(grad_out, preactivation, grad_in, partial, rows, columns,     \
                                 rows_per_block);                                              \
    }

GELU_BIAS_GRAD(bf16, bf16)
GELU_BIAS_GRAD(f16, f16)
"#
    ),
    functions: &[
        "gelu_bias_grad_bf16",
        "gelu_bias_grad_f16",
        "bias_grad_bf16",
        "bias_grad_f16",
        "column_totals_into_main",
    ],
    prefer_shared_memory: false,
};

/// Whether the kernel takes `[rows, columns]` gradients of `kind`.
pub fn supports(kind: Kind, columns: i64) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half) && columns > 0 && columns % VEC == 0
}

/// `a / b` rounded up, for positive `b` and non-negative `a`.
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// The gradient of `gelu_tanh(preactivation)` given `grad` (both `[rows, columns]`, bf16 or
/// fp16, on one CUDA device; `columns` a multiple of 8), with its column sums added to
/// `bias_main_grad` (float32 `[columns]`).
pub fn gelu_backward_with_bias_grad(
    grad: &Tensor,
    preactivation: &Tensor,
    bias_main_grad: &Tensor,
) -> Result<Tensor> {
    let (rows, columns) = grad.size2()?;
    ensure!(
        preactivation.size() == [rows, columns]
            && preactivation.kind() == grad.kind()
            && preactivation.device() == grad.device(),
        "GeLU's argument is {:?} {:?}; expected {:?} [{rows}, {columns}]",
        preactivation.kind(),
        preactivation.size(),
        grad.kind()
    );
    let grad_input = column_sums_into(grad, Some(preactivation), bias_main_grad)?;
    Ok(grad_input.expect("the GeLU kernel writes the GeLU gradient"))
}

/// Adds the column sums of `grad` (`[rows, columns]`, bf16 or fp16, on one CUDA device;
/// `columns` a multiple of 8) to `bias_main_grad` (float32 `[columns]`): the bias gradient of a
/// linear, which libtorch computes as a GEMV at under half the memory bandwidth.
pub fn add_bias_grad(grad: &Tensor, bias_main_grad: &Tensor) -> Result<()> {
    column_sums_into(grad, None, bias_main_grad).map(|_| ())
}

/// The kernel and the column totals: with `preactivation`, the GeLU gradient (returned) and its
/// column sums; without, the column sums of `grad`.
fn column_sums_into(
    grad: &Tensor,
    preactivation: Option<&Tensor>,
    bias_main_grad: &Tensor,
) -> Result<Option<Tensor>> {
    let (kind, device) = (grad.kind(), grad.device());
    let Device::Cuda(index) = device else {
        bail!("the fused bias gradient runs on CUDA devices, not {device:?}");
    };
    let (rows, columns) = grad.size2()?;
    ensure!(
        supports(kind, columns),
        "no fused bias gradient kernel for {kind:?} rows of {columns}"
    );
    ensure!(
        bias_main_grad.size() == [columns]
            && bias_main_grad.kind() == Kind::Float
            && bias_main_grad.is_contiguous()
            && bias_main_grad.device() == device,
        "the bias's main gradient is {:?} {:?}; expected float32 [{columns}]",
        bias_main_grad.kind(),
        bias_main_grad.size()
    );
    ensure!(
        columns <= i32::MAX as i64,
        "{columns} columns are more than the kernel takes"
    );
    let grad = contiguous_aligned(grad);
    let preactivation = preactivation.map(contiguous_aligned);
    let grad_input = preactivation
        .as_ref()
        .map(|_| Tensor::empty([rows, columns], (kind, device)));
    if rows == 0 {
        return Ok(grad_input);
    }
    let rows_per_block = ceil_div(rows, MAX_PARTIALS).max(MIN_ROWS_PER_BLOCK);
    let row_blocks = ceil_div(rows, rows_per_block);
    let column_blocks = ceil_div(columns, COLUMN_THREADS * VEC);
    let partial = Tensor::empty([row_blocks, columns], (Kind::Float, device));
    let module = kernels(&SOURCE, index)?;
    let pointer = |t: Option<&Tensor>| t.map_or(0, |t| t.data_ptr() as u64);
    let (mut grad_ptr, mut pre_ptr, mut input_ptr) = (
        pointer(Some(&grad)),
        pointer(preactivation.as_ref()),
        pointer(grad_input.as_ref()),
    );
    let [mut partial_ptr, mut main_ptr] = [&partial, bias_main_grad].map(|t| t.data_ptr() as u64);
    let (mut rows_arg, mut columns_arg) = (rows, columns as i32);
    let mut rows_per_block_arg = i32::try_from(rows_per_block)?;
    let mut args = [
        kernel_arg(&mut grad_ptr),
        kernel_arg(&mut pre_ptr),
        kernel_arg(&mut input_ptr),
        kernel_arg(&mut partial_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut rows_per_block_arg),
    ];
    let (mut partial_b, mut main_b) = (0u64, 0u64);
    let mut partial_a = partial_ptr;
    let mut blocks_arg = row_blocks;
    let mut total_args = [
        kernel_arg(&mut partial_a),
        kernel_arg(&mut partial_b),
        kernel_arg(&mut blocks_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut main_ptr),
        kernel_arg(&mut main_b),
    ];
    let kernel = match preactivation {
        Some(_) => format!("gelu_bias_grad_{}", dtype_name(kind)?),
        None => format!("bias_grad_{}", dtype_name(kind)?),
    };
    // SAFETY: the arguments match the kernels' parameters in order and type (pointers as u64,
    // rows and the block count as i64, columns and rows per block as i32); the gradients and
    // GeLU's argument are contiguous, 16-byte aligned [rows, columns] of the kernel's dtype with
    // columns a multiple of 8 (every row starts aligned), and null exactly for the kernel that
    // does not touch them; the partial rows are float32 [row_blocks, columns] with
    // row_blocks · rows_per_block >= rows, the main gradient float32 [columns]; the second
    // partials and output are null and only grid row 0 of the totals runs. All live on this
    // device until the kernels have run: memory returned to the caching allocator is reused only
    // by work queued after them on this stream.
    unsafe {
        module.launch(
            &kernel,
            (column_blocks as u32, row_blocks as u32, 1),
            (COLUMN_THREADS as u32, ROW_THREADS as u32, 1),
            &mut args,
        )?;
        module.launch(
            "column_totals_into_main",
            (ceil_div(columns, 32) as u32, 1, 1),
            (32, COLUMN_TOTAL_GROUPS, 1),
            &mut total_args,
        )?;
    }
    Ok(grad_input)
}

/// Whether [`add_bias_grad`] should sum the bias gradient of a linear with `columns` outputs:
/// a narrow one ([`NARROW_BIAS_COLUMNS`]; libtorch's GEMV is as fast from 3,072 on) where
/// [`usable_on`] holds.
pub fn sums_bias_of(device: Device, kind: Kind, columns: i64) -> bool {
    columns <= NARROW_BIAS_COLUMNS && usable_on(device, kind, columns)
}

/// Whether the kernels should run for `kind` gradients of `columns` on `device`: a CUDA device,
/// [`supports`], [`VARIABLE`] not `0`, and [`self_check`] passed there (once per device and
/// dtype; a failure is reported once and libtorch's ops are used).
pub fn usable_on(device: Device, kind: Kind, columns: i64) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    supports(kind, columns)
        && !turned_off(VARIABLE)
        && passes_self_check(
            "the fused bias gradients",
            device,
            kind,
            0,
            "libtorch's GeLU backward and GEMVs",
            || self_check(index, kind),
        )
}

/// What libtorch's ops give: the GeLU gradient in the activations' dtype and its column sums in
/// float32 (the reference of the self-check and the tests).
pub fn reference(grad: &Tensor, preactivation: &Tensor) -> (Tensor, Tensor) {
    let grad_input = preactivation.gelu_backward(grad, "tanh");
    let sums =
        grad_input
            .to_kind(Kind::Float)
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    (grad_input, sums)
}

/// Runs both kernels on CUDA device `device` on made-up `[300, 1032]` gradients of `kind` and
/// compares the GeLU gradient and the bias gradients with [`reference`] and column sums.
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let (rows, columns) = (300, 1032);
    let made_up = |step: f64, scale: f64| {
        ((Tensor::arange(rows * columns, (Kind::Float, cuda)) * step).sin() * scale)
            .view([rows, columns])
            .to_kind(kind)
    };
    let (grad, preactivation) = (made_up(0.37, 1.0), made_up(0.11, 3.0));
    let (want_input, want_sums) = reference(&grad, &preactivation);
    let main = Tensor::zeros([columns], (Kind::Float, cuda));
    let got = gelu_backward_with_bias_grad(&grad, &preactivation, &main)?;
    let plain_main = Tensor::zeros([columns], (Kind::Float, cuda));
    add_bias_grad(&grad, &plain_main)?;
    let plain_sums =
        grad.to_kind(Kind::Float)
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    for (what, got, want) in [
        ("GeLU gradient", &got, &want_input),
        ("bias gradient after GeLU", &main, &want_sums),
        ("bias gradient", &plain_main, &plain_sums),
    ] {
        let error = relative_error(got, want);
        ensure!(
            error <= 1e-2,
            "the {what} differs from libtorch's by {error:.3e} (relative)"
        );
    }
    Ok(())
}
