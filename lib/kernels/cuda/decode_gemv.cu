// The linear layers of a decode step of few rows, with the input's norm and the bias, GeLU and
// residual fused (ops::decode_gemv): a warp computes `C` output columns (1 for up to 2 rows,
// else 2) for all rows; its lanes stride along `K` in 16-byte loads, `16 / C` loads of each
// column in flight, then the warp sums its lanes. A block first computes its rows' norm
// statistics (one warp per row) when there is a prologue; the input is read from L1/L2, the
// weight once.

#include "scalars.cuh"
#include "dependent_launch.cuh"
#include "decode_gemv_parts.cuh"

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
