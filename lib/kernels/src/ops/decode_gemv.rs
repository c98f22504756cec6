//! The linear layers of a decode step of few rows as one kernel each: `[rows, K] · Wᵀ` for a
//! weight `W` `[N, K]` in `nn.Linear`'s layout, with the input's LayerNorm or RMSNorm computed
//! on the way in and the bias, a GeLU and a residual added on the way out. At a handful of rows
//! a linear layer is a matrix-vector product bound by reading its weight; cuBLAS runs these
//! far below the memory bandwidth, and the norms, bias adds, activations and residual adds
//! around them are kernels of their own. Here every weight is read once for all rows, in
//! 16-byte loads, several in flight per lane, and a transformer layer's four linear layers
//! with everything around them are four kernels. Where a weight's slices fit, each block
//! first copies its slice into shared memory, before waiting for the previous kernel, so that
//! the weights of the next kernels stream in while one computes (`*_cached`); larger weights
//! (a language-model head, wide models) are read in the loop.
//!
//! Every row is computed alone (no sums across rows), so a row's result does not depend on the
//! other rows of its batch. Results are rounded to the activations' dtype where the unfused
//! layers round them (the normed input, the product plus bias, the activation), so that the
//! two paths agree up to the order of the sums.
//!
//! Compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's current stream,
//! so a decode step using them is captured in CUDA graphs.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::Normalization;
use super::{aligned, contiguous_aligned, dtype_name, kernel_arg, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource, Kernels};

/// The most rows the kernels take: more rows are a matrix product, cuBLAS's business.
pub const MAX_ROWS: i64 = 8;

/// Warps per block (the kernel's `WARPS`): each computes one or two output columns.
const WARPS: u32 = 8;

/// CUDA C++ of the decode linear kernels that the fused decode attention kernel
/// ([`super::decode_attention`]) shares: 16-byte packs, the staged and normed input rows,
/// the epilogue, asynchronous copies into shared memory, a column's sums. Needs `cuda_scalars!()` before it.
macro_rules! decode_gemv_parts {
    () => {
        r#"
constexpr int WARPS = 8;
// Flags of the prologue and epilogue.
constexpr int NORM_LAYER = 1;
constexpr int NORM_RMS = 2;
constexpr int NORM_ONE_PLUS = 4;
constexpr int ADD_BIAS = 8;
constexpr int GELU_TANH = 16;
constexpr int GELU_ERF = 32;
constexpr int ADD_RESIDUAL = 64;
// The block copies its input rows into shared memory (normed there), so that the loop over
// the weight reads them without a round trip to L2 per load.
constexpr int STAGE_INPUT = 128;

// 16 bytes of a row: 8 bf16 or fp16 values, or 4 float32 values.
struct alignas(16) Pack { unsigned int w[4]; };
template <typename T> struct Lanes { static constexpr int N = 8; };
template <> struct Lanes<float> { static constexpr int N = 4; };

__device__ __forceinline__ float half_bits(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}
__device__ __forceinline__ void unpack(const Pack& p, const bf16*, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(p.w[i] << 16);
        f[2 * i + 1] = __uint_as_float(p.w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ void unpack(const Pack& p, const f16*, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = half_bits((unsigned short)(p.w[i] & 0xffffu));
        f[2 * i + 1] = half_bits((unsigned short)(p.w[i] >> 16));
    }
}
__device__ __forceinline__ void unpack(const Pack& p, const float*, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(p.w[i]);
}
// The 16 bytes at p (16-byte aligned) as floats.
template <typename T>
__device__ __forceinline__ void load_pack(const T* p, float* f) {
    const Pack pack = *reinterpret_cast<const Pack*>(p);
    unpack(pack, p, f);
}
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// The block's input rows, ready for the loop over the weight. Staged (flags & STAGE_INPUT):
// copied into xs (shared memory) and normed there, and xs is returned. Otherwise x itself, and
// a norm is applied in the loop with the row statistics left in shift and scale. g0 and b0 are
// the norm weights of the pack at first_k, which this thread loaded before waiting.
template <typename T, int R>
__device__ const T* prepare_input(const T* __restrict__ x, T* xs, const T* __restrict__ gamma,
                                  const T* __restrict__ beta, int rows, int K, int flags,
                                  float eps, const float* g0, const float* b0, int first_k,
                                  float* shift, float* scale) {
    constexpr int V = Lanes<T>::N;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const bool layer_norm = flags & NORM_LAYER;
    const bool rms_norm = flags & NORM_RMS;
    const bool staged = flags & STAGE_INPUT;
    if (staged) {
        const int packs = rows * K / V;
#pragma unroll 4
        for (int i = threadIdx.x; i < packs; i += blockDim.x)
            *reinterpret_cast<Pack*>(xs + (long long)i * V) =
                *reinterpret_cast<const Pack*>(x + (long long)i * V);
        __syncthreads();
        x = xs;
    }
    if (!(layer_norm || rms_norm)) return x;
    // Row statistics in float32 in one pass over the row, its loads in flight together: sums
    // of the values and squares around a pivot (the row's first value for LayerNorm, zero for
    // RMSNorm), which keeps the variance E[(x-p)^2] - (E[x-p])^2 free of cancellation for rows
    // far from zero.
    for (int r = warp; r < rows && r < R; r += WARPS) {
        const T* row = x + (long long)r * K;
        const float pivot = layer_norm ? load(row) : 0.f;
        float sum = 0.f;
        float squares = 0.f;
#pragma unroll 4
        for (int k = lane * V; k < K; k += 32 * V) {
            float f[V];
            load_pack(row + k, f);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float d = f[i] - pivot;
                sum += d;
                squares += d * d;
            }
        }
        sum = warp_sum(sum) / K;
        squares = warp_sum(squares) / K;
        if (lane == 0) {
            const float variance = layer_norm ? fmaxf(squares - sum * sum, 0.f) : squares;
            shift[r] = layer_norm ? pivot + sum : 0.f;
            scale[r] = rsqrtf(variance + eps);
        }
    }
    __syncthreads();
    if (!staged) return x;
#pragma unroll 2
    for (int i = threadIdx.x * V; i < rows * K; i += blockDim.x * V) {
        const int r = i / K;
        const int k = i % K;
        float xv[V];
        float g[V];
        float b[V];
        load_pack(xs + i, xv);
        if (k == first_k) {
#pragma unroll
            for (int j = 0; j < V; ++j) {
                g[j] = g0[j];
                if (layer_norm) b[j] = b0[j];
            }
        } else {
            load_pack(gamma + k, g);
            if (layer_norm) load_pack(beta + k, b);
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (flags & NORM_ONE_PLUS) g[j] = rounded<T>(g[j] + 1.f);
            store(xs + i + j, layer_norm ? (xv[j] - shift[r]) * scale[r] * g[j] + b[j]
                                         : rounded<T>(xv[j] * scale[r]) * g[j]);
        }
    }
    __syncthreads();
    return xs;
}

// The norm weights of the first pack this thread normalizes, loaded before the wait.
template <typename T>
__device__ __forceinline__ int load_first_norm_pack(const T* __restrict__ gamma,
                                                    const T* __restrict__ beta, int K, int flags,
                                                    float* g0, float* b0) {
    constexpr int V = Lanes<T>::N;
    const int first_k = (threadIdx.x * V) % K;
    if ((flags & STAGE_INPUT) && (flags & (NORM_LAYER | NORM_RMS))) {
        load_pack(gamma + first_k, g0);
        if (flags & NORM_LAYER) load_pack(beta + first_k, b0);
    }
    return first_k;
}

// out[r, n] = epilogue(sum + bias): the product rounded, the GeLU, the residual.
template <typename T>
__device__ __forceinline__ void finish(float value, float bias, const T* __restrict__ residual,
                                       T* __restrict__ out, int r, long long n, int N,
                                       int flags) {
    if (flags & ADD_BIAS) value += bias;
    value = rounded<T>(value);
    if (flags & GELU_TANH) {
        const float inner = 0.7978845608028654f * (value + 0.044715f * value * value * value);
        value = rounded<T>(0.5f * value * (1.f + tanhf(inner)));
    } else if (flags & GELU_ERF) {
        value = rounded<T>(0.5f * value * (1.f + erff(value * 0.7071067811865476f)));
    }
    if (flags & ADD_RESIDUAL) value += load(residual + (long long)r * N + n);
    store(out + (long long)r * N + n, value);
}

// 16 bytes from global to shared memory without passing through registers (sm_80 and newer).
__device__ __forceinline__ void copy_16_async(void* shared, const void* global) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(shared);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global)
                 : "memory");
}

// acc[r] = sum_k xs[r, k] * column[k] for the rows of a staged input (both in shared memory),
// in every lane of the warp: its lanes stride along K in packs, then the warp sums them, in the
// order decode_gemv sums a column.
template <typename T, int R>
__device__ __forceinline__ void column_sums(const T* column, const T* xs, int rows, int K,
                                            float (&acc)[R]) {
    constexpr int V = Lanes<T>::N;
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
#pragma unroll 4
    for (int k = lane * V; k < K; k += 32 * V) {
        float wv[V];
        load_pack(column + k, wv);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= rows) break;
            float xv[V];
            load_pack(xs + (long long)r * K + k, xv);
#pragma unroll
            for (int i = 0; i < V; ++i) acc[r] += xv[i] * wv[i];
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
}

// What a block whose weight slice is being copied in (cp.async, committed) does next: loads
// the biases of its `count` columns from `first` into `biases` (float) and the norm's weights of
// its first pack, waits for the previous kernel, stages and norms the input rows into xs, and
// waits for its copies.
template <typename T, int R>
__device__ __forceinline__ void stage_after_copies(const T* __restrict__ x, T* xs,
                                                   const T* __restrict__ gamma,
                                                   const T* __restrict__ beta,
                                                   const T* __restrict__ bias, float* biases,
                                                   long long first, int count, int rows, int K,
                                                   int flags, float eps) {
    constexpr int V = Lanes<T>::N;
    if (flags & ADD_BIAS) {
        for (int c = threadIdx.x; c < count; c += blockDim.x) biases[c] = load(bias + first + c);
    }
    float g0[V];
    float b0[V];
    const int first_k = load_first_norm_pack(gamma, beta, K, flags, g0, b0);
    wait_for_previous_kernel();
    __shared__ float shift[R];
    __shared__ float scale[R];
    prepare_input<T, R>(x, xs, gamma, beta, rows, K, flags, eps, g0, b0, first_k, shift, scale);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}
"#
    };
}
pub(crate) use decode_gemv_parts;

/// The kernels' CUDA source: a warp computes `C` output columns (1 for up to 2 rows, else 2)
/// for all rows; its lanes stride along `K` in 16-byte loads, `16 / C` loads of each column in
/// flight, then the warp sums its lanes. A block first computes its rows' norm statistics
/// (one warp per row) when there is a prologue; the input is read from L1/L2, the weight once.
pub const SOURCE: KernelSource = KernelSource {
    name: "decode_gemv",
    source: concat!(
        cuda_scalars!(),
        dependent_launch!(),
        decode_gemv_parts!(),
        r#"
// out[r, n] = epilogue(sum_k prologue(x)[r, k] * w[n, k]) for r < rows (at most R), n < N,
// the weight streamed from global memory. x [rows, K], w [N, K], gamma and beta [K] (16-byte
// aligned, K a multiple of the lanes of a Pack); bias [N], residual and out [rows, N]; all
// contiguous.
template <typename T, int R, int C>
__device__ void decode_gemv(const T* __restrict__ x, const T* __restrict__ w,
                            T* __restrict__ out, const T* __restrict__ gamma,
                            const T* __restrict__ beta, const T* __restrict__ bias,
                            const T* __restrict__ residual, int rows, int K, int N, int flags,
                            float eps) {
    constexpr int V = Lanes<T>::N;
    constexpr int U = 16 / C;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const bool layer_norm = flags & NORM_LAYER;
    const bool rms_norm = flags & NORM_RMS;
    // Warps stride over groups of C columns: a block stages and norms its input once for all
    // its groups (a grid of one group per warp would run in many waves, each paying that).
    const long long stride = (long long)gridDim.x * WARPS * C;
    long long first = ((long long)blockIdx.x * WARPS + warp) * C;
    long long columns[C];
    auto aim = [&](long long group) {
#pragma unroll
        for (int c = 0; c < C; ++c) columns[c] = group + c < N ? group + c : N - 1;
    };
    aim(first);
    // A round of weight loads: U packs of each column per lane, in flight together. The first
    // goes out before the norm statistics, so that its latency hides theirs.
    Pack wp[U][C];
    auto load_round = [&](int base) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = base + u * 32 * V;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                if (k < K) wp[u][c] = *reinterpret_cast<const Pack*>(w + columns[c] * K + k);
            }
        }
    };
    // The weights do not depend on earlier kernels: their first round loads while the
    // previous kernel finishes.
    let_next_kernel_start();
    if (first < N) load_round(lane * V);
    // So are the bias of the column this lane writes (lane r·C + c writes row r, column
    // first + c) and the norm's weights of the first pack this thread normalizes.
    const int my_column = lane % C;
    auto bias_of = [&](long long group) {
        return (flags & ADD_BIAS) && group + my_column < N ? load(bias + group + my_column)
                                                           : 0.f;
    };
    float my_bias = bias_of(first);
    float g0[V];
    float b0[V];
    const int first_k = load_first_norm_pack(gamma, beta, K, flags, g0, b0);
    wait_for_previous_kernel();
    extern __shared__ __align__(16) unsigned char staged_input[];
    __shared__ float shift[R];
    __shared__ float scale[R];
    x = prepare_input<T, R>(x, reinterpret_cast<T*>(staged_input), gamma, beta, rows, K, flags,
                            eps, g0, b0, first_k, shift, scale);
    // A staged input is normed already.
    const bool norm_in_loop = (layer_norm || rms_norm) && !(flags & STAGE_INPUT);
    for (; first < N; first += stride) {
        float acc[R][C];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
        }
        for (int base = lane * V; base < K; base += 32 * V * U) {
            if (base != lane * V) load_round(base);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = base + u * 32 * V;
                if (k >= K) break;
                float wv[C][V];
#pragma unroll
                for (int c = 0; c < C; ++c) unpack(wp[u][c], w, wv[c]);
                float g[V];
                float b[V];
                if (norm_in_loop) {
                    load_pack(gamma + k, g);
                    if (flags & NORM_ONE_PLUS) {
#pragma unroll
                        for (int i = 0; i < V; ++i) g[i] = rounded<T>(g[i] + 1.f);
                    }
                    if (layer_norm) {
                        load_pack(beta + k, b);
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r >= rows) break;
                    float xv[V];
                    load_pack(x + (long long)r * K + k, xv);
                    if (norm_in_loop && layer_norm) {
#pragma unroll
                        for (int i = 0; i < V; ++i)
                            xv[i] = rounded<T>((xv[i] - shift[r]) * scale[r] * g[i] + b[i]);
                    } else if (norm_in_loop) {
#pragma unroll
                        for (int i = 0; i < V; ++i)
                            xv[i] = rounded<T>(rounded<T>(xv[i] * scale[r]) * g[i]);
                    }
#pragma unroll
                    for (int c = 0; c < C; ++c) {
#pragma unroll
                        for (int i = 0; i < V; ++i) acc[r][c] += xv[i] * wv[c][i];
                    }
                }
            }
        }
        // The next group's first round goes out before this group's sums and stores.
        const long long next = first + stride;
        float next_bias = 0.f;
        if (next < N) {
            aim(next);
            load_round(lane * V);
            next_bias = bias_of(next);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] = warp_sum(acc[r][c]);
        }
        // Lane r·C + c writes row r, column first + c.
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                if (lane != r * C + c || r >= rows || first + c >= N) continue;
                finish(acc[r][c], my_bias, residual, out, r, first + c, N, flags);
            }
        }
        my_bias = next_bias;
    }
}

// decode_gemv with the block's whole weight slice in shared memory: block b computes the
// `columns` columns from b·columns, whose weights are one contiguous stretch of w. The slice
// is copied in before the wait, so that it streams in while earlier kernels still run (blocks
// of several kernels fit an SM side by side), and the loop reads it from shared memory. Dynamic
// shared memory: the slice, then the staged input rows (always staged), then the biases.
// Each warp computes whole columns, its lanes summing the same products in the same order as
// decode_gemv's, so the two give the same bits.
template <typename T, int R>
__device__ void decode_gemv_cached(const T* __restrict__ x, const T* __restrict__ w,
                                   T* __restrict__ out, const T* __restrict__ gamma,
                                   const T* __restrict__ beta, const T* __restrict__ bias,
                                   const T* __restrict__ residual, int rows, int K, int N,
                                   int flags, float eps, int columns) {
    constexpr int V = Lanes<T>::N;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long first = (long long)blockIdx.x * columns;
    const int count = (int)min((long long)columns, N - first);
    extern __shared__ __align__(16) unsigned char dynamic_shared[];
    T* ws = reinterpret_cast<T*>(dynamic_shared);
    T* xs = ws + (long long)columns * K;
    float* biases = reinterpret_cast<float*>(xs + (long long)R * K);
    let_next_kernel_start();
    const T* slice = w + first * K;
    const int packs = count * K / V;
    for (int i = threadIdx.x; i < packs; i += blockDim.x)
        copy_16_async(ws + (long long)i * V, slice + (long long)i * V);
    asm volatile("cp.async.commit_group;" ::: "memory");
    stage_after_copies<T, R>(x, xs, gamma, beta, bias, biases, first, count, rows, K, flags,
                             eps);
    for (int c = warp; c < count; c += WARPS) {
        float acc[R];
        column_sums<T, R>(ws + (long long)c * K, xs, rows, K, acc);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (lane == r && r < rows)
                finish(acc[r], (flags & ADD_BIAS) ? biases[c] : 0.f, residual, out, r,
                       first + c, N, flags);
        }
    }
}

#define DECODE_GEMV(NAME, T, R, C)                                                          \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                               \
        NAME(const T* x, const T* w, T* out, const T* gamma, const T* beta, const T* bias,  \
             const T* residual, int rows, int K, int N, int flags, float eps) {             \
        decode_gemv<T, R, C>(x, w, out, gamma, beta, bias, residual, rows, K, N, flags,     \
                             eps);                                                          \
    }                                                                                       \
    extern "C" __global__ void __launch_bounds__(WARPS * 32)                               \
        NAME##_cached(const T* x, const T* w, T* out, const T* gamma, const T* beta,        \
                      const T* bias, const T* residual, int rows, int K, int N, int flags,  \
                      float eps, int columns) {                                             \
        decode_gemv_cached<T, R>(x, w, out, gamma, beta, bias, residual, rows, K, N, flags, \
                                 eps, columns);                                             \
    }

DECODE_GEMV(decode_gemv_bf16_1, bf16, 1, 1)
DECODE_GEMV(decode_gemv_bf16_2, bf16, 2, 1)
DECODE_GEMV(decode_gemv_bf16_4, bf16, 4, 2)
DECODE_GEMV(decode_gemv_bf16_8, bf16, 8, 2)
DECODE_GEMV(decode_gemv_f16_1, f16, 1, 1)
DECODE_GEMV(decode_gemv_f16_2, f16, 2, 1)
DECODE_GEMV(decode_gemv_f16_4, f16, 4, 2)
DECODE_GEMV(decode_gemv_f16_8, f16, 8, 2)
DECODE_GEMV(decode_gemv_f32_1, float, 1, 1)
DECODE_GEMV(decode_gemv_f32_2, float, 2, 1)
DECODE_GEMV(decode_gemv_f32_4, float, 4, 2)
DECODE_GEMV(decode_gemv_f32_8, float, 8, 2)
"#
    ),
    functions: &[
        "decode_gemv_bf16_1",
        "decode_gemv_bf16_1_cached",
        "decode_gemv_bf16_2",
        "decode_gemv_bf16_2_cached",
        "decode_gemv_bf16_4",
        "decode_gemv_bf16_4_cached",
        "decode_gemv_bf16_8",
        "decode_gemv_bf16_8_cached",
        "decode_gemv_f16_1",
        "decode_gemv_f16_1_cached",
        "decode_gemv_f16_2",
        "decode_gemv_f16_2_cached",
        "decode_gemv_f16_4",
        "decode_gemv_f16_4_cached",
        "decode_gemv_f16_8",
        "decode_gemv_f16_8_cached",
        "decode_gemv_f32_1",
        "decode_gemv_f32_1_cached",
        "decode_gemv_f32_2",
        "decode_gemv_f32_2_cached",
        "decode_gemv_f32_4",
        "decode_gemv_f32_4_cached",
        "decode_gemv_f32_8",
        "decode_gemv_f32_8_cached",
    ],
    prefer_shared_memory: true,
};

// The kernel's flags.
const NORM_LAYER: i32 = 1;
const NORM_RMS: i32 = 2;
const NORM_ONE_PLUS: i32 = 4;
pub(super) const ADD_BIAS: i32 = 8;
const GELU_TANH: i32 = 16;
const GELU_ERF: i32 = 32;
const ADD_RESIDUAL: i32 = 64;
pub(super) const STAGE_INPUT: i32 = 128;

/// Inputs up to this size are staged in dynamic shared memory: what a launch gets without
/// opting in (48 KiB) less room for the kernel's static shared memory.
const MAX_STAGED_BYTES: i64 = 47 * 1024;

/// `MEGATRON_RS_DECODE_CACHED_WEIGHTS=0` keeps every weight streamed (to compare).
pub const CACHED_WEIGHTS_VARIABLE: &str = "MEGATRON_RS_DECODE_CACHED_WEIGHTS";

/// Shared memory the system keeps for each resident block.
const RESERVED_SHARED_BYTES_PER_BLOCK: i64 = 1024;

/// The grid and shared memory of `decode_gemv_*_cached`: `blocks` blocks of `columns` weight
/// rows each; a block's dynamic shared memory holds its rows, the input rows of the kernel's
/// row count, and the biases in float32.
struct CachedLayout {
    blocks: u32,
    columns: i32,
    shared_bytes: u32,
}

/// The kernel template (1, 2, 4 or 8 rows) of the fewest rows that holds `rows`.
pub(super) fn template_rows(rows: i64) -> i64 {
    match rows {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    }
}

/// Dynamic shared memory a block may take when it takes at most a third of a multiprocessor's
/// (so that blocks of three successive kernels fit side by side) beside `static_bytes` of
/// static shared memory.
pub(super) fn third_of_multiprocessor(module: &Kernels, static_bytes: i64) -> i64 {
    i64::from(module.shared_bytes_per_multiprocessor) / 3
        - RESERVED_SHARED_BYTES_PER_BLOCK
        - static_bytes
}

impl CachedLayout {
    /// One block per multiprocessor, its slice of an `[n, k]` weight of `element`-byte values
    /// in shared memory, where all that takes at most a third of a multiprocessor's shared
    /// memory: then the blocks of three successive kernels fit side by side, and each kernel
    /// copies its slices in while the ones before it run. `None` for weights too large (a
    /// language-model head, wide models), which stream.
    fn of(module: &Kernels, template_rows: i64, k: i64, n: i64, element: i64) -> Option<Self> {
        if turned_off(CACHED_WEIGHTS_VARIABLE) {
            return None;
        }
        let multiprocessors = i64::from(module.multiprocessors.max(1));
        let columns = (n + multiprocessors - 1) / multiprocessors;
        let blocks = (n + columns - 1) / columns;
        let shared_bytes = (columns + template_rows) * k * element + columns * 4;
        // The kernel's static shared memory: the rows' norm statistics.
        let static_bytes = 2 * template_rows * 4;
        let share = third_of_multiprocessor(module, static_bytes);
        (shared_bytes <= share).then_some(CachedLayout {
            blocks: blocks as u32,
            columns: columns as i32,
            shared_bytes: shared_bytes as u32,
        })
    }
}

/// A LayerNorm or RMSNorm over the last dimension: the model's norms (see
/// `megatron_models::layers::Norm`) as plain tensor math, and as the kernels' prologue.
pub struct InputNorm<'a> {
    pub kind: Normalization,
    pub weight: &'a Tensor,
    /// LayerNorm's shift (RMSNorm has none).
    pub bias: Option<&'a Tensor>,
    pub eps: f64,
    /// `--apply-layernorm-1p`: the stored weight is zero-centred, gamma = 1 + weight.
    pub one_plus: bool,
}

impl InputNorm<'_> {
    /// The norm of `input` with libtorch's operations.
    pub fn apply(&self, input: &Tensor) -> Tensor {
        let gamma = if self.one_plus {
            self.weight + 1.0
        } else {
            self.weight.shallow_clone()
        };
        let hidden = *input
            .size()
            .last()
            .expect("normalised tensors have a hidden dimension");
        match self.kind {
            Normalization::LayerNorm => {
                input.layer_norm([hidden], Some(&gamma), self.bias, self.eps, true)
            }
            Normalization::RMSNorm => {
                // Statistics in float32 whatever the activation dtype, as Megatron's RMSNorm.
                let x = input.to_kind(Kind::Float);
                let inv_rms = (x.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
                (x * inv_rms).to_kind(input.kind()) * gamma
            }
        }
    }
}

/// A norm as the kernels' prologue reads it: its weights and its flags.
pub(super) struct NormPrologue {
    pub gamma: Tensor,
    /// LayerNorm's shift.
    pub beta: Option<Tensor>,
    pub flags: i32,
}

impl InputNorm<'_> {
    /// The norm's weights (contiguous, aligned copies where needed) for `input`'s rows and its
    /// flags, as the kernels take them.
    pub(super) fn prologue(&self, input: &Tensor) -> Result<NormPrologue> {
        let k = *input.size().last().unwrap_or(&0);
        let gamma = kernel_input(self.weight, &[k], input, "norm weight")?;
        let (beta, mut flags) = match (self.kind, self.bias) {
            (Normalization::LayerNorm, Some(bias)) => (
                Some(kernel_input(bias, &[k], input, "norm bias")?),
                NORM_LAYER,
            ),
            (Normalization::LayerNorm, None) => bail!("a LayerNorm without its bias"),
            (Normalization::RMSNorm, _) => (None, NORM_RMS),
        };
        if self.one_plus {
            flags |= NORM_ONE_PLUS;
        }
        Ok(NormPrologue { gamma, beta, flags })
    }
}

/// `t` as a kernel reads it beside `input`: of `shape`, `input`'s dtype and device (else an
/// error naming it `what`), contiguous and 16-byte aligned (a copy where it is not).
pub(super) fn kernel_input(
    t: &Tensor,
    shape: &[i64],
    input: &Tensor,
    what: &str,
) -> Result<Tensor> {
    let kind = input.kind();
    ensure!(
        t.size() == shape && t.kind() == kind && t.device() == input.device(),
        "the {what} is {:?} {:?} on {:?}; expected {kind:?} {shape:?} on {:?}",
        t.kind(),
        t.size(),
        t.device(),
        input.device()
    );
    Ok(contiguous_aligned(t))
}

/// The GeLU of the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// The tanh approximation.
    Tanh,
    /// The exact one, through erf.
    Erf,
}

/// What follows the product, in this order: `+ bias` (`[N]`), the GeLU, `+ residual`
/// (`[rows, N]`).
#[derive(Default)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a Tensor>,
    pub gelu: Option<Gelu>,
    pub residual: Option<&'a Tensor>,
}

/// Whether the kernels have a version for activations of `kind`.
pub fn supports(kind: Kind) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
}

/// Whether [`decode_linear`] takes `rows` rows through `weight` (`[N, K]`): 1 to
/// [`MAX_ROWS`] rows, a contiguous, 16-byte aligned CUDA weight of a supported dtype whose
/// rows are whole 16-byte loads.
pub fn fits(rows: i64, weight: &Tensor) -> bool {
    let size = weight.size();
    let lanes = 16 / weight.kind().elt_size_in_bytes().max(1) as i64;
    (1..=MAX_ROWS).contains(&rows)
        && size.len() == 2
        && size[0] > 0
        && size[1] > 0
        && (size[1] % lanes) == 0
        && size[0] < i32::MAX as i64
        && size[1] < i32::MAX as i64
        && supports(weight.kind())
        && weight.device().is_cuda()
        && weight.is_contiguous()
        && aligned(weight)
}

/// `epilogue(norm(input) · weightᵀ)`: `input` `[rows, K]` (1 to [`MAX_ROWS`] rows),
/// `weight` `[N, K]`, the optional `norm` over `K`; returns `[rows, N]` in the input's dtype.
/// On a CUDA device; the weight must [`fits`].
pub fn decode_linear(
    input: &Tensor,
    weight: &Tensor,
    norm: Option<&InputNorm>,
    epilogue: &Epilogue,
) -> Result<Tensor> {
    let (rows, k) = input.size2()?;
    let kind = input.kind();
    let Device::Cuda(device) = input.device() else {
        bail!("the decode linear kernels run on CUDA devices");
    };
    ensure!(
        weight.kind() == kind && weight.device() == input.device() && weight.dim() == 2,
        "a weight of {:?} {:?} on {:?} for an input of {kind:?} {:?}",
        weight.kind(),
        weight.size(),
        weight.device(),
        input.size()
    );
    let n = weight.size()[0];
    ensure!(
        weight.size()[1] == k,
        "a weight of {:?} for inputs of {k} channels",
        weight.size()
    );
    if rows == 0 {
        return Ok(Tensor::empty([0, n], (kind, input.device())));
    }
    ensure!(
        fits(rows, weight),
        "no decode linear kernel for {rows} rows through a {kind:?} weight of {:?} (at most \
         {MAX_ROWS} rows; contiguous, 16-byte aligned rows)",
        weight.size()
    );
    // Contiguous and aligned copies of what is not (the kernel reads rows as 16-byte loads).
    let ready = |t: &Tensor, shape: &[i64], what: &str| kernel_input(t, shape, input, what);
    let x = ready(input, &[rows, k], "input")?;
    let mut flags = 0;
    let (gamma, beta, eps) = match norm {
        None => (None, None, 0.0),
        Some(norm) => {
            let prologue = norm.prologue(input)?;
            flags |= prologue.flags;
            (Some(prologue.gamma), prologue.beta, norm.eps as f32)
        }
    };
    let bias = epilogue.bias.map(|b| ready(b, &[n], "bias")).transpose()?;
    if bias.is_some() {
        flags |= ADD_BIAS;
    }
    flags |= match epilogue.gelu {
        None => 0,
        Some(Gelu::Tanh) => GELU_TANH,
        Some(Gelu::Erf) => GELU_ERF,
    };
    let residual = epilogue
        .residual
        .map(|r| ready(r, &[rows, n], "residual"))
        .transpose()?;
    if residual.is_some() {
        flags |= ADD_RESIDUAL;
    }
    let out = Tensor::empty([rows, n], (kind, input.device()));
    let dtype = dtype_name(kind)?;
    // The kernel of the fewest rows that holds them.
    let template_rows = template_rows(rows);
    let columns_per_warp = if template_rows <= 2 { 1 } else { 2 };
    let module = kernels(&SOURCE, device)?;
    let element = kind.elt_size_in_bytes() as i64;
    // The cached kernel always stages its input (its shared memory has room for it) and takes
    // its columns per block as one more argument.
    let (function, blocks, shared_bytes, mut columns) =
        match CachedLayout::of(module, template_rows, k, n, element) {
            Some(cached) => {
                flags |= STAGE_INPUT;
                (
                    format!("decode_gemv_{dtype}_{template_rows}_cached"),
                    cached.blocks,
                    cached.shared_bytes,
                    Some(cached.columns),
                )
            }
            None => {
                let staged_bytes = rows * k * element;
                let staged = staged_bytes <= MAX_STAGED_BYTES;
                if staged {
                    flags |= STAGE_INPUT;
                }
                let per_block = (WARPS * columns_per_warp) as i64;
                let function = format!("decode_gemv_{dtype}_{template_rows}");
                let shared_bytes = if staged { staged_bytes as u32 } else { 0 };
                // One wave of blocks, striding over the columns: a language-model head has
                // thousands of column groups, and a block per group would run in many waves,
                // each staging and norming the input again.
                let resident = module.resident_blocks(&function, 32 * WARPS, shared_bytes)?;
                let wave = i64::from(module.multiprocessors) * i64::from(resident);
                let blocks = ((n + per_block - 1) / per_block).min(wave);
                (function, blocks as u32, shared_bytes, None)
            }
        };
    let pointer = |t: Option<&Tensor>| t.map_or(0u64, |t| t.data_ptr() as u64);
    let (mut x_ptr, mut w_ptr, mut out_ptr) = (
        pointer(Some(&x)),
        pointer(Some(weight)),
        pointer(Some(&out)),
    );
    let (mut gamma_ptr, mut beta_ptr, mut bias_ptr, mut residual_ptr) = (
        pointer(gamma.as_ref()),
        pointer(beta.as_ref()),
        pointer(bias.as_ref()),
        pointer(residual.as_ref()),
    );
    let (mut rows_arg, mut k_arg, mut n_arg, mut flags_arg, mut eps_arg) =
        (rows as i32, k as i32, n as i32, flags, eps);
    let mut args = vec![
        kernel_arg(&mut x_ptr),
        kernel_arg(&mut w_ptr),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut gamma_ptr),
        kernel_arg(&mut beta_ptr),
        kernel_arg(&mut bias_ptr),
        kernel_arg(&mut residual_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut k_arg),
        kernel_arg(&mut n_arg),
        kernel_arg(&mut flags_arg),
        kernel_arg(&mut eps_arg),
    ];
    if let Some(columns) = columns.as_mut() {
        args.push(kernel_arg(columns));
    }
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // counts and flags as i32, eps as f32); every tensor is on the device, contiguous, of the
    // shape checked above, the ones read in 16-byte loads aligned with rows of whole loads
    // (`fits`, `ready`); null pointers only where the flags say the kernel does not read them;
    // the shared memory holds what the kernel puts there (`CachedLayout`, `MAX_STAGED_BYTES`).
    // Copies dropped here return to the caching allocator, which reuses them only for work
    // queued on the stream after the kernel. The kernel waits for the previous one before it
    // reads anything but the weight, the bias and the norm's weights, and writes only after
    // that wait.
    unsafe {
        module.launch_overlapping(
            &function,
            (blocks, 1, 1),
            (32 * WARPS, 1, 1),
            shared_bytes,
            &mut args,
        )?;
    }
    Ok(out)
}

/// What [`decode_linear`] computes, with libtorch's operations (the unfused layers' math).
pub fn reference_linear(
    input: &Tensor,
    weight: &Tensor,
    norm: Option<&InputNorm>,
    epilogue: &Epilogue,
) -> Tensor {
    let normed = norm.map_or_else(|| input.shallow_clone(), |norm| norm.apply(input));
    let product = normed.linear(weight, epilogue.bias);
    let activated = match epilogue.gelu {
        None => product,
        Some(Gelu::Tanh) => product.gelu("tanh"),
        Some(Gelu::Erf) => product.gelu("none"),
    };
    match epilogue.residual {
        Some(residual) => residual + activated,
        None => activated,
    }
}

/// Whether `got` is within `absolute + relative · |want|` of `want` everywhere: the largest
/// excess, 0 when within.
pub fn excess_difference(got: &Tensor, want: &Tensor, absolute: f64, relative: f64) -> f64 {
    let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    ((got - &want).abs() - want.abs() * relative - absolute)
        .clamp_min(0.0)
        .max()
        .double_value(&[])
}

/// The tolerances ([`excess_difference`]) of the kernels against [`reference_linear`] in
/// `kind`: the two round to the same format, a unit in the last place or so apart, with
/// products of `K ≤ 8192` summed in another order.
pub fn tolerance(kind: Kind) -> (f64, f64) {
    match kind {
        Kind::Float => (1e-4, 1e-4),
        Kind::Half => (4e-3, 4.0 / 1024.0),
        _ => (3e-2, 4.0 / 128.0),
    }
}

/// Runs the kernels on CUDA device `device` in `kind` on small made-up inputs, each prologue
/// and epilogue once, and compares them with [`reference_linear`]: a launch or a result that
/// goes wrong is an error here, before any request depends on them. Draws no random numbers
/// (seeded sampling must not depend on whether it ran).
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let made_up = super::made_up(kind, cuda);
    let (absolute, relative) = tolerance(kind);
    struct Case {
        rows: i64,
        k: i64,
        n: i64,
        norm: Option<Normalization>,
        one_plus: bool,
        bias: bool,
        gelu: Option<Gelu>,
        residual: bool,
    }
    let cases = [
        Case {
            rows: 1,
            k: 256,
            n: 77,
            norm: Some(Normalization::LayerNorm),
            one_plus: false,
            bias: true,
            gelu: Some(Gelu::Tanh),
            residual: false,
        },
        Case {
            rows: 3,
            k: 512,
            n: 40,
            norm: Some(Normalization::RMSNorm),
            one_plus: true,
            bias: false,
            gelu: Some(Gelu::Erf),
            residual: false,
        },
        Case {
            rows: 8,
            k: 128,
            n: 200,
            norm: None,
            one_plus: false,
            bias: true,
            gelu: None,
            residual: true,
        },
        Case {
            rows: 5,
            k: 64,
            n: 33,
            norm: Some(Normalization::LayerNorm),
            one_plus: true,
            bias: true,
            gelu: None,
            residual: true,
        },
    ];
    for Case {
        rows,
        k,
        n,
        norm: norm_kind,
        one_plus,
        bias,
        gelu,
        residual,
    } in cases
    {
        let input = made_up(&[rows, k], 0.37, 2.0);
        let weight = made_up(&[n, k], 0.11, 1.0 / (k as f64).sqrt());
        let gamma = made_up(&[k], 0.7, 0.5) + if one_plus { 0.0 } else { 1.0 };
        let beta = made_up(&[k], 0.3, 0.1);
        let bias_tensor = made_up(&[n], 0.9, 0.2);
        let residual_tensor = made_up(&[rows, n], 0.23, 1.0);
        let norm = norm_kind.map(|kind| InputNorm {
            kind,
            weight: &gamma,
            bias: (kind == Normalization::LayerNorm).then_some(&beta),
            eps: 1e-5,
            one_plus,
        });
        let epilogue = Epilogue {
            bias: bias.then_some(&bias_tensor),
            gelu,
            residual: residual.then_some(&residual_tensor),
        };
        let got = decode_linear(&input, &weight, norm.as_ref(), &epilogue)?;
        let want = reference_linear(&input, &weight, norm.as_ref(), &epilogue);
        let excess = excess_difference(&got, &want, absolute, relative);
        ensure!(
            excess == 0.0,
            "the decode linear kernels' self-check ({kind:?}, {rows} rows, K {k}, N {n}) is off \
             by {excess} beyond the tolerance"
        );
    }
    Ok(())
}
