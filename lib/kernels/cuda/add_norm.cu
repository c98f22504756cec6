// The residual add and the norm after it, forward and backward, with the gamma/beta gradients
// summed in a fixed order (ops::add_norm).

#include "scalars.cuh"
#include "vectors8.cuh"
#include "column_totals.cuh"

constexpr int VEC = 8;
constexpr int BLOCK_THREADS = 256;

struct Pair { float a, b; };

// A 32-bit integer mixer (xor-shift-multiply rounds): every input bit reaches every output bit.
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// Dropout of the 8 elements of delta from `index` (a multiple of 8) on, as libtorch's kernel
// computes it: a kept element scaled in float32 and rounded to T, a dropped one 0. An element is
// dropped when the top 24 bits of its hash fall below `threshold` (the drop probability times
// 2^24). Counter-based, so backward draws the same mask again instead of reading a stored one:
// two mixer rounds key the vector's index with the 64-bit seed, and one more round per element
// spreads that over the vector's 8 elements (a third of the work of hashing each element alone,
// which made the forward kernel compute-bound).
template <typename T> __device__ __forceinline__ void drop8(float* values, unsigned long long seed,
                                                            unsigned long long index,
                                                            unsigned int threshold, float scale) {
    const unsigned long long vector = index / VEC;
    const unsigned int first = mix32((unsigned int)vector ^ (unsigned int)seed);
    const unsigned int key = mix32(first + (unsigned int)(seed >> 32)
                                   + (unsigned int)(vector >> 32) * 0x9e3779b9u);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
        const unsigned int h = mix32(key + (unsigned int)e * 0x9e3779b9u);
        values[e] = (h >> 8) >= threshold ? rounded<T>(values[e] * scale) : 0.f;
    }
}

// Gamma from the stored weight: 1 + w rounded to the weight's dtype with --apply-layernorm-1p.
template <typename T> __device__ __forceinline__ void load_gamma(const T* weight, int one_plus,
                                                                 float* gamma) {
    load8(weight, gamma);
    if (one_plus) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) gamma[e] = rounded<T>(gamma[e] + 1.f);
    }
}

// Sums a and b over the threads of this thread's row group (threadIdx.y; blockDim.x threads, a
// multiple of 32; blockDim.x * blockDim.y <= 1024) in a fixed order; every thread of the group
// gets the sums. Every thread of the block must call it.
__device__ __forceinline__ void group_sum2(float& a, float& b) {
    __shared__ Pair warp_sums[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        a += __shfl_xor_sync(0xffffffffu, a, offset);
        b += __shfl_xor_sync(0xffffffffu, b, offset);
    }
    const int warps = blockDim.x / 32;
    Pair* sums = warp_sums + threadIdx.y * warps;
    if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = Pair{a, b};
    __syncthreads();
    float total_a = 0.f, total_b = 0.f;
    for (int w = 0; w < warps; ++w) {
        total_a += sums[w].a;
        total_b += sums[w].b;
    }
    __syncthreads();
    a = total_a;
    b = total_b;
}

// Row group threadIdx.y of block blockIdx.x normalises row blockIdx.x * blockDim.y +
// threadIdx.y of [rows, hidden]; thread threadIdx.x holds its vectors threadIdx.x + k *
// blockDim.x (k < VPT). mean/rstd: float32 [rows] (RMSNorm writes a mean of 0). bias may be null.
// With a seed (else null), delta is dropped out first (drop8).
template <typename T, int VPT>
__device__ void add_norm_forward(const T* residual, const T* delta, const T* weight,
                                 const T* bias, T* sum, T* normed, float* mean_out,
                                 float* rstd_out, long long rows, int hidden, float eps, int rms,
                                 int one_plus, const unsigned long long* seed,
                                 unsigned int threshold, float scale) {
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    const bool live = row < rows;
    const int vectors = hidden / VEC;
    const long long base = live ? row * hidden : 0;
    float x[VPT][VEC];
    float total = 0.f, unused = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (live && v < vectors) {
            const long long at = base + (long long)v * VEC;
            float r[VEC], d[VEC];
            load8(residual + at, r);
            load8(delta + at, d);
            if (seed) drop8<T>(d, *seed, at, threshold, scale);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                x[k][e] = rounded<T>(r[e] + d[e]);
                total += x[k][e];
            }
            store8(sum + at, x[k]);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) x[k][e] = 0.f;
        }
    }
    float mean = 0.f;
    if (!rms) {
        group_sum2(total, unused);
        mean = total / (float)hidden;
    }
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (live && v < vectors) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float centred = x[k][e] - mean;
                squares += centred * centred;
            }
        }
    }
    unused = 0.f;
    group_sum2(squares, unused);
    const float rstd = rsqrtf(squares / (float)hidden + eps);
    if (live && threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        if (live && v < vectors) {
            float gamma[VEC], beta[VEC], out[VEC];
            load_gamma(weight + (long long)v * VEC, one_plus, gamma);
            if (bias) {
                load8(bias + (long long)v * VEC, beta);
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) beta[e] = 0.f;
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                out[e] = rms ? rounded<T>(x[k][e] * rstd) * gamma[e]
                             : gamma[e] * (rstd * (x[k][e] - mean)) + beta[e];
            }
            store8(normed + base + (long long)v * VEC, out);
        }
    }
}

// Adds `values` (this thread's 8 columns of vector v) over the block's row groups in group
// order; group 0 writes the sums to out[v * VEC ...]. Every thread of the block must call it.
__device__ __forceinline__ void store_block_sum(const float* values, float* out, int v,
                                                bool valid) {
    __shared__ float columns[BLOCK_THREADS * VEC];
    const int slot = (threadIdx.y * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int e = 0; e < VEC; ++e) columns[slot + e] = values[e];
    __syncthreads();
    if (threadIdx.y == 0 && valid) {
        float sums[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) sums[e] = 0.f;
        for (int y = 0; y < blockDim.y; ++y) {
            const int from = (y * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
            for (int e = 0; e < VEC; ++e) sums[e] += columns[from + e];
        }
        store8(out + (long long)v * VEC, sums);
    }
    __syncthreads();
}

// Block blockIdx.x takes rows [blockIdx.x * rows_per_block, + rows_per_block) (a multiple of
// blockDim.y), row group threadIdx.y every blockDim.y-th of them. grad_input = the norm's input
// gradient + grad_sum. The block's gamma (and with partial_beta, beta) gradients over its rows
// go to row blockIdx.x of partial_gamma (partial_beta), float32 [blocks, hidden]. With a seed
// (else null), delta was dropped out: its gradient, grad_input through the same mask and scale
// (as libtorch scales grad_input rounded to T), goes to grad_delta.
template <typename T, int VPT>
__device__ void add_norm_backward(const T* grad_normed, const T* grad_sum, const T* sum,
                                  const float* mean_in, const float* rstd_in, const T* weight,
                                  T* grad_input, float* partial_gamma, float* partial_beta,
                                  long long rows, int hidden, int rows_per_block, int rms,
                                  int one_plus, T* grad_delta, const unsigned long long* seed,
                                  unsigned int threshold, float scale) {
    const int vectors = hidden / VEC;
    float dgamma[VPT][VEC], dbeta[VPT][VEC];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            dgamma[k][e] = 0.f;
            dbeta[k][e] = 0.f;
        }
    }
    const long long first = (long long)blockIdx.x * rows_per_block;
    for (int i = threadIdx.y; i < rows_per_block; i += blockDim.y) {
        const long long row = first + i;
        const bool live = row < rows;
        const long long base = live ? row * hidden : 0;
        const float mean = live && !rms ? mean_in[row] : 0.f;
        const float rstd = live ? rstd_in[row] : 0.f;
        // grad_sum is loaded with the rest, so its latency hides behind the row's reduction.
        float xhat[VPT][VEC], dxhat[VPT][VEC], g[VPT][VEC];
        float a = 0.f, b = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = threadIdx.x + k * blockDim.x;
            if (live && v < vectors) {
                const long long at = base + (long long)v * VEC;
                float x[VEC], dy[VEC], gamma[VEC];
                load8(sum + at, x);
                load8(grad_normed + at, dy);
                load8(grad_sum + at, g[k]);
                load_gamma(weight + (long long)v * VEC, one_plus, gamma);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    xhat[k][e] = (x[e] - mean) * rstd;
                    // The unfused RMSNorm multiplies gamma by x · rstd rounded to T.
                    dgamma[k][e] += dy[e] * (rms ? rounded<T>(xhat[k][e]) : xhat[k][e]);
                    dbeta[k][e] += dy[e];
                    dxhat[k][e] = dy[e] * gamma[e];
                    a += dxhat[k][e];
                    b += dxhat[k][e] * xhat[k][e];
                }
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    xhat[k][e] = 0.f;
                    dxhat[k][e] = 0.f;
                    g[k][e] = 0.f;
                }
            }
        }
        group_sum2(a, b);
        const float mean_dxhat = rms ? 0.f : a / (float)hidden;
        const float mean_dxhat_xhat = b / (float)hidden;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int v = threadIdx.x + k * blockDim.x;
            if (live && v < vectors) {
                float out[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    out[e] = rstd * (dxhat[k][e] - mean_dxhat - xhat[k][e] * mean_dxhat_xhat)
                             + g[k][e];
                }
                const long long at = base + (long long)v * VEC;
                store8(grad_input + at, out);
                if (seed) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) out[e] = rounded<T>(out[e]);
                    drop8<T>(out, *seed, at, threshold, scale);
                    store8(grad_delta + at, out);
                }
            }
        }
    }
    float* gamma_row = partial_gamma + (long long)blockIdx.x * hidden;
    float* beta_row = partial_beta ? partial_beta + (long long)blockIdx.x * hidden : nullptr;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        const int v = threadIdx.x + k * blockDim.x;
        const bool valid = v < vectors;
        store_block_sum(dgamma[k], gamma_row, v, valid);
        if (beta_row) store_block_sum(dbeta[k], beta_row, v, valid);
    }
}

// The column totals rounded to T: partial_gamma → grad_weight, partial_beta → grad_bias.
template <typename T>
__device__ void param_grad(const float* partial_gamma, const float* partial_beta,
                           long long blocks, int hidden, T* grad_weight, T* grad_bias) {
    const float total = column_total(partial_gamma, partial_beta, blocks, hidden);
    const int column = blockIdx.x * 32 + threadIdx.x;
    T* out = blockIdx.y == 0 ? grad_weight : grad_bias;
    if (threadIdx.y == 0 && column < hidden) store(out + column, total);
}

#define ADD_NORM(SUFFIX, T, VPT)                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)                              \
        add_norm_forward_##SUFFIX##_##VPT(const T* residual, const T* delta, const T* weight, \
                                          const T* bias, T* sum, T* normed, float* mean,      \
                                          float* rstd, long long rows, int hidden, float eps, \
                                          int rms, int one_plus, const unsigned long long* seed,  \
                                          unsigned int threshold, float scale) {              \
        add_norm_forward<T, VPT>(residual, delta, weight, bias, sum, normed, mean, rstd,      \
                                 rows, hidden, eps, rms, one_plus, seed, threshold, scale);   \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)                              \
        add_norm_backward_##SUFFIX##_##VPT(                                                   \
            const T* grad_normed, const T* grad_sum, const T* sum, const float* mean,         \
            const float* rstd, const T* weight, T* grad_input, float* partial_gamma,          \
            float* partial_beta, long long rows, int hidden, int rows_per_block, int rms,     \
            int one_plus, T* grad_delta, const unsigned long long* seed, unsigned int threshold,  \
            float scale) {                                                                    \
        add_norm_backward<T, VPT>(grad_normed, grad_sum, sum, mean, rstd, weight, grad_input, \
                                  partial_gamma, partial_beta, rows, hidden, rows_per_block,  \
                                  rms, one_plus, grad_delta, seed, threshold, scale);         \
    }

#define PARAM_GRAD(SUFFIX, T)                                                                \
    extern "C" __global__ void add_norm_param_grad_##SUFFIX(                                 \
        const float* partial_gamma, const float* partial_beta, long long blocks, int hidden, \
        T* grad_weight, T* grad_bias) {                                                       \
        param_grad<T>(partial_gamma, partial_beta, blocks, hidden, grad_weight, grad_bias);  \
    }

ADD_NORM(bf16, bf16, 1)
ADD_NORM(bf16, bf16, 2)
ADD_NORM(bf16, bf16, 4)
ADD_NORM(f16, f16, 1)
ADD_NORM(f16, f16, 2)
ADD_NORM(f16, f16, 4)
ADD_NORM(f32, float, 1)
ADD_NORM(f32, float, 2)
ADD_NORM(f32, float, 4)
PARAM_GRAD(bf16, bf16)
PARAM_GRAD(f16, f16)
PARAM_GRAD(f32, float)
