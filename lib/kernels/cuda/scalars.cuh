// The element types of our kernels and their conversions to float32. NVRTC gets no system
// headers, so there is no __half or __nv_bfloat16: bf16 and f16 are their raw bits, `load` and
// `store` convert between them and float32 with PTX instructions, `neg_inf` stands in for
// INFINITY, and `rounded` is a float32 value rounded to one of them.
#ifndef MEGATRON_SCALARS_CUH
#define MEGATRON_SCALARS_CUH

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16* p) {
    return __uint_as_float(((unsigned int)p->bits) << 16);
}
__device__ __forceinline__ float load(const f16* p) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(p->bits));
    return value;
}
__device__ __forceinline__ void store(float* p, float value) { *p = value; }
__device__ __forceinline__ void store(bf16* p, float value) {
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    p->bits = bits;
}
__device__ __forceinline__ void store(f16* p, float value) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    p->bits = bits;
}
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
// value rounded to T (unchanged for float), as a kernel storing it in T would round it.
template <typename T>
__device__ __forceinline__ float rounded(float value) {
    T t;
    store(&t, value);
    return load(&t);
}

#endif  // MEGATRON_SCALARS_CUH
