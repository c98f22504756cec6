//! Tensor operations libtorch has but tch-rs does not bind, reached through the C++ shim, and
//! small CUDA kernels of our own compiled at run time ([`crate::runtime::nvrtc`]).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// CUDA C++ the kernel sources share: 16-bit float types as raw bits (NVRTC gets no headers),
/// `load`/`store` between them and float32 (the conversions as PTX instructions), `neg_inf`
/// (NVRTC has no `INFINITY`), and `rounded`, a float32 value rounded to one of them.
macro_rules! cuda_scalars {
    () => {
        r#"
struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16* p) {
    return __uint_as_float(((unsigned int)p->bits) << 16);
}
__device__ __forceinline__ float load(const f16* p) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(p->bits));
    return value;
}
__device__ __forceinline__ void store(float* p, float value) { *p = value; }
__device__ __forceinline__ void store(bf16* p, float value) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    p->bits = bits;
}
__device__ __forceinline__ void store(f16* p, float value) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    p->bits = bits;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// value rounded to T (unchanged for float), as a kernel storing it in T would round it.
template <typename T>
__device__ __forceinline__ float rounded(float value) {
    T t;
    store(&t, value);
    return load(&t);
}
"#
    };
}

/// CUDA C++ for 16-byte vector accesses: `load8`/`store8` move 8 consecutive elements (16-byte
/// aligned; 32 bytes of float32) between memory and float32 registers.
macro_rules! vectors8 {
    () => {
        r#"
struct alignas(16) Words { unsigned int w[4]; };
struct alignas(16) Floats { float f[4]; };

// 8 consecutive elements (16-byte aligned) to float32 and back; the stores round to nearest even.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* out) {
    const Words v = *reinterpret_cast<const Words*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        T low, high;
        low.bits = (unsigned short)(v.w[k] & 0xffffu);
        high.bits = (unsigned short)(v.w[k] >> 16);
        out[2 * k] = load(&low);
        out[2 * k + 1] = load(&high);
    }
}
__device__ __forceinline__ void load8(const float* p, float* out) {
    const Floats a = reinterpret_cast<const Floats*>(p)[0];
    const Floats b = reinterpret_cast<const Floats*>(p)[1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[k] = a.f[k];
        out[4 + k] = b.f[k];
    }
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float* in) {
    Words v;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        T low, high;
        store(&low, in[2 * k]);
        store(&high, in[2 * k + 1]);
        v.w[k] = (unsigned int)low.bits | ((unsigned int)high.bits << 16);
    }
    *reinterpret_cast<Words*>(p) = v;
}
__device__ __forceinline__ void store8(float* p, const float* in) {
    Floats a, b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        a.f[k] = in[k];
        b.f[k] = in[4 + k];
    }
    reinterpret_cast<Floats*>(p)[0] = a;
    reinterpret_cast<Floats*>(p)[1] = b;
}
"#
    };
}

/// Row groups (`blockDim.y`) of `column_totals_into_main` and its kin, 32 columns a block.
const COLUMN_TOTAL_GROUPS: u32 = 16;

/// CUDA C++ for gradients summed over rows in two deterministic steps: a first kernel writes one
/// float32 partial row per block (`[blocks, columns]`), then `column_total` adds the partial rows
/// of a column in block order (row group `threadIdx.y` every `blockDim.y`-th row, then the
/// groups in order; the total lands in thread row 0), for grids of `columns / 32` × 1 or 2
/// blocks of 32 × `blockDim.y` threads (`blockIdx.y` picks the first or second partials), and
/// `column_totals_into_main` adds the totals to the optimizer's float32 gradients.
macro_rules! column_totals {
    () => {
        r#"
__device__ float column_total(const float* partial_a, const float* partial_b, long long blocks,
                              int columns) {
    __shared__ float sums[32][33];
    const float* partial = blockIdx.y == 0 ? partial_a : partial_b;
    const int column = blockIdx.x * 32 + threadIdx.x;
    float sum = 0.f;
    if (column < columns) {
        for (long long b = threadIdx.y; b < blocks; b += blockDim.y) {
            sum += partial[b * columns + column];
        }
    }
    sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    float total = 0.f;
    if (threadIdx.y == 0) {
        for (int y = 0; y < blockDim.y; ++y) total += sums[y][threadIdx.x];
    }
    return total;
}

extern "C" __global__ void column_totals_into_main(const float* partial_a, const float* partial_b,
                                                   long long blocks, int columns, float* main_a,
                                                   float* main_b) {
    const float total = column_total(partial_a, partial_b, blocks, columns);
    const int column = blockIdx.x * 32 + threadIdx.x;
    float* out = blockIdx.y == 0 ? main_a : main_b;
    if (threadIdx.y == 0 && column < columns) out[column] += total;
}
"#
    };
}

/// CUDA C++ for kernels launched with [`crate::runtime::nvrtc::Kernels::launch_overlapping`]:
/// `let_next_kernel_start()` lets the next such kernel on the stream begin (its blocks then
/// load what does not depend on this kernel), and `wait_for_previous_kernel()` waits until the
/// previous kernel has finished and its writes are visible. Both do nothing before Hopper.
macro_rules! dependent_launch {
    () => {
        r#"
__device__ __forceinline__ void let_next_kernel_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"#
    };
}

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

/// Made-up values for our kernels' self-checks, the same on every run: element `i` of a
/// `shape` tensor is `sin(i · step) · scale`, in `kind` on `device`. Draws no random numbers,
/// so seeded sampling does not depend on whether a check ran.
fn made_up(kind: tch::Kind, device: tch::Device) -> impl Fn(&[i64], f64, f64) -> tch::Tensor {
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
