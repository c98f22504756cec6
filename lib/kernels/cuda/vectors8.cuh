// 16-byte vector accesses: `load8`/`store8` move 8 consecutive elements (16-byte aligned; 32
// bytes of float32) between memory and float32 registers.
#ifndef MEGATRON_VECTORS8_CUH
#define MEGATRON_VECTORS8_CUH

#include "scalars.cuh"

struct alignas(16) Words { unsigned int w[4]; };
struct alignas(16) Floats { float f[4]; };

// 8 consecutive elements (16-byte aligned) to float32 and back; the stores round to nearest even.
template <typename T> __device__ __forceinline__ void load8(const T* p, float* out) {
    const Words v = *reinterpret_cast<const Words*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        T low, high;
        low.bits = (unsigned short)(v.w[k] & 0xffffu);
        high.bits = (unsigned short)(v.w[k] >> 16);
        out[2 * k] = load(&low);
        out[2 * k + 1] = load(&high);
    }
}
__device__ __forceinline__ void load8(const float* p, float* out) {
    const Floats a = reinterpret_cast<const Floats*>(p)[0];
    const Floats b = reinterpret_cast<const Floats*>(p)[1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[k] = a.f[k];
        out[4 + k] = b.f[k];
    }
}
template <typename T> __device__ __forceinline__ void store8(T* p, const float* in) {
    Words v;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        T low, high;
        store(&low, in[2 * k]);
        store(&high, in[2 * k + 1]);
        v.w[k] = (unsigned int)low.bits | ((unsigned int)high.bits << 16);
    }
    *reinterpret_cast<Words*>(p) = v;
}
__device__ __forceinline__ void store8(float* p, const float* in) {
    Floats a, b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        a.f[k] = in[k];
        b.f[k] = in[4 + k];
    }
    reinterpret_cast<Floats*>(p)[0] = a;
    reinterpret_cast<Floats*>(p)[1] = b;
}

#endif  // MEGATRON_VECTORS8_CUH
