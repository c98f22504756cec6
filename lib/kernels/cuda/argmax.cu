// The index of each row's largest value in two kernels: the best of each chunk, then of each
// row's chunks (ops::argmax).

#include "scalars.cuh"

constexpr int CHUNK = 4096;
constexpr int THREADS = 256;

// Whether (a, ai) comes before (b, bi) as libtorch's argmax ranks them: NaN first, then the
// larger value, then the smaller index.
__device__ __forceinline__ bool better(float a, long long ai, float b, long long bi) {
    const bool a_nan = a != a;
    const bool b_nan = b != b;
    if (a_nan || b_nan) return a_nan && (!b_nan || ai < bi);
    return a > b || (a == b && ai < bi);
}

__device__ __forceinline__ void keep_better(float& value, long long& index, float other,
                                            long long other_index) {
    if (better(other, other_index, value, index)) {
        value = other;
        index = other_index;
    }
}

// The best (value, index) of a warp's lanes, in every lane.
__device__ __forceinline__ void warp_best(float& value, long long& index) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        const long long other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        keep_better(value, index, other, other_index);
    }
}

// Block (c, r) finds the best of row r's values [c·CHUNK, (c+1)·CHUNK) (row r at
// x + r·row_stride, `columns` values) and writes it to values/indices [r, chunks] at c.
template <typename T>
__device__ void chunk_best(const T* x, long long row_stride, long long columns, int chunks,
                           float* values, long long* indices) {
    const long long row = blockIdx.y;
    const long long start = (long long)blockIdx.x * CHUNK;
    const long long end = start + CHUNK < columns ? start + CHUNK : columns;
    const T* values_of_row = x + row * row_stride;
    float value = neg_inf();
    long long index = end;
    // Loads in flight together: each thread's values are THREADS apart.
    constexpr int PER = CHUNK / THREADS;
    float loaded[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const long long k = start + threadIdx.x + (long long)i * THREADS;
        loaded[i] = k < end ? load(values_of_row + k) : neg_inf();
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const long long k = start + threadIdx.x + (long long)i * THREADS;
        if (k < end) keep_better(value, index, loaded[i], k);
    }
    warp_best(value, index);
    __shared__ float warp_values[THREADS / 32];
    __shared__ long long warp_indices[THREADS / 32];
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        warp_values[warp] = value;
        warp_indices[warp] = index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) keep_better(value, index, warp_values[w], warp_indices[w]);
        values[row * chunks + blockIdx.x] = value;
        indices[row * chunks + blockIdx.x] = index;
    }
}

// Warp r picks row r's best among its chunks' and writes its index to out[r].
__device__ void row_best(const float* values, const long long* indices, int rows, int chunks,
                         long long* out) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    float value = neg_inf();
    long long index = 0x7fffffffffffffffLL;
    for (int c = lane; c < chunks; c += 32)
        keep_better(value, index, values[(long long)row * chunks + c],
                    indices[(long long)row * chunks + c]);
    warp_best(value, index);
    if (lane == 0) out[row] = index;
}

#define CHUNK_BEST(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                  \
        NAME(const T* x, long long row_stride, long long columns, int chunks, float* values, \
             long long* indices) {                                                          \
        chunk_best<T>(x, row_stride, columns, chunks, values, indices);                     \
    }

CHUNK_BEST(argmax_chunks_bf16, bf16)
CHUNK_BEST(argmax_chunks_f16, f16)
CHUNK_BEST(argmax_chunks_f32, float)

extern "C" __global__ void argmax_rows(const float* values, const long long* indices, int rows,
                                       int chunks, long long* out) {
    row_best(values, indices, rows, chunks, out);
}
