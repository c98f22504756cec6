// The pieces of the paged decode attention kernel (paged_attention.cu) that the fused decode
// attention kernel (decode_attention.cu) shares: a warp's round of online softmax over a few
// positions, and the merge of partial softmax sums.
#ifndef MEGATRON_ONLINE_SOFTMAX_CUH
#define MEGATRON_ONLINE_SOFTMAX_CUH

#include "scalars.cuh"

// One round of a warp's online softmax over UNROLL positions: their scores (the query qv, lanes
// holding PER channels each, times each key k[u], summed over the warp) folded into the running
// maximum m, total l and output acc with their values v[u]; positions u >= valid weigh nothing.
template <int PER, int UNROLL>
__device__ __forceinline__ void softmax_round(const float (&qv)[PER],
                                              const float (&k)[UNROLL][PER],
                                              const float (&v)[UNROLL][PER], long long valid,
                                              float& m, float& l, float (&acc)[PER]) {
    float s[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) dot += qv[i] * k[u][i];
        s[u] = dot;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) s[u] += __shfl_xor_sync(0xffffffffu, s[u], offset);
    }
    float m_new = m;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        if (u < valid) m_new = fmaxf(m_new, s[u]);
    }
    const float keep = __expf(m - m_new);
    l *= keep;
#pragma unroll
    for (int i = 0; i < PER; ++i) acc[i] *= keep;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const float weight = u < valid ? __expf(s[u] - m_new) : 0.f;
        l += weight;
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] += weight * v[u][i];
    }
    m = m_new;
}

// The merge, in order, of `count` partial softmax sums: partial j's maximum and total at
// maxima[j·scalar_stride] and totals[j·scalar_stride], its output at outputs[j·output_stride],
// of which this lane merges channels lane·PER on. Leaves the largest maximum in top, the total
// in total and the lane's channels (not yet divided by the total) in o.
template <int PER>
__device__ __forceinline__ void merge_partials(int count, const float* maxima,
                                               const float* totals, long long scalar_stride,
                                               const float* outputs, long long output_stride,
                                               int lane, float& top, float& total,
                                               float (&o)[PER]) {
    top = neg_inf();
    for (int j = 0; j < count; ++j) top = fmaxf(top, maxima[j * scalar_stride]);
    total = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) o[i] = 0.f;
    for (int j = 0; j < count; ++j) {
        const float maximum = maxima[j * scalar_stride];
        const float factor = maximum == neg_inf() ? 0.f : __expf(maximum - top);
        total += totals[j * scalar_stride] * factor;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] += outputs[j * output_stride + lane * PER + i] * factor;
    }
}

#endif  // MEGATRON_ONLINE_SOFTMAX_CUH
