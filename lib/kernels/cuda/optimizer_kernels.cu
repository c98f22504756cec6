// The optimizer step in two kernels: the gradients' sum of squares, and AdamW over every
// segment with the half-precision model copy written (ops::optimizer_kernels). The AdamW
// arithmetic is ATen's, operation for operation; see the Rust side for what differs.

struct alignas(16) Float4 { float x, y, z, w; };
struct alignas(8) Half4 { unsigned short x, y, z, w; };

struct Bf16 {
    __device__ __forceinline__ static unsigned short round(float value) {
        unsigned short bits;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
        return bits;
    }
};
struct F16 {
    __device__ __forceinline__ static unsigned short round(float value) {
        unsigned short bits;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
        return bits;
    }
};

__device__ __forceinline__ bool aligned(const void* p, unsigned long long bytes) {
    return (reinterpret_cast<unsigned long long>(p) & (bytes - 1)) == 0;
}

// The sum of `value` over the block (at most 1024 threads), in a fixed order; valid in thread 0.
template <typename T>
__device__ T block_sum(T value) {
    __shared__ T warp_sums[32];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = value;
    __syncthreads();
    T total = 0;
    if (threadIdx.x == 0) {
        const int warps = (blockDim.x + 31) / 32;
        for (int w = 0; w < warps; ++w) total += warp_sums[w];
    }
    return total;
}

// chunks: [n_chunks][2] (offset into values, length). Block b adds up chunks b, b + grid, ...
extern "C" __global__ void sum_squares_partial(const float* values, const long long* chunks,
                                               long long n_chunks, float* partials) {
    float sum = 0.f;
    for (long long c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const float* x = values + chunks[2 * c];
        const long long length = chunks[2 * c + 1];
        long long vector_end = 0;
        if (aligned(x, 16)) {
            vector_end = length & ~3LL;
            for (long long i = 4LL * threadIdx.x; i < vector_end; i += 4LL * blockDim.x) {
                const Float4 v = *reinterpret_cast<const Float4*>(x + i);
                sum = fmaf(v.x, v.x, sum);
                sum = fmaf(v.y, v.y, sum);
                sum = fmaf(v.z, v.z, sum);
                sum = fmaf(v.w, v.w, sum);
            }
        }
        for (long long i = vector_end + threadIdx.x; i < length; i += blockDim.x) {
            sum = fmaf(x[i], x[i], sum);
        }
    }
    const float total = block_sum(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

// One block: out = the sum of partials[0..count], accumulated in float64.
extern "C" __global__ void sum_squares_final(const float* partials, int count, float* out) {
    double sum = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += (double)partials[i];
    const double total = block_sum(sum);
    if (threadIdx.x == 0) *out = (float)total;
}

// ATen's adam_math for one element in ADAMW mode (see the Rust side for what differs).
__device__ __forceinline__ void adamw_math(float& param, float grad, float& exp_avg,
                                           float& exp_avg_sq, const float lr, const float beta1,
                                           const float beta2, const float weight_decay,
                                           const float eps, const float bias_correction1,
                                           const float bias_correction2_sqrt) {
    if (weight_decay != 0) {
        param -= lr * weight_decay * param;
    }
    exp_avg = fmaf(beta1, exp_avg, fmaf(-beta1, grad, grad));
    exp_avg_sq = fmaf(beta2, exp_avg_sq, fmaf(-beta2, grad * grad, grad * grad));
    const float step_size = lr / bias_correction1;
    const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + eps;
    param -= step_size * exp_avg / denom;
}

// chunks: [n_chunks][4] (offset into grads and model, offset into main/exp_avg/exp_avg_sq,
// length, decayed); one block per chunk. step: the step count, already incremented. divisor:
// null, or a scalar the gradients are divided by first.
template <typename Half>
__device__ void adamw_chunk(float* main, float* exp_avg, float* exp_avg_sq, float* grads,
                            unsigned short* model, const long long* chunks, const float* step,
                            const float* divisor, float lr, float beta1, float beta2,
                            float weight_decay, float eps, int zero_grads) {
    const long long* chunk = chunks + 4LL * blockIdx.x;
    const long long length = chunk[2];
    const float decay = chunk[3] != 0 ? weight_decay : 0.f;
    const float step_count = *step;
    const float bias_correction1 = 1 - powf(beta1, step_count);
    const float bias_correction2_sqrt = sqrtf(1 - powf(beta2, step_count));
    const bool divide = divisor != nullptr;
    const float scale = divide ? *divisor : 1.f;
    float* g = grads + chunk[0];
    unsigned short* h = model + chunk[0];
    float* p = main + chunk[1];
    float* m = exp_avg + chunk[1];
    float* v = exp_avg_sq + chunk[1];
    long long vector_end = 0;
    if (aligned(g, 16) && aligned(p, 16) && aligned(m, 16) && aligned(v, 16) && aligned(h, 8)) {
        vector_end = length & ~3LL;
        for (long long i = 4LL * threadIdx.x; i < vector_end; i += 4LL * blockDim.x) {
            Float4 pv = *reinterpret_cast<Float4*>(p + i);
            Float4 gv = *reinterpret_cast<Float4*>(g + i);
            Float4 mv = *reinterpret_cast<Float4*>(m + i);
            Float4 vv = *reinterpret_cast<Float4*>(v + i);
            if (divide) {
                gv.x /= scale;
                gv.y /= scale;
                gv.z /= scale;
                gv.w /= scale;
            }
            adamw_math(pv.x, gv.x, mv.x, vv.x, lr, beta1, beta2, decay, eps, bias_correction1,
                       bias_correction2_sqrt);
            adamw_math(pv.y, gv.y, mv.y, vv.y, lr, beta1, beta2, decay, eps, bias_correction1,
                       bias_correction2_sqrt);
            adamw_math(pv.z, gv.z, mv.z, vv.z, lr, beta1, beta2, decay, eps, bias_correction1,
                       bias_correction2_sqrt);
            adamw_math(pv.w, gv.w, mv.w, vv.w, lr, beta1, beta2, decay, eps, bias_correction1,
                       bias_correction2_sqrt);
            *reinterpret_cast<Float4*>(p + i) = pv;
            *reinterpret_cast<Float4*>(m + i) = mv;
            *reinterpret_cast<Float4*>(v + i) = vv;
            Half4 hv;
            hv.x = Half::round(pv.x);
            hv.y = Half::round(pv.y);
            hv.z = Half::round(pv.z);
            hv.w = Half::round(pv.w);
            *reinterpret_cast<Half4*>(h + i) = hv;
            if (zero_grads) *reinterpret_cast<Float4*>(g + i) = Float4{0.f, 0.f, 0.f, 0.f};
        }
    }
    for (long long i = vector_end + threadIdx.x; i < length; i += blockDim.x) {
        float pi = p[i];
        float gi = g[i];
        float mi = m[i];
        float vi = v[i];
        if (divide) gi /= scale;
        adamw_math(pi, gi, mi, vi, lr, beta1, beta2, decay, eps, bias_correction1,
                   bias_correction2_sqrt);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        h[i] = Half::round(pi);
        if (zero_grads) g[i] = 0.f;
    }
}

#define ADAMW(NAME, HALF)                                                                   \
    extern "C" __global__ void NAME(float* main, float* exp_avg, float* exp_avg_sq,         \
                                    float* grads, unsigned short* model,                    \
                                    const long long* chunks, const float* step,             \
                                    const float* divisor, float lr, float beta1,            \
                                    float beta2, float weight_decay, float eps,             \
                                    int zero_grads) {                                       \
        adamw_chunk<HALF>(main, exp_avg, exp_avg_sq, grads, model, chunks, step, divisor,  \
                          lr, beta1, beta2, weight_decay, eps, zero_grads);                 \
    }

ADAMW(adamw_bf16, Bf16)
ADAMW(adamw_f16, F16)
