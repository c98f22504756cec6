// FP8 quantization in one pass, optionally transposed, with the amax for delayed scaling
// (ops::fp8_cast). The e4m3/e5m2 conversions need sm_89 or newer:
// requires: sm_89

#include "scalars.cuh"

__device__ __forceinline__ bool finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

constexpr float FLOAT_MAX = 3.402823466e38f;

// `max / amax`, or 1 when the amax is zero or not finite (model::fp8::scale_from_amax).
__device__ __forceinline__ float scale_from_amax(float amax, float max) {
    return amax > 0.f && finite(amax) ? fminf(max / amax, FLOAT_MAX) : 1.f;
}

// Round to nearest even, saturating to the largest finite value; the value goes in the low
// byte of the converted pair.
template <bool E5M2> __device__ __forceinline__ unsigned char to_fp8(float v) {
    unsigned short pair;
    if (E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
    }
    return (unsigned char)(pair & 0xff);
}

constexpr int TILE = 32;
constexpr int ROWS_PER_PASS = 8;

// The end of a cast block of 32 × ROWS_PER_PASS threads: with amax_out, the block's largest
// |x| (each thread's `amax`) is max-ed into it (as float bits: non-negative floats order as
// their bits); block (0, 0) writes 1 / scale to *scale_inv.
__device__ void finish_block(float amax, unsigned int* amax_out, float scale, float* scale_inv) {
    __shared__ float warp_amax[ROWS_PER_PASS];
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    if (amax_out) {
        for (int offset = 16; offset > 0; offset /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        }
        if (tx == 0) warp_amax[ty] = amax;
        __syncthreads();
        if (tx == 0 && ty == 0) {
            for (int w = 1; w < ROWS_PER_PASS; ++w) amax = fmaxf(amax, warp_amax[w]);
            atomicMax(amax_out, __float_as_uint(amax));
        }
    }
    if (scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0) {
        *scale_inv = 1.f / scale;
    }
}

// x [rows, cols] contiguous. out [rows, cols] and out_t [cols, rows] (either may be null).
// The scale is *scale, or derived from *amax_in when amax_in is not null; see finish_block for
// scale_inv and amax_out.
template <typename T, bool E5M2>
__device__ void cast_transpose(const T* x, long long rows, long long cols, unsigned char* out,
                               unsigned char* out_t, const float* scale_in,
                               const float* amax_in, float max, float* scale_inv,
                               unsigned int* amax_out) {
    __shared__ unsigned char tile[TILE][TILE + 4];
    const float scale = amax_in ? scale_from_amax(*amax_in, max) : *scale_in;
    const long long row0 = (long long)blockIdx.x * TILE;
    const long long col0 = (long long)blockIdx.y * TILE;
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    float amax = 0.f;
    for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
        const long long r = row0 + i;
        const long long c = col0 + tx;
        unsigned char q = 0;
        if (r < rows && c < cols) {
            const float v = load(x + r * cols + c);
            amax = fmaxf(amax, fabsf(v));
            q = to_fp8<E5M2>(v * scale);
            if (out) out[r * cols + c] = q;
        }
        tile[i][tx] = q;
    }
    if (out_t) {
        __syncthreads();
        for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
            const long long c = col0 + i;
            const long long r = row0 + tx;
            if (r < rows && c < cols) out_t[c * rows + r] = tile[tx][i];
        }
    }
    finish_block(amax, amax_out, scale, scale_inv);
}

// Four consecutive elements at once (8- or 16-byte loads, 4-byte stores), for matrices whose
// rows and columns are multiples of 4 and an input aligned to its vector: a block casts a
// tile of 32 rows × 128 columns, a thread four columns of a row per pass.
struct alignas(8) u16x4 { unsigned short v[4]; };
struct alignas(16) f32x4 { float v[4]; };

__device__ __forceinline__ void load4(const float* p, float* o) {
    const f32x4 w = *reinterpret_cast<const f32x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = w.v[k];
}
__device__ __forceinline__ void load4(const bf16* p, float* o) {
    const u16x4 w = *reinterpret_cast<const u16x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = __uint_as_float(((unsigned int)w.v[k]) << 16);
}
__device__ __forceinline__ void load4(const f16* p, float* o) {
    const u16x4 w = *reinterpret_cast<const u16x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) asm("cvt.f32.f16 %0, %1;" : "=f"(o[k]) : "h"(w.v[k]));
}

constexpr int WIDE = 128;

template <typename T, bool E5M2>
__device__ void cast_transpose4(const T* x, long long rows, long long cols, unsigned char* out,
                                unsigned char* out_t, const float* scale_in,
                                const float* amax_in, float max, float* scale_inv,
                                unsigned int* amax_out) {
    __shared__ unsigned char tile[TILE][WIDE + 4];
    const float scale = amax_in ? scale_from_amax(*amax_in, max) : *scale_in;
    const long long row0 = (long long)blockIdx.x * TILE;
    const long long col0 = (long long)blockIdx.y * WIDE;
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    float amax = 0.f;
    for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
        const long long r = row0 + i;
        const long long c = col0 + 4 * tx;
        unsigned int packed = 0u;
        if (r < rows && c < cols) {
            float v[4];
            load4(x + r * cols + c, v);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                amax = fmaxf(amax, fabsf(v[k]));
                packed |= ((unsigned int)to_fp8<E5M2>(v[k] * scale)) << (8 * k);
            }
            if (out) *reinterpret_cast<unsigned int*>(out + r * cols + c) = packed;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) tile[i][4 * tx + k] = (unsigned char)(packed >> (8 * k));
    }
    if (out_t) {
        __syncthreads();
        // out_t's rows col0.. hold this tile's columns; each row's 32 bytes are 8 words of 4
        // consecutive input rows.
        const int thread = ty * 32 + tx;
        for (int word = thread; word < WIDE * (TILE / 4); word += 32 * ROWS_PER_PASS) {
            const int column = word / (TILE / 4);
            const int first = 4 * (word % (TILE / 4));
            const long long c = col0 + column;
            const long long r = row0 + first;
            if (r < rows && c < cols) {
                unsigned int packed = 0u;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    packed |= ((unsigned int)tile[first + k][column]) << (8 * k);
                }
                *reinterpret_cast<unsigned int*>(out_t + c * rows + r) = packed;
            }
        }
    }
    finish_block(amax, amax_out, scale, scale_inv);
}

#define FP8_CAST(NAME, T, E5M2)                                                             \
    extern "C" __global__ void NAME(const T* x, long long rows, long long cols,             \
                                    unsigned char* out, unsigned char* out_t,                \
                                    const float* scale_in, const float* amax_in, float max,  \
                                    float* scale_inv, unsigned int* amax_out) {              \
        cast_transpose<T, E5M2>(x, rows, cols, out, out_t, scale_in, amax_in, max,          \
                                scale_inv, amax_out);                                        \
    }

#define FP8_CAST4(NAME, T, E5M2)                                                            \
    extern "C" __global__ void NAME(const T* x, long long rows, long long cols,             \
                                    unsigned char* out, unsigned char* out_t,                \
                                    const float* scale_in, const float* amax_in, float max,  \
                                    float* scale_inv, unsigned int* amax_out) {              \
        cast_transpose4<T, E5M2>(x, rows, cols, out, out_t, scale_in, amax_in, max,         \
                                 scale_inv, amax_out);                                       \
    }

FP8_CAST(fp8_cast_bf16_e4m3, bf16, false)
FP8_CAST(fp8_cast_bf16_e5m2, bf16, true)
FP8_CAST(fp8_cast_f16_e4m3, f16, false)
FP8_CAST(fp8_cast_f16_e5m2, f16, true)
FP8_CAST(fp8_cast_f32_e4m3, float, false)
FP8_CAST(fp8_cast_f32_e5m2, float, true)
FP8_CAST4(fp8_cast4_bf16_e4m3, bf16, false)
FP8_CAST4(fp8_cast4_bf16_e5m2, bf16, true)
FP8_CAST4(fp8_cast4_f16_e4m3, f16, false)
FP8_CAST4(fp8_cast4_f16_e5m2, f16, true)
FP8_CAST4(fp8_cast4_f32_e4m3, float, false)
FP8_CAST4(fp8_cast4_f32_e5m2, float, true)

// Delayed scaling after a use: counters [amax of the use (float bits), ring position]; the
// amax goes into the history ring (len entries), the counters move on, and the scale becomes
// max_over_margin / (the amax, or the history's max with use_max), unless that amax is zero
// or not finite. One block.
extern "C" __global__ void fp8_delayed_update(float* scale, unsigned int* counters,
                                              float* history, int len, int use_max,
                                              float max_over_margin) {
    __shared__ float partial[256];
    const float amax = __uint_as_float(counters[0]);
    const unsigned int position = counters[1];
    __syncthreads();
    if (threadIdx.x == 0) {
        history[position] = amax;
        counters[0] = 0u;
        counters[1] = (position + 1) % (unsigned int)len;
    }
    __syncthreads();
    float reduced = amax;
    if (use_max) {
        float m = 0.f;
        for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, history[i]);
        partial[threadIdx.x] = m;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
            if (threadIdx.x < stride) {
                partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
            }
            __syncthreads();
        }
        reduced = partial[0];
    }
    if (threadIdx.x == 0 && reduced > 0.f && finite(reduced)) {
        *scale = fminf(max_over_margin / reduced, FLOAT_MAX);
    }
}
