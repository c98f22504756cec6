// The first half of a decode step's transformer layer in one kernel: the input norm, the QKV
// projection, the new keys and values stored in the paged cache and the attention over it, one
// thread-block cluster per key/value group (ops::decode_attention). Cluster instructions exist
// from sm_90 on; for older GPUs the kernels compile but are never launched.

#include "scalars.cuh"
#include "dependent_launch.cuh"
#include "decode_gemv_parts.cuh"
#include "online_softmax.cuh"

constexpr int CLUSTER = 8;
constexpr int UNROLL = 8;
constexpr int BLOCK_SIZE = 16;

__device__ __forceinline__ unsigned int cluster_rank() {
    unsigned int rank = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
#endif
    return rank;
}
// The address of `local` (this block's shared memory) in the shared memory of block `rank` of
// the cluster.
__device__ __forceinline__ unsigned int cluster_address(const void* local, unsigned int rank) {
    unsigned int address = (unsigned int)__cvta_generic_to_shared(local);
#if __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %0, %1;" : "+r"(address) : "r"(rank));
#endif
    return address;
}
__device__ __forceinline__ void store_cluster(unsigned int address, float value) {
#if __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(address), "f"(value) : "memory");
#endif
}
// Barriers of the cluster's blocks: `arrive` says this block's earlier stores are done
// (release), `wait` waits for every block's arrival and sees their stores (acquire). The
// relaxed arrival only says the block is running.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// Block b of cluster g (key/value group g) computes channels [b·columns, (b+1)·columns) of the
// group's `width` = (per_group + 2)·D QKV channels (per_group query heads, then the key and
// the value): weight rows g·width + b·columns on. x [rows, K]; w [groups·width, K]; gamma,
// beta [K]; bias [groups·width]; pool [slots, groups, 2D]; tables [rows, per_row];
// positions, write_slots [rows]; out [rows, heads, D]. Dynamic shared memory: the weight
// slice [columns, K], the staged input [R, K], the biases [columns] (float, rounded up to 4),
// the group's q, k, v [R, width] (float), the partials this block merges
// [CLUSTER, slots, D + 2] (float): for pair p = row·per_group + head it merges, p % CLUSTER
// is this block's rank and p / CLUSTER its slot; then, from a 16-byte boundary, the cached
// keys and values of the first `staged` positions of each row's share [R, staged, 2D].
// A row's cached positions were written by earlier steps and its block table, position and
// slot are inputs of the step, not written by any kernel of it: they are read before the
// wait, so the attention reads its keys and values from shared memory.
template <typename T, int D, int R>
__device__ void decode_attend(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ gamma, const T* __restrict__ beta,
                              const T* __restrict__ bias, T* pool,
                              const long long* __restrict__ tables,
                              const long long* __restrict__ positions,
                              const long long* __restrict__ write_slots, T* __restrict__ out,
                              int rows, int K, int heads, int groups, int per_row, int flags,
                              float eps, float softmax_scale, int columns, int slots,
                              int staged) {
    constexpr int V = Lanes<T>::N;
    constexpr int PER = D / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int rank = (int)cluster_rank();
    const int group = blockIdx.x / CLUSTER;
    const int per_group = heads / groups;
    const int width = (per_group + 2) * D;
    const long long first = (long long)group * width + (long long)rank * columns;
    extern __shared__ __align__(16) unsigned char dynamic_shared[];
    T* ws = reinterpret_cast<T*>(dynamic_shared);
    T* xs = ws + (long long)columns * K;
    float* biases = reinterpret_cast<float*>(xs + (long long)R * K);
    float* qkv = biases + (columns + 3) / 4 * 4;
    float* partials = qkv + R * width;
    const unsigned long long kv_start =
        (reinterpret_cast<unsigned long long>(partials + (long long)CLUSTER * slots * (D + 2)) +
         15) / 16 * 16;
    T* kv_staged = reinterpret_cast<T*>(kv_start);
    // Other blocks write into this block's shared memory only once every block runs.
    cluster_arrive_relaxed();
    let_next_kernel_start();
    const T* slice = w + first * K;
    const int packs = columns * K / V;
    for (int i = threadIdx.x; i < packs; i += blockDim.x)
        copy_16_async(ws + (long long)i * V, slice + (long long)i * V);
    // Each row's newest position, its slot, and this block's share [lo, hi) of its positions.
    __shared__ long long newest[R];
    __shared__ long long new_slot[R];
    __shared__ long long share_lo[R];
    __shared__ long long share_hi[R];
    const long long most = (long long)per_row * BLOCK_SIZE - 1;
    if (threadIdx.x < rows) {
        const long long position = positions[threadIdx.x];
        const long long count = (position < most ? position : most) + 1;
        const long long chunk = (count + CLUSTER - 1) / CLUSTER;
        const long long lo = rank * chunk;
        newest[threadIdx.x] = position;
        new_slot[threadIdx.x] = write_slots[threadIdx.x];
        share_lo[threadIdx.x] = lo;
        share_hi[threadIdx.x] = lo + chunk < count ? lo + chunk : count;
    }
    __syncthreads();
    const long long slot_stride = (long long)groups * 2 * D;
    constexpr int KV_PACKS = 2 * D / V;
    for (int r = 0; r < rows; ++r) {
        const long long lo = share_lo[r];
        const long long n = share_hi[r] - lo < staged ? share_hi[r] - lo : staged;
        const long long* table = tables + (long long)r * per_row;
        for (long long i = threadIdx.x; i < n * KV_PACKS; i += blockDim.x) {
            const long long p = lo + i / KV_PACKS;
            if (p == newest[r]) continue;
            const long long slot = table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
            const int pack = (int)(i % KV_PACKS);
            copy_16_async(kv_staged + ((long long)r * staged + (p - lo)) * 2 * D + pack * V,
                          pool + slot * slot_stride + (long long)group * 2 * D + pack * V);
        }
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    stage_after_copies<T, R>(x, xs, gamma, beta, bias, biases, first, columns, rows, K, flags,
                             eps);
    cluster_wait();
    // The projection, as decode_gemv_cached computes a column; lane r has row r's channel and
    // sends it to every block, a key or value channel to the row's cache slot too.
    for (int c = warp; c < columns; c += WARPS) {
        float acc[R];
        column_sums<T, R>(ws + (long long)c * K, xs, rows, K, acc);
        const int channel = rank * columns + c;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (lane != r || r >= rows) continue;
            float value = acc[r];
            if (flags & ADD_BIAS) value += biases[c];
            value = rounded<T>(value);
            for (int b = 0; b < CLUSTER; ++b)
                store_cluster(cluster_address(qkv + r * width + channel, b), value);
            if (channel >= per_group * D)
                store(pool + new_slot[r] * slot_stride + (long long)group * 2 * D +
                          (channel - per_group * D),
                      value);
        }
    }
    cluster_arrive();
    cluster_wait();
    // This block's share of each (row, head): positions [rank·chunk, (rank+1)·chunk) of the
    // row's; its own newest position from the cluster's keys and values, the others staged in
    // shared memory or, past the staged ones, from the cache. Warps take UNROLL positions at a
    // time, lanes PER channels each.
    __shared__ float warp_max[WARPS];
    __shared__ float warp_total[WARPS];
    __shared__ float warp_acc[WARPS][D];
    const int pairs = rows * per_group;
    for (int pair = 0; pair < pairs; ++pair) {
        const int r = pair / per_group;
        const int head = pair % per_group;
        const long long lo = share_lo[r];
        const long long hi = share_hi[r];
        const float* q = qkv + r * width + head * D + lane * PER;
        const float* fresh = qkv + r * width + per_group * D + lane * PER;
        const long long* table = tables + (long long)r * per_row;
        float qv[PER];
        float acc[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            qv[i] = q[i] * softmax_scale;
            acc[i] = 0.f;
        }
        float m = neg_inf();
        float l = 0.f;
        for (long long base = lo + (long long)warp * UNROLL; base < hi;
             base += WARPS * UNROLL) {
            float k[UNROLL][PER];
            float v[UNROLL][PER];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long p = base + u < hi ? base + u : hi - 1;
                if (p == newest[r]) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        k[u][i] = fresh[i];
                        v[u][i] = fresh[D + i];
                    }
                } else {
                    const T* kv;
                    if (p - lo < staged) {
                        kv = kv_staged + ((long long)r * staged + (p - lo)) * 2 * D + lane * PER;
                    } else {
                        const long long slot =
                            table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
                        kv = pool + slot * slot_stride + (long long)group * 2 * D + lane * PER;
                    }
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        k[u][i] = load(kv + i);
                        v[u][i] = load(kv + D + i);
                    }
                }
            }
            softmax_round<PER, UNROLL>(qv, k, v, hi - base, m, l, acc);
        }
        if (lane == 0) {
            warp_max[warp] = m;
            warp_total[warp] = l;
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) warp_acc[warp][lane * PER + i] = acc[i];
        __syncthreads();
        if (warp == 0) {
            float top;
            float total;
            float o[PER];
            merge_partials<PER>(WARPS, warp_max, warp_total, 1, &warp_acc[0][0], D, lane, top,
                                total, o);
            const unsigned int merger = pair % CLUSTER;
            float* partial = partials + ((long long)rank * slots + pair / CLUSTER) * (D + 2);
#pragma unroll
            for (int i = 0; i < PER; ++i)
                store_cluster(cluster_address(partial + lane * PER + i, merger), o[i]);
            if (lane == 0) {
                store_cluster(cluster_address(partial + D, merger), top);
                store_cluster(cluster_address(partial + D + 1, merger), total);
            }
        }
        __syncthreads();
    }
    cluster_arrive();
    cluster_wait();
    // The (row, head) pairs this block merges, a warp each, the partials in rank order.
    for (int pair = rank + warp * CLUSTER; pair < pairs; pair += WARPS * CLUSTER) {
        const float* slot = partials + (long long)(pair / CLUSTER) * (D + 2);
        const long long stride = (long long)slots * (D + 2);
        float top;
        float total;
        float o[PER];
        merge_partials<PER>(CLUSTER, slot + D, slot + D + 1, stride, slot, stride, lane, top,
                            total, o);
        const int r = pair / per_group;
        const int head = group * per_group + pair % per_group;
        T* target = out + ((long long)r * heads + head) * D + lane * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) store(target + i, o[i] / total);
    }
}

// A cluster of CLUSTER blocks along x, fixed in the kernel (no launch attribute needed).
#if __CUDA_ARCH__ >= 900
#define CLUSTER_DIMS __cluster_dims__(CLUSTER, 1, 1)
#else
#define CLUSTER_DIMS
#endif

#define DECODE_ATTEND(NAME, T, D, R)                                                        \
    extern "C" __global__ void __launch_bounds__(WARPS * 32) CLUSTER_DIMS                  \
        NAME(const T* x, const T* w, const T* gamma, const T* beta, const T* bias, T* pool, \
             const long long* tables, const long long* positions,                           \
             const long long* write_slots, T* out, int rows, int K, int heads, int groups,  \
             int per_row, int flags, float eps, float softmax_scale, int columns,           \
             int slots, int staged) {                                                       \
        decode_attend<T, D, R>(x, w, gamma, beta, bias, pool, tables, positions,            \
                               write_slots, out, rows, K, heads, groups, per_row, flags,    \
                               eps, softmax_scale, columns, slots, staged);                 \
    }

#define DECODE_ATTEND_ROWS(T, NAME, D)                   \
    DECODE_ATTEND(decode_attend_##NAME##_##D##_1, T, D, 1) \
    DECODE_ATTEND(decode_attend_##NAME##_##D##_2, T, D, 2) \
    DECODE_ATTEND(decode_attend_##NAME##_##D##_4, T, D, 4) \
    DECODE_ATTEND(decode_attend_##NAME##_##D##_8, T, D, 8)

DECODE_ATTEND_ROWS(bf16, bf16, 64)
DECODE_ATTEND_ROWS(bf16, bf16, 128)
DECODE_ATTEND_ROWS(f16, f16, 64)
DECODE_ATTEND_ROWS(f16, f16, 128)
DECODE_ATTEND_ROWS(float, f32, 64)
DECODE_ATTEND_ROWS(float, f32, 128)
