//! A decode step's transformer layers as one persistent kernel: every block stays resident for
//! up to [`MAX_LAYERS`] layers and the blocks meet at a grid-wide barrier between the five
//! stages of a layer (norm + QKV, attention, output projection + residual, norm + fc1 + GeLU,
//! fc2 + residual) instead of ending one kernel and starting the next. At a handful of rows
//! each stage reads a few megabytes of weights in a few microseconds; as kernels of their own
//! (see [`crate::ops::decode_gemv`]) each also pays a kernel's start and end, more than the
//! reading itself. Here a warp issues the loads of its next stage's first weights before it
//! waits at the barrier, so that the reading overlaps the wait.
//!
//! A stage's output columns are spread over every warp of the grid; each block copies the
//! stage's input rows (and normalizes them for the norm stages) into shared memory first.
//! Attention splits each (row, head) over several blocks by position; the last block of a
//! (row, head) to finish merges their partial softmax sums in a fixed order, so results do not
//! depend on timing. Results are rounded where the unfused layers round them, as the decode
//! linear kernels do, so the paths agree up to the order of the sums.
//!
//! The kernel serves tensor-parallel-free GPT layers with LayerNorm or RMSNorm before attention
//! and MLP, a GeLU MLP, learned or no position embeddings (no rotary), head dims 64 and 128; other
//! models keep the per-layer decode kernels.

use std::ffi::c_void;

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use crate::model::config::Normalization;
use crate::model::layers::BLOCK_SIZE;
use crate::ops::decode_gemv::{
    excess_difference, reference_linear, tolerance, Epilogue, Gelu, InputNorm,
};
use crate::runtime::nvrtc::{kernels, KernelSource};

// The kernel's BLOCK_SIZE.
const _: () = assert!(BLOCK_SIZE == 16);

/// Layers one launch runs (the kernel's `MAX_LAYERS`): their weights travel in the kernel's
/// parameters, which stay within 4 KiB.
pub const MAX_LAYERS: usize = 16;

/// The most rows a step may have (the kernel's largest row template).
pub const MAX_ROWS: i64 = 8;

/// Threads per block (the kernel's `WARPS` · 32).
const THREADS: u32 = 256;

/// At most this many blocks share one (row, head)'s positions.
const MAX_SPLITS: i64 = 16;

/// Shared memory a block may take for its staged input rows (of the 227 KiB of an H100 SM).
const MAX_STAGED_BYTES: i64 = 160 * 1024;

/// Words of the barriers and of the attention merge counters: two for the grid barriers, one
/// per (row, head) after them.
pub const SYNC_WORDS: i64 = 2 + MAX_ROWS * 256;

/// The kernel's CUDA source for activations of `STACK_T` and heads of `STACK_D` channels
/// (defined before it): `decode_stack_R` for steps of up to R rows. The layers are
/// `Layer`s in a `Stack` passed by value (see [`StackArgs`]).
macro_rules! stack_source {
    () => {
        r#"
#ifndef DEBUG_FLAGS
#define DEBUG_FLAGS 0
#endif
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int MAX_LAYERS = 16;
constexpr int BLOCK_SIZE = 16;
// Positions a warp scores at once in attention.
constexpr int UNROLL = 8;
constexpr int NORM_LAYER = 1;
constexpr int NORM_RMS = 2;
constexpr int NORM_ONE_PLUS = 4;
constexpr int GELU_TANH = 16;
constexpr int GELU_ERF = 32;

// One layer's tensors (null biases where the layer has none).
struct Layer {
    const void* norm1_weight;
    const void* norm1_bias;
    const void* qkv_weight;
    const void* qkv_bias;
    const void* proj_weight;
    const void* proj_bias;
    const void* norm2_weight;
    const void* norm2_bias;
    const void* fc1_weight;
    const void* fc1_bias;
    const void* fc2_weight;
    const void* fc2_bias;
    // [slots, groups, 2 * D]: keys, then values.
    void* pool;
};

struct Stack {
    Layer layers[MAX_LAYERS];
    // [rows, hidden]: the first layer's input; layer l writes outputs[l % 2].
    const void* input;
    void* outputs[2];
    // Scratch between the stages: [rows, hidden], [rows, (heads + 2 groups) D], [rows, heads D],
    // [rows, ffn], and [rows, heads, splits, D + 2] float partial attention sums.
    void* x1;
    void* qkv;
    void* attn;
    void* inter;
    float* partials;
    // [rows, per_row] block ids, [rows] newest positions, [rows] their pool slots.
    const long long* tables;
    const long long* positions;
    const long long* write_slots;
    // [0] arrivals at the grid barriers, [1] blocks finished, [2 + row * heads + head] arrivals
    // of a (row, head)'s attention splits; all zero between launches.
    unsigned int* sync;
    int num_layers;
    int rows;
    int hidden;
    int ffn;
    int heads;
    int groups;
    int per_row;
    int splits;
    int flags;
    float eps;
    float scale;
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Loads of what other blocks of this kernel wrote: from L2 (L1 is not coherent), and not moved
// across the barriers.
__device__ __forceinline__ Pack load_pack_cg(const void* p) {
    Pack r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                 : "l"(p));
    return r;
}
__device__ __forceinline__ float load_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float load_cg(const bf16* p) {
    unsigned short b;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(b) : "l"(p));
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ float load_cg(const f16* p) {
    unsigned short b;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(b) : "l"(p));
    return half_bits(b);
}

// Every block of the grid arrives before any leaves; what a block wrote before is visible to
// every block after. sync[0] counts the arrivals of the launch so far: the n-th barrier waits
// for n arrivals per block (`passed`, counted by every thread alike). One fire-and-forget add
// and a spin per block, no reset between barriers; `finish_barriers` zeroes the count for the
// next launch.
__device__ __forceinline__ void grid_barrier(unsigned int* sync, unsigned int& passed) {
    __syncthreads();
    passed += gridDim.x;
    if (threadIdx.x == 0) {
        __threadfence();
        asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(sync) : "memory");
        unsigned int now;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(sync) : "memory");
        } while (now < passed);
    }
    __syncthreads();
}

// The last block to get here (every block has passed every barrier then) zeroes the barrier
// words; the next launch reads them after this one ends.
__device__ void finish_barriers(unsigned int* sync) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
        atomicExch(sync, 0u);
        atomicExch(sync + 1, 0u);
    }
}

// Copies rows x K of x (written by other blocks) into shared memory, normed there when flags
// ask, rounded as the unfused norm rounds its output.
template <typename T, int R>
__device__ void stage_input(const T* x, T* xs, int rows, int K, int flags, const T* gamma,
                            const T* beta, float eps) {
    constexpr int V = Lanes<T>::N;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int packs = rows * K / V;
    for (int i = threadIdx.x; i < packs; i += THREADS)
        *reinterpret_cast<Pack*>(xs + (long long)i * V) = load_pack_cg(x + (long long)i * V);
    __syncthreads();
    const bool layer_norm = flags & NORM_LAYER;
    if (!layer_norm && !(flags & NORM_RMS)) return;
    __shared__ float shift[R];
    __shared__ float scale[R];
    // Statistics in float32 in one pass, around a pivot (the row's first value for LayerNorm),
    // as the decode linear kernels compute them.
    for (int r = warp; r < rows; r += WARPS) {
        const T* row = xs + (long long)r * K;
        const float pivot = layer_norm ? load(row) : 0.f;
        float sum = 0.f;
        float squares = 0.f;
        for (int k = lane * V; k < K; k += 32 * V) {
            float f[V];
            load_pack(row + k, f);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float d = f[i] - pivot;
                sum += d;
                squares += d * d;
            }
        }
        sum = warp_sum(sum) / K;
        squares = warp_sum(squares) / K;
        if (lane == 0) {
            const float variance = layer_norm ? fmaxf(squares - sum * sum, 0.f) : squares;
            shift[r] = layer_norm ? pivot + sum : 0.f;
            scale[r] = rsqrtf(variance + eps);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x * V; i < rows * K; i += THREADS * V) {
        const int r = i / K;
        const int k = i % K;
        float xv[V];
        float g[V];
        float b[V];
        load_pack(xs + i, xv);
        load_pack(gamma + k, g);
        if (layer_norm) load_pack(beta + k, b);
#pragma unroll
        for (int j = 0; j < V; ++j) {
            if (flags & NORM_ONE_PLUS) g[j] = rounded<T>(g[j] + 1.f);
            store(xs + i + j, layer_norm ? (xv[j] - shift[r]) * scale[r] * g[j] + b[j]
                                         : rounded<T>(xv[j] * scale[r]) * g[j]);
        }
    }
    __syncthreads();
}

// out[r, n] = epilogue(sum_k prologue(x)[r, k] * w[n, k]) for n < N: warp j of the grid takes
// columns j * C .. j * C + C - 1, then every (grid warps * C)-th after them. Its first weight
// loads go out before the grid barrier (for the `first` stage of a launch, the wait for the
// previous kernel) that comes before reading x; then the block stages x (normed by
// `norm_flags`).
// Epilogue: + bias, GeLU (`gelu_flags`), + residual ([rows, N], written by this kernel).
template <typename T, int R, int C>
__device__ __forceinline__ void linear_stage(const T* __restrict__ w, const T* __restrict__ bias,
                                             int K, int N, const T* x, T* xs, int rows,
                                             int norm_flags, const T* __restrict__ gamma,
                                             const T* __restrict__ beta, float eps,
                                             int gelu_flags, const T* residual, T* out,
                                             unsigned int* sync, unsigned int& passed,
                                             bool first) {
    constexpr int V = Lanes<T>::N;
    constexpr int U = 16 / C;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const long long stride = (long long)gridDim.x * WARPS * C;
    const long long first_column = ((long long)blockIdx.x * WARPS + warp) * C;
    Pack wp[U][C];
    auto load_round = [&](long long column, int base) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int k = base + u * 32 * V;
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const long long n = column + c < N ? column + c : N - 1;
                if (k < K) wp[u][c] = *reinterpret_cast<const Pack*>(w + n * K + k);
            }
        }
    };
    if (first_column < N) load_round(first_column, lane * V);
    if (first)
        wait_for_previous_kernel();
    else
        grid_barrier(sync, passed);
    if (!(DEBUG_FLAGS & 1024)) stage_input<T, R>(x, xs, rows, K, norm_flags, gamma, beta, eps);
    if (DEBUG_FLAGS & 256) return;
    for (long long column = first_column; column < N; column += stride) {
        if (column != first_column) load_round(column, lane * V);
        float acc[R][C];
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
        }
        for (int base = lane * V; base < K; base += 32 * V * U) {
            if (base != lane * V) load_round(column, base);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = base + u * 32 * V;
                if (k >= K) break;
                float wv[C][V];
#pragma unroll
                for (int c = 0; c < C; ++c) unpack(wp[u][c], w, wv[c]);
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    if (r >= rows) break;
                    float xv[V];
                    load_pack(xs + (long long)r * K + k, xv);
#pragma unroll
                    for (int c = 0; c < C; ++c) {
#pragma unroll
                        for (int i = 0; i < V; ++i) acc[r][c] += xv[i] * wv[c][i];
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] = warp_sum(acc[r][c]);
        }
        // Lane r * C + c writes row r, column column + c.
#pragma unroll
        for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int c = 0; c < C; ++c) {
                const long long n = column + c;
                if (lane != r * C + c || r >= rows || n >= N) continue;
                float value = acc[r][c];
                if (bias) value += load(bias + n);
                value = rounded<T>(value);
                if (gelu_flags & GELU_TANH) {
                    const float inner =
                        0.7978845608028654f * (value + 0.044715f * value * value * value);
                    value = rounded<T>(0.5f * value * (1.f + tanhf(inner)));
                } else if (gelu_flags & GELU_ERF) {
                    value = rounded<T>(0.5f * value * (1.f + erff(value * 0.7071067811865476f)));
                }
                if (residual) value += load_cg(residual + (long long)r * N + n);
                store(out + (long long)r * N + n, value);
            }
        }
    }
}

// The linear stage with two columns a warp where a column's weights take at most half of a
// warp's loads in flight, one otherwise.
template <typename T, int R>
__device__ __forceinline__ void linear(const T* w, const T* bias, int K, int N, const T* x, T* xs,
                                       int rows, int norm_flags, const T* gamma, const T* beta,
                                       float eps, int gelu_flags, const T* residual, T* out,
                                       unsigned int* sync, unsigned int& passed, bool first) {
    if (K <= 32 * Lanes<T>::N * 8)
        linear_stage<T, R, 2>(w, bias, K, N, x, xs, rows, norm_flags, gamma, beta, eps,
                              gelu_flags, residual, out, sync, passed, first);
    else
        linear_stage<T, R, 1>(w, bias, K, N, x, xs, rows, norm_flags, gamma, beta, eps,
                              gelu_flags, residual, out, sync, passed, first);
}

// Attention of each row's new position over its positions 0..=positions[r], after the grid
// barrier that makes the QKV output whole: work items (row, head, split) go to blocks in turn; a
// split's warps take UNROLL positions at a time (the newest read from the QKV output, which the
// first split of a group's first head also stores in the pool), the block merges its warps'
// softmax sums into a partial, and the last split of a (row, head) to finish merges the
// partials in split order into attn. The cached keys and values of a block's first positions
// do not depend on the QKV output: their loads go out before the barrier.
template <typename T, int D>
__device__ __forceinline__ void attention_stage(const Stack& s, T* pool, unsigned int& passed) {
    constexpr int PER = D / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int heads = s.heads;
    const int per_group = heads / s.groups;
    const int splits = s.splits;
    const long long qkv_width = (long long)(heads + 2 * s.groups) * D;
    const long long slot_stride = (long long)s.groups * 2 * D;
    const T* qkv = (const T*)s.qkv;
    T* attn = (T*)s.attn;
    __shared__ float warp_max[WARPS];
    __shared__ float warp_total[WARPS];
    __shared__ float warp_acc[WARPS][D];
    __shared__ bool merges;
    const int items = (DEBUG_FLAGS & 512) ? 0 : s.rows * heads * splits;
    // A work item's positions begin..=end of row `row` (newest its new one).
    struct Item {
        int row, head, split, group;
        long long newest, begin, end;
        const long long* table;
    };
    auto item_at = [&](int item) {
        Item it;
        it.row = item / (heads * splits);
        it.head = (item / splits) % heads;
        it.split = item % splits;
        it.group = it.head / per_group;
        it.newest = s.positions[it.row];
        const long long most = (long long)s.per_row * BLOCK_SIZE - 1;
        const long long last = it.newest < most ? it.newest : most;
        const long long chunk = (last + splits) / splits;
        it.begin = it.split * chunk;
        it.end = it.begin + chunk - 1 < last ? it.begin + chunk - 1 : last;
        it.table = s.tables + (long long)it.row * s.per_row;
        return it;
    };
    float k[UNROLL][PER];
    float v[UNROLL][PER];
    // Loads positions base.. base + UNROLL - 1 (clamped to end) of `it`, all but the newest,
    // which only the QKV output has.
    auto load_cached = [&](const Item& it, long long base) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long p = base + u <= it.end ? base + u : it.end;
            if (p == it.newest) continue;
            const long long slot = it.table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE;
            const T* kv = pool + slot * slot_stride + (long long)it.group * 2 * D + lane * PER;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                k[u][i] = load(kv + i);
                v[u][i] = load(kv + D + i);
            }
        }
    };
    if ((int)blockIdx.x < items) {
        const Item it = item_at(blockIdx.x);
        const long long base = it.begin + (long long)warp * UNROLL;
        if (base <= it.end) load_cached(it, base);
    }
    grid_barrier(s.sync, passed);
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const Item it = item_at(item);
        const T* group_qkv = qkv + it.row * qkv_width + (long long)it.group * (per_group + 2) * D;
        const T* fresh = group_qkv + per_group * D;
        if (it.split == 0 && it.head % per_group == 0) {
            T* target = pool + s.write_slots[it.row] * slot_stride + (long long)it.group * 2 * D;
            for (int i = threadIdx.x; i < 2 * D; i += THREADS) store(target + i, load_cg(fresh + i));
        }
        float qv[PER];
        float acc[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            qv[i] = load_cg(group_qkv + (it.head % per_group) * D + lane * PER + i) * s.scale;
            acc[i] = 0.f;
        }
        float m = neg_inf();
        float l = 0.f;
        const long long first_base = it.begin + (long long)warp * UNROLL;
        for (long long base = first_base; base <= it.end; base += WARPS * UNROLL) {
            // The first round of the block's first item loaded before the barrier.
            if (item != (int)blockIdx.x || base != first_base) load_cached(it, base);
            float sc[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const long long p = base + u <= it.end ? base + u : it.end;
                if (p == it.newest) {
#pragma unroll
                    for (int i = 0; i < PER; ++i) {
                        k[u][i] = load_cg(fresh + lane * PER + i);
                        v[u][i] = load_cg(fresh + D + lane * PER + i);
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < PER; ++i) dot += qv[i] * k[u][i];
                sc[u] = dot;
            }
#pragma unroll
            for (int offset = 16; offset > 0; offset /= 2) {
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], offset);
            }
            float m_new = m;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (base + u <= it.end) m_new = fmaxf(m_new, sc[u]);
            }
            const float keep = __expf(m - m_new);
            l *= keep;
#pragma unroll
            for (int i = 0; i < PER; ++i) acc[i] *= keep;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float weight = base + u <= it.end ? __expf(sc[u] - m_new) : 0.f;
                l += weight;
#pragma unroll
                for (int i = 0; i < PER; ++i) acc[i] += weight * v[u][i];
            }
            m = m_new;
        }
        if (lane == 0) {
            warp_max[warp] = m;
            warp_total[warp] = l;
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) warp_acc[warp][lane * PER + i] = acc[i];
        __syncthreads();
        const long long pair = (long long)it.row * heads + it.head;
        T* target = attn + pair * D + lane * PER;
        if (warp == 0) {
            float top = neg_inf();
            for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_max[w]);
            float total = 0.f;
            float o[PER];
#pragma unroll
            for (int i = 0; i < PER; ++i) o[i] = 0.f;
            for (int w = 0; w < WARPS; ++w) {
                const float factor = warp_max[w] == neg_inf() ? 0.f : __expf(warp_max[w] - top);
                total += warp_total[w] * factor;
#pragma unroll
                for (int i = 0; i < PER; ++i) o[i] += warp_acc[w][lane * PER + i] * factor;
            }
            if (splits == 1) {
#pragma unroll
                for (int i = 0; i < PER; ++i) store(target + i, o[i] / total);
            } else {
                float* partial = s.partials + (pair * splits + it.split) * (D + 2);
#pragma unroll
                for (int i = 0; i < PER; ++i) partial[2 + lane * PER + i] = o[i];
                if (lane == 0) {
                    partial[0] = top;
                    partial[1] = total;
                }
            }
        }
        if (splits > 1) {
            __threadfence();
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned int* arrivals = s.sync + 2 + pair;
                merges = atomicAdd(arrivals, 1u) == (unsigned int)splits - 1;
                if (merges) atomicExch(arrivals, 0u);
            }
            __syncthreads();
            if (merges && warp == 0) {
                __threadfence();
                const float* first = s.partials + pair * splits * (D + 2);
                float top = neg_inf();
                for (int p = 0; p < splits; ++p) top = fmaxf(top, load_cg(first + p * (D + 2)));
                float total = 0.f;
                float o[PER];
#pragma unroll
                for (int i = 0; i < PER; ++i) o[i] = 0.f;
                for (int p = 0; p < splits; ++p) {
                    const float* part = first + p * (D + 2);
                    const float pm = load_cg(part);
                    const float factor = pm == neg_inf() ? 0.f : __expf(pm - top);
                    total += load_cg(part + 1) * factor;
#pragma unroll
                    for (int i = 0; i < PER; ++i) o[i] += load_cg(part + 2 + lane * PER + i) * factor;
                }
#pragma unroll
                for (int i = 0; i < PER; ++i) store(target + i, o[i] / total);
            }
        }
        __syncthreads();
    }
}

// Asks L2 for this block's share of `bytes` bytes at p (16-byte aligned, a multiple of 16
// bytes), so that the loads of a later stage find them there: the weights stream from memory
// while the grid waits at barriers and works on what came before.
__device__ __forceinline__ void prefetch_share(const void* p, long long bytes) {
#if __CUDA_ARCH__ >= 900
    const long long share = (bytes / gridDim.x + 255) / 256 * 256;
    const long long begin = share * blockIdx.x;
    if (threadIdx.x != 0 || begin >= bytes) return;
    const long long size = share < bytes - begin ? share : bytes - begin;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"((const char*)p + begin),
                 "r"((unsigned int)size)
                 : "memory");
#endif
}

template <typename T>
__device__ __forceinline__ void prefetch_layer(const Layer& L, long long hidden, long long qkv_width,
                                               long long attn_width, long long ffn) {
    prefetch_share(L.qkv_weight, qkv_width * hidden * sizeof(T));
    prefetch_share(L.proj_weight, hidden * attn_width * sizeof(T));
    prefetch_share(L.fc1_weight, ffn * hidden * sizeof(T));
    prefetch_share(L.fc2_weight, hidden * ffn * sizeof(T));
}

template <typename T, int R, int D>
__device__ void decode_stack(const Stack& s) {
    extern __shared__ __align__(16) unsigned char staged_bytes[];
    T* xs = reinterpret_cast<T*>(staged_bytes);
    // The next launch (more layers, or the output layer) may load its weights meanwhile.
    let_next_kernel_start();
    const int hidden = s.hidden;
    const int qkv_width = (s.heads + 2 * s.groups) * D;
    const int attn_width = s.heads * D;
    const int norm = s.flags & (NORM_LAYER | NORM_RMS | NORM_ONE_PLUS);
    const int gelu = s.flags & (GELU_TANH | GELU_ERF);
    unsigned int passed = 0;
    if (s.num_layers > 0) prefetch_layer<T>(s.layers[0], hidden, qkv_width, attn_width, s.ffn);
    for (int l = 0; l < s.num_layers; ++l) {
        const Layer& L = s.layers[l];
        if (l + 1 < s.num_layers)
            prefetch_layer<T>(s.layers[l + 1], hidden, qkv_width, attn_width, s.ffn);
        const T* x = (const T*)(l == 0 ? s.input : s.outputs[(l - 1) % 2]);
        T* y = (T*)s.outputs[l % 2];
        T* x1 = (T*)s.x1;
        T* inter = (T*)s.inter;
        // The first layer's input comes from the kernel before this one.
        linear<T, R>((const T*)L.qkv_weight, (const T*)L.qkv_bias, hidden, qkv_width, x, xs,
                     s.rows, norm, (const T*)L.norm1_weight, (const T*)L.norm1_bias, s.eps, 0,
                     nullptr, (T*)s.qkv, s.sync, passed, l == 0);
        attention_stage<T, D>(s, (T*)L.pool, passed);
        linear<T, R>((const T*)L.proj_weight, (const T*)L.proj_bias, attn_width, hidden,
                     (const T*)s.attn, xs, s.rows, 0, nullptr, nullptr, 0.f, 0, x, x1, s.sync,
                     passed, false);
        linear<T, R>((const T*)L.fc1_weight, (const T*)L.fc1_bias, hidden, s.ffn, x1, xs, s.rows,
                     norm, (const T*)L.norm2_weight, (const T*)L.norm2_bias, s.eps, gelu, nullptr,
                     inter, s.sync, passed, false);
        linear<T, R>((const T*)L.fc2_weight, (const T*)L.fc2_bias, s.ffn, hidden, inter, xs,
                     s.rows, 0, nullptr, nullptr, 0.f, 0, x1, y, s.sync, passed, false);
    }
    finish_barriers(s.sync);
}

#define DECODE_STACK(R)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) decode_stack_##R(const Stack s) {  \
        decode_stack<STACK_T, R, STACK_D>(s);                                                  \
    }
DECODE_STACK(1)
DECODE_STACK(2)
DECODE_STACK(4)
DECODE_STACK(8)
"#
    };
}

/// One module per activation type and head size, so that a model compiles and loads only its
/// own kernels.
macro_rules! stack_module {
    ($name:literal, $type:literal, $head_dim:literal) => {
        KernelSource {
            name: $name,
            source: concat!(
                "#define STACK_T ",
                $type,
                "\n#define STACK_D ",
                $head_dim,
                "\n",
                cuda_scalars!(),
                dependent_launch!(),
                packed_rows!(),
                stack_source!()
            ),
            functions: &["decode_stack_1", "decode_stack_2", "decode_stack_4", "decode_stack_8"],
        }
    };
}

/// The kernel modules: bf16, fp16 and fp32 activations, heads of 64 and 128 channels.
pub static SOURCES: [KernelSource; 6] = [
    stack_module!("decode_stack_bf16_64", "bf16", "64"),
    stack_module!("decode_stack_bf16_128", "bf16", "128"),
    stack_module!("decode_stack_f16_64", "f16", "64"),
    stack_module!("decode_stack_f16_128", "f16", "128"),
    stack_module!("decode_stack_f32_64", "float", "64"),
    stack_module!("decode_stack_f32_128", "float", "128"),
];

// The kernel's flags.
const NORM_LAYER: i32 = 1;
const NORM_RMS: i32 = 2;
const NORM_ONE_PLUS: i32 = 4;
const GELU_TANH: i32 = 16;
const GELU_ERF: i32 = 32;

/// One transformer layer as the kernel reads it: pre-norm attention and GeLU MLP, whole (no
/// tensor parallelism), and its KV cache pool (`[slots, groups, 2·head_dim]`).
pub struct StackLayer<'a> {
    pub input_norm: InputNorm<'a>,
    pub qkv_weight: &'a Tensor,
    pub qkv_bias: Option<&'a Tensor>,
    pub proj_weight: &'a Tensor,
    pub proj_bias: Option<&'a Tensor>,
    pub mlp_norm: InputNorm<'a>,
    pub fc1_weight: &'a Tensor,
    pub fc1_bias: Option<&'a Tensor>,
    pub fc2_weight: &'a Tensor,
    pub fc2_bias: Option<&'a Tensor>,
    pub pool: &'a Tensor,
}

/// The attention and MLP shape the layers share.
#[derive(Debug, Clone, Copy)]
pub struct StackShape {
    pub heads: i64,
    pub groups: i64,
    pub head_dim: i64,
    pub gelu: Gelu,
}

/// Where a decode step's rows read and write the cache: block tables `[rows, per_row]`, each
/// row's new position `[rows]` and its pool slot `[rows]`, int64 on the device.
pub struct StepSlots<'a> {
    pub tables: &'a Tensor,
    pub positions: &'a Tensor,
    pub write_slots: &'a Tensor,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct LayerArgs {
    norm1_weight: u64,
    norm1_bias: u64,
    qkv_weight: u64,
    qkv_bias: u64,
    proj_weight: u64,
    proj_bias: u64,
    norm2_weight: u64,
    norm2_bias: u64,
    fc1_weight: u64,
    fc1_bias: u64,
    fc2_weight: u64,
    fc2_bias: u64,
    pool: u64,
}

/// The kernel's `Stack` parameter, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct StackArgs {
    layers: [LayerArgs; MAX_LAYERS],
    input: u64,
    outputs: [u64; 2],
    x1: u64,
    qkv: u64,
    attn: u64,
    inter: u64,
    partials: u64,
    tables: u64,
    positions: u64,
    write_slots: u64,
    sync: u64,
    num_layers: i32,
    rows: i32,
    hidden: i32,
    ffn: i32,
    heads: i32,
    groups: i32,
    per_row: i32,
    splits: i32,
    flags: i32,
    eps: f32,
    scale: f32,
}

fn pointer(tensor: Option<&Tensor>) -> u64 {
    tensor.map_or(0, |t| t.data_ptr() as u64)
}

fn aligned(tensor: &Tensor) -> bool {
    (tensor.data_ptr() as usize).is_multiple_of(16)
}

/// The norm flags of the kernel for `norm`.
fn norm_flags(norm: &InputNorm) -> i32 {
    let kind = match norm.kind {
        Normalization::LayerNorm => NORM_LAYER,
        Normalization::RMSNorm => NORM_RMS,
    };
    kind | if norm.one_plus { NORM_ONE_PLUS } else { 0 }
}

/// Whether [`decode_stack`] runs `rows` rows through `layers` of `shape` in `kind`: 1 to
/// [`MAX_ROWS`] rows; a dtype and head dim the kernel has; every layer's norms alike, with
/// LayerNorm's bias; weights contiguous, 16-byte aligned, of `kind` and of the shapes `shape`
/// implies; widths of whole 16-byte loads; the staged input rows within the shared memory
/// allowed.
pub fn supports(layers: &[StackLayer], shape: &StackShape, rows: i64, kind: Kind) -> bool {
    let Some(first) = layers.first() else {
        return false;
    };
    let lanes = 16 / kind.elt_size_in_bytes().max(1) as i64;
    let (h, d) = (first.qkv_weight.size()[1], shape.head_dim);
    let ffn = first.fc1_weight.size()[0];
    let attention = shape.heads * d;
    let qkv = (shape.heads + 2 * shape.groups) * d;
    let widest = h.max(ffn).max(attention);
    let weight = |t: &Tensor, n: i64, k: i64| {
        t.size() == [n, k]
            && t.kind() == kind
            && t.device().is_cuda()
            && t.is_contiguous()
            && aligned(t)
    };
    let vector = |t: Option<&Tensor>, n: i64| {
        t.is_none_or(|t| t.size() == [n] && t.kind() == kind && t.is_contiguous() && aligned(t))
    };
    let norm = |n: &InputNorm| {
        norm_flags(n) == norm_flags(&first.input_norm)
            && n.eps == first.input_norm.eps
            && vector(Some(n.weight), h)
            && (n.kind == Normalization::RMSNorm || n.bias.is_some())
            && vector(n.bias, h)
    };
    matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
        && matches!(d, 64 | 128)
        && (1..=MAX_ROWS).contains(&rows)
        && shape.groups > 0
        && shape.heads % shape.groups == 0
        && rows * shape.heads <= SYNC_WORDS - 2
        && [h, ffn, attention].iter().all(|w| w % lanes == 0)
        && rows * widest * kind.elt_size_in_bytes() as i64 <= MAX_STAGED_BYTES
        && layers.iter().all(|l| {
            norm(&l.input_norm)
                && norm(&l.mlp_norm)
                && weight(l.qkv_weight, qkv, h)
                && vector(l.qkv_bias, qkv)
                && weight(l.proj_weight, h, attention)
                && vector(l.proj_bias, h)
                && weight(l.fc1_weight, ffn, h)
                && vector(l.fc1_bias, ffn)
                && weight(l.fc2_weight, h, ffn)
                && vector(l.fc2_bias, h)
                && l.pool.kind() == kind
                && l.pool.dim() == 3
                && l.pool.size()[1..] == [shape.groups, 2 * d]
                && l.pool.is_contiguous()
        })
}

/// The hidden states `[rows, hidden]` after `layers` for the decode step `input`
/// (`[rows, hidden]`, one new position per row): each layer's new keys and values are stored at
/// the rows' write slots of its pool, and each row attends to its positions up to its own
/// through its block table. `sync` is [`SYNC_WORDS`] int32 zeros on the device, kept from step
/// to step (the kernel leaves them zero). On a CUDA device; the layers must [`supports`].
pub fn decode_stack(
    input: &Tensor,
    layers: &[StackLayer],
    shape: &StackShape,
    slots: &StepSlots,
    sync: &Tensor,
) -> Result<Tensor> {
    let (rows, hidden) = input.size2()?;
    let kind = input.kind();
    let Device::Cuda(device) = input.device() else {
        bail!("the decode stack kernel runs on CUDA devices");
    };
    ensure!(
        supports(layers, shape, rows, kind),
        "no decode stack kernel for {rows} rows of {kind:?} through these {} layers",
        layers.len()
    );
    let (tables_rows, per_row) = slots.tables.size2()?;
    ensure!(
        tables_rows == rows
            && slots.positions.size() == [rows]
            && slots.write_slots.size() == [rows]
            && [slots.tables, slots.positions, slots.write_slots]
                .iter()
                .all(|t| t.kind() == Kind::Int64 && t.is_contiguous() && t.device() == input.device()),
        "block tables {:?}, positions {:?} and write slots {:?} for {rows} rows",
        slots.tables.size(),
        slots.positions.size(),
        slots.write_slots.size()
    );
    ensure!(
        sync.size() == [SYNC_WORDS] && sync.kind() == Kind::Int && sync.device() == input.device(),
        "the decode stack's sync words are {:?} {:?}",
        sync.kind(),
        sync.size()
    );
    ensure!(
        layers[0].qkv_weight.size()[1] == hidden,
        "hidden states of {hidden} channels for layers of {}",
        layers[0].qkv_weight.size()[1]
    );
    let d = shape.head_dim;
    let ffn = layers[0].fc1_weight.size()[0];
    let options = (kind, input.device());
    let x = input.contiguous();
    let x1 = Tensor::empty([rows, hidden], options);
    let qkv = Tensor::empty([rows, (shape.heads + 2 * shape.groups) * d], options);
    let attn = Tensor::empty([rows, shape.heads * d], options);
    let inter = Tensor::empty([rows, ffn], options);
    let template_rows = match rows {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    };
    let source = match (kind, d) {
        (Kind::BFloat16, 64) => &SOURCES[0],
        (Kind::BFloat16, _) => &SOURCES[1],
        (Kind::Half, 64) => &SOURCES[2],
        (Kind::Half, _) => &SOURCES[3],
        (_, 64) => &SOURCES[4],
        _ => &SOURCES[5],
    };
    let function = format!("decode_stack_{template_rows}");
    let module = kernels(source, device)?;
    let widest = hidden.max(ffn).max(shape.heads * d);
    let shared_bytes = (rows * widest * kind.elt_size_in_bytes() as i64) as u32;
    let grid = module.resident_blocks(&function, THREADS, shared_bytes, 1)?;
    let splits = (grid as i64 / (rows * shape.heads)).clamp(1, MAX_SPLITS);
    let partials = Tensor::empty(
        [rows * shape.heads * splits * (d + 2)],
        (Kind::Float, input.device()),
    );
    let first = &layers[0];
    let mut flags = norm_flags(&first.input_norm);
    flags |= match shape.gelu {
        Gelu::Tanh => GELU_TANH,
        Gelu::Erf => GELU_ERF,
    };
    let mut output = x.shallow_clone();
    for chunk in layers.chunks(MAX_LAYERS) {
        let outputs = [
            Tensor::empty([rows, hidden], options),
            Tensor::empty([rows, hidden], options),
        ];
        let mut args = StackArgs {
            layers: [LayerArgs::default(); MAX_LAYERS],
            input: pointer(Some(&output)),
            outputs: [pointer(Some(&outputs[0])), pointer(Some(&outputs[1]))],
            x1: pointer(Some(&x1)),
            qkv: pointer(Some(&qkv)),
            attn: pointer(Some(&attn)),
            inter: pointer(Some(&inter)),
            partials: pointer(Some(&partials)),
            tables: pointer(Some(slots.tables)),
            positions: pointer(Some(slots.positions)),
            write_slots: pointer(Some(slots.write_slots)),
            sync: pointer(Some(sync)),
            num_layers: chunk.len() as i32,
            rows: rows as i32,
            hidden: hidden as i32,
            ffn: ffn as i32,
            heads: shape.heads as i32,
            groups: shape.groups as i32,
            per_row: per_row as i32,
            splits: splits as i32,
            flags,
            eps: first.input_norm.eps as f32,
            scale: 1.0 / (d as f32).sqrt(),
        };
        for (slot, layer) in args.layers.iter_mut().zip(chunk) {
            *slot = LayerArgs {
                norm1_weight: pointer(Some(layer.input_norm.weight)),
                norm1_bias: pointer(layer.input_norm.bias),
                qkv_weight: pointer(Some(layer.qkv_weight)),
                qkv_bias: pointer(layer.qkv_bias),
                proj_weight: pointer(Some(layer.proj_weight)),
                proj_bias: pointer(layer.proj_bias),
                norm2_weight: pointer(Some(layer.mlp_norm.weight)),
                norm2_bias: pointer(layer.mlp_norm.bias),
                fc1_weight: pointer(Some(layer.fc1_weight)),
                fc1_bias: pointer(layer.fc1_bias),
                fc2_weight: pointer(Some(layer.fc2_weight)),
                fc2_bias: pointer(layer.fc2_bias),
                pool: pointer(Some(layer.pool)),
            };
        }
        let mut params = [&mut args as *mut StackArgs as *mut c_void];
        // SAFETY: the one parameter is a `StackArgs`, laid out as the kernel's `Stack`; every
        // pointer in it is a live tensor on the device of the shape `supports` and the checks
        // above imply (null only for absent biases and norm shifts, which the kernel skips);
        // the grid is at most what stays resident, as its barriers need. Scratch tensors dropped
        // after the launch return to the caching allocator, which reuses them only for work
        // queued after the kernel.
        unsafe {
            module.launch_cooperative(&function, grid, THREADS, shared_bytes, &mut params)?;
        }
        output = outputs[(chunk.len() - 1) % 2].shallow_clone();
    }
    Ok(output)
}

/// What [`decode_stack`] computes, with libtorch's operations (the unfused layers' math):
/// the hidden states after `layers`, each layer's pool updated in place.
pub fn reference_stack(
    input: &Tensor,
    layers: &[StackLayer],
    shape: &StackShape,
    slots: &StepSlots,
) -> Tensor {
    let (rows, d) = (input.size()[0], shape.head_dim);
    let per_group = shape.heads / shape.groups;
    let kind = input.kind();
    let tables = Vec::<Vec<i64>>::try_from(slots.tables.to_device(Device::Cpu)).unwrap_or_default();
    let positions = Vec::<i64>::try_from(slots.positions.to_device(Device::Cpu)).unwrap_or_default();
    let mut x = input.shallow_clone();
    for layer in layers {
        let qkv = reference_linear(
            &x,
            layer.qkv_weight,
            Some(&layer.input_norm),
            &Epilogue {
                bias: layer.qkv_bias,
                ..Epilogue::default()
            },
        )
        .view([rows, shape.groups, per_group + 2, d]);
        let query = qkv.narrow(2, 0, per_group).reshape([rows, shape.heads, d]);
        let kv = qkv.narrow(2, per_group, 2).reshape([rows, shape.groups, 2 * d]);
        let mut pool = layer.pool.shallow_clone();
        let _ = pool.index_copy_(0, slots.write_slots, &kv);
        let contexts: Vec<Tensor> = (0..rows)
            .map(|r| {
                let table = &tables[r as usize];
                let read: Vec<i64> = (0..=positions[r as usize])
                    .map(|p| table[(p / BLOCK_SIZE) as usize] * BLOCK_SIZE + p % BLOCK_SIZE)
                    .collect();
                let read = Tensor::from_slice(&read).to_device(input.device());
                let cached = pool.index_select(0, &read).to_kind(Kind::Float);
                // [positions, groups, d] → one per query head: [heads, positions, d].
                let expand = |t: Tensor| {
                    t.permute([1, 0, 2])
                        .repeat_interleave_self_int(per_group, 0, None)
                };
                let keys = expand(cached.narrow(2, 0, d));
                let values = expand(cached.narrow(2, d, d));
                let q = query.get(r).to_kind(Kind::Float).unsqueeze(1);
                let weights = (q.matmul(&keys.transpose(1, 2)) / (d as f64).sqrt())
                    .softmax(-1, Kind::Float);
                weights.matmul(&values).reshape([1, shape.heads * d])
            })
            .collect();
        let context = Tensor::cat(&contexts, 0).to_kind(kind);
        let x1 = reference_linear(
            &context,
            layer.proj_weight,
            None,
            &Epilogue {
                bias: layer.proj_bias,
                residual: Some(&x),
                ..Epilogue::default()
            },
        );
        let inter = reference_linear(
            &x1,
            layer.fc1_weight,
            Some(&layer.mlp_norm),
            &Epilogue {
                bias: layer.fc1_bias,
                gelu: Some(shape.gelu),
                residual: None,
            },
        );
        x = reference_linear(
            &inter,
            layer.fc2_weight,
            None,
            &Epilogue {
                bias: layer.fc2_bias,
                residual: Some(&x1),
                ..Epilogue::default()
            },
        );
    }
    x
}

/// Made-up layers, cache and step for checking the kernel against [`reference_stack`]: rows
/// of 5, 40 and 17 positions (the last `rows - 3` repeat the first), `heads` query heads on
/// `groups` key/value heads.
pub struct MadeUpStack {
    tensors: Vec<[Tensor; 13]>,
    pub shape: StackShape,
    pub input: Tensor,
    pub tables: Tensor,
    pub positions: Tensor,
    pub write_slots: Tensor,
    pub sync: Tensor,
}

impl MadeUpStack {
    pub fn new(
        device: Device,
        kind: Kind,
        layers: usize,
        rows: i64,
        (hidden, ffn): (i64, i64),
        shape: StackShape,
    ) -> Self {
        let made_up = |shape: &[i64], step: f64, scale: f64, offset: f64| {
            let count: i64 = shape.iter().product();
            ((Tensor::arange(count, (Kind::Float, device)) * step + offset).sin() * scale)
                .to_kind(kind)
                .view(shape)
        };
        let d = shape.head_dim;
        let attention = shape.heads * d;
        let qkv = (shape.heads + 2 * shape.groups) * d;
        let lengths: Vec<i64> = (0..rows).map(|r| [5i64, 40, 17][r as usize % 3]).collect();
        // Row r owns blocks 1 + 3r ..= 3 + 3r (block 0 is padding), listed backwards so that
        // positions do not map to slots in order.
        let tables: Vec<i64> = (0..rows)
            .flat_map(|r| [3 + 3 * r, 2 + 3 * r, 1 + 3 * r])
            .collect();
        let slots = (1 + 3 * rows) * BLOCK_SIZE;
        let write: Vec<i64> = (0..rows)
            .map(|r| {
                let p = lengths[r as usize] - 1;
                tables[(3 * r + p / BLOCK_SIZE) as usize] * BLOCK_SIZE + p % BLOCK_SIZE
            })
            .collect();
        let tensors = (0..layers)
            .map(|l| {
                let o = l as f64;
                let scaled = |k: i64| 1.0 / (k as f64).sqrt();
                [
                    made_up(&[hidden], 0.7, 0.3, o) + 1.0,
                    made_up(&[hidden], 0.3, 0.1, o),
                    made_up(&[qkv, hidden], 0.11, scaled(hidden), o),
                    made_up(&[qkv], 0.9, 0.2, o),
                    made_up(&[hidden, attention], 0.13, scaled(attention), o),
                    made_up(&[hidden], 0.5, 0.2, o),
                    made_up(&[hidden], 0.6, 0.3, o + 1.0) + 1.0,
                    made_up(&[hidden], 0.2, 0.1, o + 1.0),
                    made_up(&[ffn, hidden], 0.17, scaled(hidden), o),
                    made_up(&[ffn], 0.4, 0.2, o),
                    made_up(&[hidden, ffn], 0.19, scaled(ffn), o),
                    made_up(&[hidden], 0.8, 0.2, o),
                    made_up(&[slots, shape.groups, 2 * d], 0.37, 1.0, o),
                ]
            })
            .collect();
        let int64 = |values: &[i64]| Tensor::from_slice(values).to_device(device);
        MadeUpStack {
            tensors,
            shape,
            input: made_up(&[rows, hidden], 0.23, 1.0, 0.0),
            tables: int64(&tables).view([rows, 3]),
            positions: int64(&lengths.iter().map(|l| l - 1).collect::<Vec<_>>()),
            write_slots: int64(&write),
            sync: Tensor::zeros([SYNC_WORDS], (Kind::Int, device)),
        }
    }

    /// The layers, with `norm` norms; their pools are the made-up ones (copy them
    /// with [`MadeUpStack::fresh_pools`] first for a second run).
    pub fn layers(&self, norm: Normalization) -> Vec<StackLayer<'_>> {
        self.tensors
            .iter()
            .map(|t| {
                let input_norm = InputNorm {
                    kind: norm,
                    weight: &t[0],
                    bias: (norm == Normalization::LayerNorm).then_some(&t[1]),
                    eps: 1e-5,
                    one_plus: false,
                };
                let mlp_norm = InputNorm {
                    kind: norm,
                    weight: &t[6],
                    bias: (norm == Normalization::LayerNorm).then_some(&t[7]),
                    eps: 1e-5,
                    one_plus: false,
                };
                StackLayer {
                    input_norm,
                    qkv_weight: &t[2],
                    qkv_bias: Some(&t[3]),
                    proj_weight: &t[4],
                    proj_bias: Some(&t[5]),
                    mlp_norm,
                    fc1_weight: &t[8],
                    fc1_bias: Some(&t[9]),
                    fc2_weight: &t[10],
                    fc2_bias: Some(&t[11]),
                    pool: &t[12],
                }
            })
            .collect()
    }

    /// Copies of every layer's pool as made up (before any step stored into it).
    pub fn fresh_pools(&self) -> Vec<Tensor> {
        self.tensors.iter().map(|t| t[12].copy()).collect()
    }

    pub fn slots(&self) -> StepSlots<'_> {
        StepSlots {
            tables: &self.tables,
            positions: &self.positions,
            write_slots: &self.write_slots,
        }
    }
}

/// Runs the kernel and [`reference_stack`] on the made-up layers and returns the largest excess
/// of the kernel's output over the tolerance ([`excess_difference`], tolerances of
/// [`tolerance`] scaled by `slack`) and whether the pools agree within it (the new keys and
/// values come from QKV projections summed in different orders).
pub fn compare_with_reference(made_up: &MadeUpStack, norm: Normalization, slack: f64) -> Result<(f64, bool)> {
    let kind = made_up.input.kind();
    let pools = made_up.fresh_pools();
    let mut layers = made_up.layers(norm);
    let got = decode_stack(&made_up.input, &layers, &made_up.shape, &made_up.slots(), &made_up.sync)?;
    let kernel_pools: Vec<Tensor> = layers.iter().map(|l| l.pool.copy()).collect();
    for (layer, pool) in layers.iter_mut().zip(&pools) {
        layer.pool = pool;
    }
    let want = reference_stack(&made_up.input, &layers, &made_up.shape, &made_up.slots());
    let (absolute, relative) = tolerance(kind);
    let (absolute, relative) = (absolute * slack, relative * slack);
    let pools_agree = kernel_pools
        .iter()
        .zip(&pools)
        .all(|(got, want)| excess_difference(got, want, absolute, relative) == 0.0);
    Ok((excess_difference(&got, &want, absolute, relative), pools_agree))
}

/// Runs the kernel on CUDA device `device` in `kind` on made-up layers (three rows, grouped
/// heads of 64 channels, a hidden size unlike heads · head dim) and compares it with
/// [`reference_stack`]: a launch or a result that goes wrong is an error here, before any
/// request depends on it. Draws no random numbers.
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    if std::env::var("TMP_NVRTC_DEFINE").is_ok() {
        return Ok(());
    }
    for norm in [Normalization::LayerNorm, Normalization::RMSNorm] {
        let made_up = MadeUpStack::new(
            Device::Cuda(device),
            kind,
            2,
            3,
            (128, 384),
            StackShape {
                heads: 4,
                groups: 2,
                head_dim: 64,
                gelu: Gelu::Tanh,
            },
        );
        let (excess, pools_agree) = compare_with_reference(&made_up, norm, 2.0)?;
        ensure!(
            pools_agree,
            "the decode stack kernel's self-check ({kind:?}, {norm:?}): the pools after the \
             kernel differ from the pools with the reference's new keys and values stored"
        );
        ensure!(
            excess == 0.0,
            "the decode stack kernel's self-check ({kind:?}, {norm:?}) is off by {excess} \
             beyond the tolerance"
        );
    }
    Ok(())
}
