// The cross entropy of rows of logits and its gradient, written over the logits
// (ops::softmax_cross_entropy).

#include "scalars.cuh"
#include "vectors8.cuh"

constexpr int BLOCK_THREADS = 512;
constexpr int WARPS = BLOCK_THREADS / 32;

// N consecutive elements to float32 and back: 8 (one or two 16-byte accesses, the pointer
// aligned) or 1.
template <typename T, int N> struct Vec {
    static __device__ __forceinline__ void load(const T* p, float* out) { load8(p, out); }
    static __device__ __forceinline__ void store(T* p, const float* in) { store8(p, in); }
};
template <typename T> struct Vec<T, 1> {
    static __device__ __forceinline__ void load(const T* p, float* out) { out[0] = ::load(p); }
    static __device__ __forceinline__ void store(T* p, const float* in) { ::store(p, in[0]); }
};

// Merges the running maximum and sum of exponentials (relative to that maximum) of two parts.
__device__ __forceinline__ void merge(float& max, float& sum, float other_max, float other_sum) {
    const float top = fmaxf(max, other_max);
    if (top == neg_inf()) return;
    sum = sum * expf(max - top) + other_sum * expf(other_max - top);
    max = top;
}

template <typename T, int N>
__device__ void softmax_cross_entropy(T* logits, const long long* targets, float* losses,
                                      int vocab, float scale, int with_grad) {
    __shared__ float shared_max[WARPS];
    __shared__ float shared_sum[WARPS];
    const long long row = blockIdx.x;
    T* x = logits + row * (long long)vocab;
    const long long target = targets[row];
    const bool inside = target >= 0 && target < vocab;
    // Read before any thread overwrites the row with its gradient.
    const float target_logit = (threadIdx.x == 0 && inside) ? ::load(x + target) : 0.0f;

    float max = neg_inf(), sum = 0.0f;
    for (int i = threadIdx.x * N; i < vocab; i += BLOCK_THREADS * N) {
        float v[N];
        Vec<T, N>::load(x + i, v);
        float top = v[0];
#pragma unroll
        for (int k = 1; k < N; ++k) top = fmaxf(top, v[k]);
        float part = 0.0f;
#pragma unroll
        for (int k = 0; k < N; ++k) part += expf(v[k] - top);
        merge(max, sum, top, part);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other_max = __shfl_xor_sync(0xffffffffu, max, offset);
        const float other_sum = __shfl_xor_sync(0xffffffffu, sum, offset);
        merge(max, sum, other_max, other_sum);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        shared_max[warp] = max;
        shared_sum[warp] = sum;
    }
    __syncthreads();
    // Every thread merges the warps' parts in the same order, so all hold the same bits.
    max = shared_max[0];
    sum = shared_sum[0];
    for (int w = 1; w < WARPS; ++w) merge(max, sum, shared_max[w], shared_sum[w]);
    const float log_partition = max + logf(sum);
    if (threadIdx.x == 0) losses[row] = inside ? log_partition - target_logit : 0.0f;
    if (!with_grad) return;
    for (int i = threadIdx.x * N; i < vocab; i += BLOCK_THREADS * N) {
        float v[N];
        Vec<T, N>::load(x + i, v);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            float p = expf(v[k] - log_partition);
            if (i + k == target) p -= 1.0f;
            v[k] = p * scale;
        }
        Vec<T, N>::store(x + i, v);
    }
}

#define SOFTMAX_CROSS_ENTROPY(SUFFIX, T, N)                                                   \
    extern "C" __global__ void __launch_bounds__(BLOCK_THREADS)                               \
        softmax_cross_entropy_##SUFFIX##_##N(T* logits, const long long* targets,              \
                                             float* losses, int vocab, float scale,            \
                                             int with_grad) {                                  \
        softmax_cross_entropy<T, N>(logits, targets, losses, vocab, scale, with_grad);        \
    }

SOFTMAX_CROSS_ENTROPY(bf16, bf16, 8)
SOFTMAX_CROSS_ENTROPY(bf16, bf16, 1)
SOFTMAX_CROSS_ENTROPY(f16, f16, 8)
SOFTMAX_CROSS_ENTROPY(f16, f16, 1)
SOFTMAX_CROSS_ENTROPY(f32, float, 8)
SOFTMAX_CROSS_ENTROPY(f32, float, 1)
