// Rotary position embeddings of strided query and key heads; backward is the same kernel with
// the sine negated (ops::rope).

#include "scalars.cuh"

// One warp per head row (position, batch row, head): its lanes take the channel pairs
// (i, i + half) and then the channels from r on. x is [s, b, heads, d] in any strides with
// contiguous channels; out is contiguous; cos and sin are float32 [s, r].
template <typename T>
__device__ void rope(const T* x, long long stride_s, long long stride_b, long long stride_h,
                     T* out, const float* cos, const float* sin, int batch, int heads, int d,
                     int r, int rows, float sign) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    const int head = row % heads;
    const int position = row / heads / batch;
    const int batch_row = row / heads % batch;
    const T* in = x + position * stride_s + batch_row * stride_b + head * stride_h;
    T* y = out + (long long)row * d;
    const float* c = cos + (long long)position * r;
    const float* s = sin + (long long)position * r;
    const int half = r / 2;
    for (int i = lane; i < half; i += 32) {
        const float a = load(in + i), b = load(in + i + half);
        store(y + i, a * c[i] - b * (sign * s[i]));
        store(y + i + half, b * c[i + half] + a * (sign * s[i + half]));
    }
    for (int i = r + lane; i < d; i += 32) y[i] = in[i];
}

#define ROPE(SUFFIX, T)                                                                        \
    extern "C" __global__ void rope_##SUFFIX(const T* x, long long stride_s, long long stride_b, \
                                            long long stride_h, T* out, const float* cos,       \
                                            const float* sin, int batch, int heads, int d,      \
                                            int r, int rows, float sign) {                      \
        rope<T>(x, stride_s, stride_b, stride_h, out, cos, sin, batch, heads, d, r, rows, sign); \
    }

ROPE(bf16, bf16)
ROPE(f16, f16)
ROPE(f32, float)
