//! The first half of a decode step's transformer layer as one kernel: the input norm, the QKV
//! projection and its bias, the new keys and values stored in the paged KV cache, and the
//! attention of every row's query over its cached positions. On its own the projection is one
//! kernel and the attention another ([`super::decode_gemv`], [`super::paged_attention`]), and
//! the attention of a single row has only one block per head, most of the GPU idle while a
//! few multiprocessors read the row's keys and values.
//!
//! Here each key/value group is a cluster of [`CLUSTER`] blocks (Hopper's thread-block
//! clusters). Block `b` of group `g`'s cluster computes an eighth of the group's QKV channels
//! (its weight slice copied into shared memory before it waits for the previous kernel, as the
//! cached decode linear kernels do) and sends them to the shared memory of every block of the
//! cluster; the keys and values also go to the row's cache slot. After a cluster barrier each
//! block attends over its eighth of each row's positions, and sends its partial softmax sums to
//! the block that merges that (row, head); after a second barrier those blocks merge the
//! eight partials in a fixed order. The group's attention is spread over eight
//! multiprocessors, and the projection and attention of a layer meet at a cluster barrier
//! instead of a kernel boundary.
//!
//! A row's positions are split by its own length alone and the partials merged in a fixed
//! order, so a row's result does not depend on the rows beside it. The projection sums the same
//! products in the same order as the decode linear kernels and rounds where they round; the
//! attention sums in another order than the paged kernel, within its rounding.
//!
//! Compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's current stream,
//! so a decode step using it is captured in CUDA graphs. Hopper or newer.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::decode_gemv::{
    decode_gemv_parts, kernel_input, reference_linear, template_rows, third_of_multiprocessor,
    Epilogue, InputNorm, NormPrologue, ADD_BIAS, STAGE_INPUT,
};
use super::paged_attention::attention_parts;
use super::paged_attention::BLOCK_SIZE;
use super::Normalization;
use super::{aligned, dtype_name, kernel_arg, passes_self_check, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource, Kernels};

// The kernel's BLOCK_SIZE.
const _: () = assert!(BLOCK_SIZE == 16);

/// Blocks per key/value group (the kernel's `CLUSTER`): the portable cluster size.
pub const CLUSTER: i64 = 8;

/// Warps per block (decode_gemv's `WARPS`).
const WARPS: u32 = 8;

/// `MEGATRON_RS_DECODE_FUSED_ATTENTION=0` keeps the projection and the attention apart (to
/// compare).
pub const FUSED_ATTENTION_VARIABLE: &str = "MEGATRON_RS_DECODE_FUSED_ATTENTION";

/// The kernel's CUDA source. Cluster instructions exist from sm_90 on; for older GPUs the
/// source compiles to kernels that are never launched.
pub const SOURCE: KernelSource = KernelSource {
    name: "decode_attention",
    source: concat!(
        cuda_scalars!(),
        dependent_launch!(),
        decode_gemv_parts!(),
        attention_parts!(),
        r#"
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
"#
    ),
    functions: &[
        "decode_attend_bf16_64_1",
        "decode_attend_bf16_64_2",
        "decode_attend_bf16_64_4",
        "decode_attend_bf16_64_8",
        "decode_attend_bf16_128_1",
        "decode_attend_bf16_128_2",
        "decode_attend_bf16_128_4",
        "decode_attend_bf16_128_8",
        "decode_attend_f16_64_1",
        "decode_attend_f16_64_2",
        "decode_attend_f16_64_4",
        "decode_attend_f16_64_8",
        "decode_attend_f16_128_1",
        "decode_attend_f16_128_2",
        "decode_attend_f16_128_4",
        "decode_attend_f16_128_8",
        "decode_attend_f32_64_1",
        "decode_attend_f32_64_2",
        "decode_attend_f32_64_4",
        "decode_attend_f32_64_8",
        "decode_attend_f32_128_1",
        "decode_attend_f32_128_2",
        "decode_attend_f32_128_4",
        "decode_attend_f32_128_8",
    ],
    prefer_shared_memory: true,
};

/// The shapes of one layer's fused decode attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Rows decoded together (1 to [`super::decode_gemv::MAX_ROWS`]).
    pub rows: i64,
    /// The input's channels (the hidden size).
    pub hidden: i64,
    /// Query heads and key/value groups on this rank.
    pub heads: i64,
    pub groups: i64,
    pub head_dim: i64,
}

impl AttentionShape {
    /// Query heads per group, then the key and the value: each group's QKV channels.
    fn group_width(&self) -> i64 {
        (self.heads / self.groups + 2) * self.head_dim
    }

    /// The kernel's template rows (see [`template_rows`]).
    fn template_rows(&self) -> i64 {
        template_rows(self.rows)
    }

    /// Partial sums a block merges at most: `rows · per_group` pairs over the cluster.
    fn slots(&self) -> i64 {
        (self.rows * (self.heads / self.groups) + CLUSTER - 1) / CLUSTER
    }

    /// Dynamic shared memory of a block before the staged keys and values, in bytes, up to
    /// their 16-byte boundary (see the kernel's layout).
    fn fixed_bytes(&self, element: i64) -> i64 {
        let columns = self.group_width() / CLUSTER;
        let weights = columns * self.hidden * element;
        let input = self.template_rows() * self.hidden * element;
        let biases = (columns + 3) / 4 * 4 * 4;
        let qkv = self.template_rows() * self.group_width() * 4;
        let partials = CLUSTER * self.slots() * (self.head_dim + 2) * 4;
        (weights + input + biases + qkv + partials + 15) / 16 * 16
    }

    /// The kernel's static shared memory: norm statistics, the rows' positions, slots and
    /// shares, and the warps' partial sums.
    fn static_bytes(&self) -> i64 {
        2 * self.template_rows() * 4
            + 4 * self.template_rows() * 8
            + i64::from(WARPS) * (2 + self.head_dim) * 4
    }

    /// A block's dynamic shared memory and the positions of each row's share it stages, where
    /// the block fits in a third of a multiprocessor's shared memory, so that blocks of the
    /// kernels before and after it run beside it (see the cached decode linear kernels); the
    /// staged positions take what the third leaves. `None` where even no staged position fits.
    fn layout(&self, module: &Kernels, element: i64) -> Option<(i64, i64)> {
        let share = third_of_multiprocessor(module, self.static_bytes());
        let fixed = self.fixed_bytes(element);
        let position = self.template_rows() * 2 * self.head_dim * element;
        (fixed <= share).then(|| {
            let staged = (share - fixed) / position;
            (fixed + staged * position, staged)
        })
    }
}

/// Whether the kernel serves `shape` in `kind` on `device`: a Hopper or newer GPU, head dim 64
/// or 128, 1 to 8 rows, whole groups, a hidden size of whole 16-byte loads, a block's weight
/// slice and buffers in a third of a multiprocessor's shared memory, not turned off by
/// [`FUSED_ATTENTION_VARIABLE`], and the self-check passed there (once per device, dtype and
/// head dim; a failure is reported once).
pub fn usable(device: Device, kind: Kind, shape: &AttentionShape) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    let lanes = 16 / kind.elt_size_in_bytes().max(1) as i64;
    let applies = matches!(shape.head_dim, 64 | 128)
        && matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
        && (1..=super::decode_gemv::MAX_ROWS).contains(&shape.rows)
        && shape.groups > 0
        && shape.heads % shape.groups == 0
        && shape.hidden % lanes == 0
        && shape.hidden < i64::from(i32::MAX)
        && !turned_off(FUSED_ATTENTION_VARIABLE);
    if !applies {
        return false;
    }
    let Ok(module) = kernels(&SOURCE, index) else {
        return false;
    };
    module.has_clusters()
        && shape
            .layout(module, kind.elt_size_in_bytes() as i64)
            .is_some()
        && passes_self_check(
            "the fused decode attention kernel",
            device,
            kind,
            shape.head_dim,
            "the QKV and attention kernels apart",
            || self_check(index, kind, shape.head_dim),
        )
}

/// A decode step's cache side: where each row's new keys and values go and what it attends
/// to (see `megatron_models::layers::PagedStep`).
pub struct CacheStep<'a> {
    /// `[slots, groups, 2·d]`, keys in the first `d` channels.
    pub pool: &'a mut Tensor,
    /// Block tables `[rows, blocks per row]` int64, `BLOCK_SIZE` slots a block.
    pub tables: &'a Tensor,
    /// Each row's new position `[rows]` int64: it attends to positions `0..=position`.
    pub positions: &'a Tensor,
    /// The pool slot of each row's new position `[rows]` int64.
    pub write_slots: &'a Tensor,
}

/// The attention context `[rows, heads, d]` of a decode step: `input` (`[rows, K]`) normed by
/// `norm`, projected by `weight` (`[groups · (heads/groups + 2) · d, K]`, each group's query
/// heads then its key and value, Megatron's layout) plus `bias`, its keys and values stored at
/// the write slots, each query attending (scaled by `1/√d`) over its row's positions. The
/// caller checks [`usable`] first.
pub fn decode_qkv_attention(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    norm: &InputNorm,
    cache: CacheStep,
    heads: i64,
) -> Result<Tensor> {
    let (rows, k) = input.size2()?;
    let kind = input.kind();
    let Device::Cuda(device) = input.device() else {
        bail!("the fused decode attention kernel runs on CUDA devices");
    };
    let (_, groups, pool_width) = cache.pool.size3()?;
    let d = pool_width / 2;
    let shape = AttentionShape {
        rows,
        hidden: k,
        heads,
        groups,
        head_dim: d,
    };
    let width = shape.group_width();
    ensure!(
        groups > 0 && heads % groups == 0 && matches!(d, 64 | 128) && pool_width == 2 * d,
        "{heads} query heads over a KV pool of {:?}",
        cache.pool.size()
    );
    ensure!(
        weight.size() == [groups * width, k]
            && weight.kind() == kind
            && cache.pool.kind() == kind
            && weight.device() == input.device()
            && cache.pool.device() == input.device()
            && weight.is_contiguous()
            && cache.pool.is_contiguous()
            && aligned(weight),
        "a QKV weight of {:?} {:?} and a pool of {:?} {:?} for an input of {kind:?} {:?}",
        weight.kind(),
        weight.size(),
        cache.pool.kind(),
        cache.pool.size(),
        input.size()
    );
    let (table_rows, per_row) = cache.tables.size2()?;
    ensure!(
        table_rows == rows
            && [cache.tables, cache.positions, cache.write_slots]
                .iter()
                .all(|t| t.kind() == Kind::Int64
                    && t.device() == input.device()
                    && t.is_contiguous())
            && cache.positions.size() == [rows]
            && cache.write_slots.size() == [rows],
        "block tables {:?}, positions {:?} and write slots {:?} for {rows} rows",
        cache.tables.size(),
        cache.positions.size(),
        cache.write_slots.size()
    );
    ensure!(
        (1..=super::decode_gemv::MAX_ROWS).contains(&rows),
        "the fused decode attention kernel takes 1 to {} rows, not {rows}",
        super::decode_gemv::MAX_ROWS
    );
    let x = kernel_input(input, &[rows, k], input, "input")?;
    let NormPrologue {
        gamma,
        beta,
        flags: norm_flags,
    } = norm.prologue(input)?;
    let mut flags = STAGE_INPUT | norm_flags;
    let bias = bias
        .map(|b| kernel_input(b, &[groups * width], input, "QKV bias"))
        .transpose()?;
    if bias.is_some() {
        flags |= ADD_BIAS;
    }
    let out = Tensor::empty([rows, heads, d], (kind, input.device()));
    let module = kernels(&SOURCE, device)?;
    let element = kind.elt_size_in_bytes() as i64;
    let Some((shared_bytes, staged)) = shape
        .layout(module, element)
        .filter(|_| module.has_clusters())
    else {
        bail!("no fused decode attention kernel for {shape:?} in {kind:?} on this GPU");
    };
    let function = format!(
        "decode_attend_{}_{d}_{}",
        dtype_name(kind)?,
        shape.template_rows()
    );
    let pointer = |t: Option<&Tensor>| t.map_or(0u64, |t| t.data_ptr() as u64);
    let [mut x_ptr, mut w_ptr, mut gamma_ptr, mut beta_ptr, mut bias_ptr] = [
        Some(&x),
        Some(weight),
        Some(&gamma),
        beta.as_ref(),
        bias.as_ref(),
    ]
    .map(pointer);
    let [mut pool_ptr, mut tables_ptr, mut positions_ptr, mut slots_ptr, mut out_ptr] = [
        &*cache.pool,
        cache.tables,
        cache.positions,
        cache.write_slots,
        &out,
    ]
    .map(|t| t.data_ptr() as u64);
    let (mut rows_arg, mut k_arg, mut heads_arg, mut groups_arg, mut per_row_arg) = (
        rows as i32,
        k as i32,
        heads as i32,
        groups as i32,
        per_row as i32,
    );
    let (mut flags_arg, mut eps_arg, mut scale_arg) =
        (flags, norm.eps as f32, 1.0f32 / (d as f32).sqrt());
    let (mut columns_arg, mut slots_arg, mut staged_arg) = (
        (width / CLUSTER) as i32,
        shape.slots() as i32,
        staged as i32,
    );
    let mut args = [
        kernel_arg(&mut x_ptr),
        kernel_arg(&mut w_ptr),
        kernel_arg(&mut gamma_ptr),
        kernel_arg(&mut beta_ptr),
        kernel_arg(&mut bias_ptr),
        kernel_arg(&mut pool_ptr),
        kernel_arg(&mut tables_ptr),
        kernel_arg(&mut positions_ptr),
        kernel_arg(&mut slots_ptr),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut k_arg),
        kernel_arg(&mut heads_arg),
        kernel_arg(&mut groups_arg),
        kernel_arg(&mut per_row_arg),
        kernel_arg(&mut flags_arg),
        kernel_arg(&mut eps_arg),
        kernel_arg(&mut scale_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut slots_arg),
        kernel_arg(&mut staged_arg),
    ];
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // counts and flags as i32, eps and the scale as f32); every tensor is on the device,
    // contiguous, of the shapes checked above, the ones read in 16-byte loads aligned with rows
    // of whole loads; null pointers only where the flags say the kernel does not read them;
    // the shared memory holds the kernel's layout (`AttentionShape::layout`); the grid
    // is whole clusters. Copies dropped here return to the caching allocator, which reuses
    // them only for work queued after the kernel. Before it waits for the previous kernel,
    // the kernel reads only the weight, the biases, the norm's weights, the step's positions,
    // slots and block tables, and cached keys and values of earlier positions: nothing a kernel
    // of this step writes (the first kernel of a step, the embedding, is an ordinary launch
    // that waits for all earlier work). It writes only after that wait; the new positions'
    // slots are written but not read.
    unsafe {
        module.launch_overlapping(
            &function,
            ((groups * CLUSTER) as u32, 1, 1),
            (32 * WARPS, 1, 1),
            shared_bytes as u32,
            &mut args,
        )?;
    }
    Ok(out)
}

/// What [`decode_qkv_attention`] computes, with libtorch's operations: the normed projection
/// ([`reference_linear`]), its keys and values stored in `pool`, each row's attention over its
/// positions gathered from the pool, in float32. Returns `[rows, heads, d]` float32.
pub fn reference(
    input: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    norm: &InputNorm,
    cache: CacheStep,
    heads: i64,
) -> Result<Tensor> {
    let (rows, _) = input.size2()?;
    let (_, groups, pool_width) = cache.pool.size3()?;
    let d = pool_width / 2;
    let per_group = heads / groups;
    let qkv = reference_linear(
        input,
        weight,
        Some(norm),
        &Epilogue {
            bias,
            ..Epilogue::default()
        },
    )
    .view([rows, groups, (per_group + 2) * d]);
    let new = qkv.narrow(2, per_group * d, 2 * d);
    let _ = cache.pool.index_copy_(0, cache.write_slots, &new);
    let positions = Vec::<i64>::try_from(cache.positions.to_device(Device::Cpu))?;
    let tables = cache.tables.to_device(Device::Cpu);
    let mut contexts = Vec::new();
    for (row, &position) in positions.iter().enumerate() {
        let row = row as i64;
        let slots: Vec<i64> = (0..=position)
            .map(|p| tables.int64_value(&[row, p / BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
            .collect();
        let slots = Tensor::from_slice(&slots).to_device(input.device());
        // [positions, groups, 2d] → per group [positions, d] keys and values.
        let kv = cache
            .pool
            .index_select(0, &slots)
            .to_kind(Kind::Float)
            .permute([1, 0, 2]);
        let (keys, values) = (kv.narrow(2, 0, d), kv.narrow(2, d, d));
        // [groups, per_group, d]
        let query = qkv
            .get(row)
            .narrow(1, 0, per_group * d)
            .view([groups, per_group, d])
            .to_kind(Kind::Float);
        let weights =
            (query.matmul(&keys.transpose(1, 2)) / (d as f64).sqrt()).softmax(-1, Kind::Float);
        contexts.push(weights.matmul(&values).view([heads, d]));
    }
    Ok(Tensor::stack(&contexts, 0))
}

/// Tolerance of the kernel's context against [`reference`]'s: the attention of values
/// rounded to `kind`.
pub fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Float => 1e-4,
        Kind::Half => 1e-2,
        _ => 5e-2,
    }
}

/// Runs the kernel on CUDA device `device` for head dim `d` in `kind` on a small made-up
/// layer and cache (three rows of 1, 37 and 300 positions, four query heads in two groups,
/// LayerNorm and a bias) and compares it with [`reference`], the pool after it included: a
/// launch or a result that goes wrong is an error here, before any request depends on it.
/// Draws no random numbers.
pub fn self_check(device: usize, kind: Kind, d: i64) -> Result<()> {
    let cuda = Device::Cuda(device);
    let made_up = super::made_up(kind, cuda);
    // Small enough for every dtype's slice to fit beside other kernels.
    let (hidden, heads, groups) = (128, 4, 2);
    let lengths = [1i64, 37, 300];
    let rows = lengths.len() as i64;
    let per_row = 300 / BLOCK_SIZE + 1;
    // Row r owns blocks 1 + r·per_row on (block 0 is padding).
    let table: Vec<i64> = (0..rows * per_row).map(|i| 1 + i).collect();
    let tables = Tensor::from_slice(&table)
        .view([rows, per_row])
        .to_device(cuda);
    let positions = Tensor::from_slice(&lengths.map(|l| l - 1)).to_device(cuda);
    let slots: Vec<i64> = lengths
        .iter()
        .enumerate()
        .map(|(r, &l)| (1 + r as i64 * per_row) * BLOCK_SIZE + l - 1)
        .collect();
    let write_slots = Tensor::from_slice(&slots).to_device(cuda);
    let pool_slots = (1 + rows * per_row) * BLOCK_SIZE;
    let pool = made_up(&[pool_slots, groups, 2 * d], 0.37, 1.0);
    let input = made_up(&[rows, hidden], 0.29, 2.0);
    let width = (heads / groups + 2) * d;
    let weight = made_up(
        &[groups * width, hidden],
        0.11,
        1.0 / (hidden as f64).sqrt(),
    );
    let bias = made_up(&[groups * width], 0.9, 0.2);
    let gamma = made_up(&[hidden], 0.7, 0.5) + 1.0;
    let beta = made_up(&[hidden], 0.3, 0.1);
    let norm = InputNorm {
        kind: Normalization::LayerNorm,
        weight: &gamma,
        bias: Some(&beta),
        eps: 1e-5,
        one_plus: false,
    };
    let (mut kernel_pool, mut reference_pool) = (pool.copy(), pool.copy());
    let got = decode_qkv_attention(
        &input,
        &weight,
        Some(&bias),
        &norm,
        CacheStep {
            pool: &mut kernel_pool,
            tables: &tables,
            positions: &positions,
            write_slots: &write_slots,
        },
        heads,
    )?;
    let want = reference(
        &input,
        &weight,
        Some(&bias),
        &norm,
        CacheStep {
            pool: &mut reference_pool,
            tables: &tables,
            positions: &positions,
            write_slots: &write_slots,
        },
        heads,
    )?;
    let (absolute, relative) = super::decode_gemv::tolerance(kind);
    let stored =
        super::decode_gemv::excess_difference(&kernel_pool, &reference_pool, absolute, relative);
    ensure!(
        stored == 0.0,
        "the fused decode attention kernel's self-check ({kind:?}, head dim {d}): the keys \
         and values it stored are off by {stored} beyond the tolerance"
    );
    let difference = (got.to_kind(Kind::Float) - want)
        .abs()
        .max()
        .double_value(&[]);
    ensure!(
        difference <= tolerance(kind),
        "the fused decode attention kernel's self-check ({kind:?}, head dim {d}) is off by \
         {difference}"
    );
    Ok(())
}
