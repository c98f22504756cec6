// The pieces of the decode linear kernels (decode_gemv.cu) that the fused decode attention
// kernel (decode_attention.cu) shares: 16-byte packs, the staged and normed input rows, the
// epilogue, asynchronous copies into shared memory, a column's sums.
#ifndef MEGATRON_DECODE_GEMV_PARTS_CUH
#define MEGATRON_DECODE_GEMV_PARTS_CUH

#include "scalars.cuh"
#include "dependent_launch.cuh"

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

#endif  // MEGATRON_DECODE_GEMV_PARTS_CUH
