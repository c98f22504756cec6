// Gradients summed over rows in two deterministic steps: a first kernel writes one float32
// partial row per block (`[blocks, columns]`), then `column_total` adds the partial rows of a
// column in block order (row group `threadIdx.y` every `blockDim.y`-th row, then the groups in
// order; the total lands in thread row 0), for grids of `columns / 32` x 1 or 2 blocks of
// 32 x `blockDim.y` threads (`blockIdx.y` picks the first or second partials), and the kernel
// `column_totals_into_main` adds the totals to the optimizer's float32 gradients (every source
// that includes this header exports it).
#ifndef MEGATRON_COLUMN_TOTALS_CUH
#define MEGATRON_COLUMN_TOTALS_CUH

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

#endif  // MEGATRON_COLUMN_TOTALS_CUH
