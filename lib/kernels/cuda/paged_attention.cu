// Decode attention over the paged KV cache (ops::paged_attention): one block per (head, row),
// its warps taking turns over the row's positions; a warp's lanes hold `D / 32` consecutive
// channels of the query and of the running output, and a warp scores eight positions at once
// so that their loads are in flight together.

#include "scalars.cuh"
#include "dependent_launch.cuh"
#include "online_softmax.cuh"

// Warps per block at most (the launch picks how many).
constexpr int MAX_WARPS = 16;
constexpr int UNROLL = 8;
// Table entries kept in shared memory (positions up to TABLE_CACHE * BLOCK_SIZE), so that a
// position's load waits for one memory round trip instead of two.
constexpr int TABLE_CACHE = 256;
constexpr int BLOCK_SIZE = 16;

// query [rows, heads, D] (channels contiguous, rows and heads at the given strides); pool
// [slots, groups, 2D] (keys, then values); tables [rows, per_row] block ids; positions [rows]:
// row r attends to its positions 0..=positions[r]; out [rows, heads, D] contiguous. With
// `fresh` ([rows, groups, 2D], channels contiguous, rows and groups at the given strides: the
// new position's keys and values, not yet in the pool), position positions[r] is read from
// there, and the block of each group's first head stores it at pool slot write_slots[r]; no
// block reads that slot from the pool, so the store needs no ordering with the reads.
template <typename T, int D>
__device__ void paged_decode(const T* query, long long query_row_stride,
                             long long query_head_stride, T* pool,
                             const long long* tables, const long long* positions, T* out,
                             int heads, int groups, int per_row, float scale, const T* fresh,
                             long long fresh_row_stride, long long fresh_group_stride,
                             const long long* write_slots) {
    // Everything read here may come from the previous kernel (the query, the new keys and
    // values), so the wait comes first; starting the next kernel lets it load its weights.
    let_next_kernel_start();
    wait_for_previous_kernel();
    constexpr int PER = D / 32;
    const int head = blockIdx.x;
    const long long row = blockIdx.y;
    const int group = head / (heads / groups);
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const int lane = threadIdx.x % 32;
    const T* q = query + row * query_row_stride + head * query_head_stride + lane * PER;
    float qv[PER];
    float acc[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = load(q + i) * scale;
        acc[i] = 0.f;
    }
    const long long newest = positions[row];
    const long long most = (long long)per_row * BLOCK_SIZE - 1;
    const long long last = newest < most ? newest : most;
    const long long* table = tables + row * per_row;
    const long long slot_stride = (long long)groups * 2 * D;
    const T* fresh_kv =
        fresh ? fresh + row * fresh_row_stride + (long long)group * fresh_group_stride : nullptr;
    if (fresh_kv && head % (heads / groups) == 0) {
        T* target = pool + write_slots[row] * slot_stride + (long long)group * 2 * D;
        for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) target[i] = fresh_kv[i];
    }
    __shared__ long long table_cache[TABLE_CACHE];
    const long long used_blocks = last / BLOCK_SIZE + 1;
    const long long cached = used_blocks < TABLE_CACHE ? used_blocks : TABLE_CACHE;
    for (long long i = threadIdx.x; i < cached; i += blockDim.x) table_cache[i] = table[i];
    __syncthreads();
    float m = neg_inf();
    float l = 0.f;
    // Each warp takes UNROLL consecutive positions at a time, their keys and values loaded
    // together;
    // positions past the row's last are read at the last one and weigh nothing.
    for (long long base = (long long)warp * UNROLL; base <= last; base += warps * UNROLL) {
        float k[UNROLL][PER];
        float v[UNROLL][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long p = base + u <= last ? base + u : last;
            const T* kv;
            if (fresh_kv && p == newest) {
                kv = fresh_kv + lane * PER;
            } else {
                const long long entry = p / BLOCK_SIZE;
                const long long block = entry < TABLE_CACHE ? table_cache[entry] : table[entry];
                const long long slot = block * BLOCK_SIZE + p % BLOCK_SIZE;
                kv = pool + slot * slot_stride + (long long)group * 2 * D + lane * PER;
            }
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                k[u][i] = load(kv + i);
                v[u][i] = load(kv + D + i);
            }
        }
        softmax_round<PER, UNROLL>(qv, k, v, last + 1 - base, m, l, acc);
    }
    __shared__ float warp_max[MAX_WARPS];
    __shared__ float warp_sum[MAX_WARPS];
    __shared__ float warp_acc[MAX_WARPS][D];
    if (lane == 0) {
        warp_max[warp] = m;
        warp_sum[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) warp_acc[warp][lane * PER + i] = acc[i];
    __syncthreads();
    if (warp != 0) return;
    float top;
    float total;
    float o[PER];
    merge_partials<PER>(warps, warp_max, warp_sum, 1, &warp_acc[0][0], D, lane, top, total, o);
    T* target = out + (row * heads + head) * D + lane * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) store(target + i, o[i] / total);
}

#define PAGED_DECODE(NAME, T, D)                                                         \
    extern "C" __global__ void NAME(const T* query, long long query_row_stride,          \
                                    long long query_head_stride, T* pool,                 \
                                    const long long* tables, const long long* positions,  \
                                    T* out, int heads, int groups, int per_row,           \
                                    float scale, const T* fresh,                          \
                                    long long fresh_row_stride,                           \
                                    long long fresh_group_stride,                         \
                                    const long long* write_slots) {                       \
        paged_decode<T, D>(query, query_row_stride, query_head_stride, pool, tables,      \
                           positions, out, heads, groups, per_row, scale, fresh,          \
                           fresh_row_stride, fresh_group_stride, write_slots);            \
    }

PAGED_DECODE(paged_decode_bf16_64, bf16, 64)
PAGED_DECODE(paged_decode_bf16_128, bf16, 128)
PAGED_DECODE(paged_decode_f16_64, f16, 64)
PAGED_DECODE(paged_decode_f16_128, f16, 128)
PAGED_DECODE(paged_decode_f32_64, float, 64)
PAGED_DECODE(paged_decode_f32_128, float, 128)
