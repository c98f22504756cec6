// Bias gradients summed into the optimizer's float32 buffer: fc1's GeLU backward with its bias
// gradient, narrow linears' bias gradients, and the QKV projection's packed gradient
// (ops::bias_grad).

#include "scalars.cuh"
#include "vectors8.cuh"
#include "column_totals.cuh"

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

// partial[blockIdx.y]'s columns [column, column + VEC) get the sums of the thread rows' `sum`,
// added in thread-row order.
__device__ __forceinline__ void write_block_sums(const float* sum, float* __restrict__ partial,
                                                 int column, int columns) {
    __shared__ float sums[ROW_THREADS][COLUMN_THREADS * VEC];
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
    write_block_sums(sum, partial, column, columns);
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

// The QKV projection's output gradient `packed` ([rows, columns], row r = s · batch + b; per
// group query_width query columns, then head_dim key and head_dim value columns) gathered from
// the three parts' gradients (each [s, batch, groups, width] at the strides given, the last
// stride 1), and partial[blockIdx.y] its column sums over rows [blockIdx.y · rows_per_block,
// +rows_per_block), added as `bias_grad` adds them: the projection's bias gradient.
template <typename T>
__device__ void qkv_grad_pack(const T* __restrict__ query, const T* __restrict__ key,
                              const T* __restrict__ value, long long query_s, long long query_b,
                              long long query_g, long long key_s, long long key_b,
                              long long key_g, long long value_s, long long value_b,
                              long long value_g, unsigned int batch, int query_width,
                              int head_dim, T* __restrict__ packed, float* __restrict__ partial,
                              long long rows, int columns, int rows_per_block) {
    const int column = (blockIdx.x * COLUMN_THREADS + threadIdx.x) * VEC;
    const long long first = (long long)blockIdx.y * rows_per_block;
    const long long last = min(first + rows_per_block, rows);
    float sum[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) sum[k] = 0.f;
    if (column < columns) {
        // A thread's 8 columns lie in one part (widths are multiples of 8).
        const int group_width = query_width + 2 * head_dim;
        const int group = column / group_width;
        const int within = column - group * group_width;
        const T* source;
        long long stride_s, stride_b;
        if (within < query_width) {
            source = query + group * query_g + within;
            stride_s = query_s;
            stride_b = query_b;
        } else if (within < query_width + head_dim) {
            source = key + group * key_g + (within - query_width);
            stride_s = key_s;
            stride_b = key_b;
        } else {
            source = value + group * value_g + (within - query_width - head_dim);
            stride_s = value_s;
            stride_b = value_b;
        }
        // rows fits in 32 bits (checked by the caller), so the division is a 32-bit one.
        auto at = [&](long long row) {
            const unsigned int s = (unsigned int)row / batch;
            return source + s * stride_s + ((unsigned int)row - s * batch) * stride_b;
        };
        long long r = first + threadIdx.y;
        for (; r + ROW_THREADS < last; r += 2 * ROW_THREADS) {
            float x[2][VEC];
#pragma unroll
            for (int j = 0; j < 2; ++j) load8(at(r + j * ROW_THREADS), x[j]);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) sum[k] += x[j][k];
                store8(packed + (r + j * ROW_THREADS) * columns + column, x[j]);
            }
        }
        if (r < last) {
            float x[VEC];
            load8(at(r), x);
#pragma unroll
            for (int k = 0; k < VEC; ++k) sum[k] += x[k];
            store8(packed + r * columns + column, x);
        }
    }
    write_block_sums(sum, partial, column, columns);
}

#define QKV_GRAD_PACK(SUFFIX, T)                                                               \
    extern "C" __global__ void __launch_bounds__(COLUMN_THREADS * ROW_THREADS)                 \
        qkv_grad_pack_##SUFFIX(const T* query, const T* key, const T* value,                   \
                               long long query_s, long long query_b, long long query_g,        \
                               long long key_s, long long key_b, long long key_g,              \
                               long long value_s, long long value_b, long long value_g,        \
                               unsigned int batch, int query_width, int head_dim, T* packed,   \
                               float* partial, long long rows, int columns,                    \
                               int rows_per_block) {                                           \
        qkv_grad_pack<T>(query, key, value, query_s, query_b, query_g, key_s, key_b, key_g,    \
                         value_s, value_b, value_g, batch, query_width, head_dim, packed,      \
                         partial, rows, columns, rows_per_block);                              \
    }

QKV_GRAD_PACK(bf16, bf16)
QKV_GRAD_PACK(f16, f16)
