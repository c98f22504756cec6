//! Decode attention over a paged KV cache, reading each row's blocks where they lie: one query
//! position per row (a decode step), grouped-query heads, head dimensions 64 and 128, bf16,
//! fp16 or fp32, softmax computed online over the row's positions. It replaces gathering every
//! row's window of slots into a new tensor per layer (and the `[b, 1, 1, window]` mask) before
//! libtorch's attention: the keys and values are read once instead of three times.
//!
//! The kernel is compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's
//! current stream, so a decode step that uses it can be captured in a CUDA graph.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{dtype_name, kernel_arg};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Cache positions are handed out in blocks of this many slots.
pub const BLOCK_SIZE: i64 = 16;

// The kernel's BLOCK_SIZE.
const _: () = assert!(BLOCK_SIZE == 16);

/// Warps per (row, head), at most the kernel's `MAX_WARPS`: they take turns over the row's
/// positions, eight at a time, then merge their partial softmax sums. Many, so that a single
/// row (batch-1 decoding) still has many loads in flight.
const WARPS: u32 = 16;

/// CUDA C++ of the paged decode kernel that the fused decode attention kernel
/// ([`super::decode_attention`]) shares: a warp's round of online softmax over a few
/// positions, and the merge of partial softmax sums. Needs `cuda_scalars!()` before it.
macro_rules! attention_parts {
    () => {
        r#"
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
"#
    };
}
pub(crate) use attention_parts;

/// The kernels' CUDA source: one block of [`WARPS`] warps per (head, row); a warp's lanes hold
/// `D / 32` consecutive channels of the query and of the running output, and a warp scores eight
/// positions at once so that their loads are in flight together.
pub const SOURCE: KernelSource = KernelSource {
    name: "paged_attention",
    source: concat!(
        cuda_scalars!(),
        dependent_launch!(),
        attention_parts!(),
        r#"
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
"#
    ),
    functions: &[
        "paged_decode_bf16_64",
        "paged_decode_bf16_128",
        "paged_decode_f16_64",
        "paged_decode_f16_128",
        "paged_decode_f32_64",
        "paged_decode_f32_128",
    ],
    prefer_shared_memory: true,
};

/// The keys and values of a decode step's new positions, for [`paged_decode_attention`] to
/// attend to and store.
pub struct NewKeysValues<'a> {
    /// `[b, groups, 2·d]`, keys in the first `d` channels; channels contiguous, rows and groups
    /// at any strides (a view of the QKV projection).
    pub kv: &'a Tensor,
    /// The pool slot of each row's new position, `[b]` int64.
    pub write_slots: &'a Tensor,
}

/// Whether [`paged_decode_attention`] handles these shapes and dtype.
pub fn supports(head_dim: i64, kind: Kind) -> bool {
    matches!(head_dim, 64 | 128) && matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
}

/// Attention of one query position per row: `query` `[b, heads, d]`, over the positions
/// `0..=positions[r]` of row `r`, whose slots are listed by its block table (`tables`
/// `[b, per_row]` int64, `BLOCK_SIZE` slots a block) in `pool` (`[slots, groups, 2·d]`, keys in
/// the first `d` channels); each of the `groups` key/value heads serves `heads / groups` query
/// heads. Returns `[b, heads, d]`, scaled by `1/√d` as libtorch's attention. On a CUDA device.
///
/// With `new`, the keys and values of each row's position `positions[r]` are taken from there
/// and stored in `pool` by the same kernel (instead of stored first by a kernel of their own).
pub fn paged_decode_attention(
    query: &Tensor,
    pool: &mut Tensor,
    tables: &Tensor,
    positions: &Tensor,
    new: Option<&NewKeysValues>,
) -> Result<Tensor> {
    let (rows, heads, d) = query.size3()?;
    let (_, groups, width) = pool.size3()?;
    let (table_rows, per_row) = tables.size2()?;
    let kind = query.kind();
    let Device::Cuda(device) = query.device() else {
        anyhow::bail!("the paged decode attention kernel runs on CUDA devices");
    };
    ensure!(
        supports(d, kind),
        "no paged decode kernel for head dim {d} in {kind:?}"
    );
    ensure!(
        pool.kind() == kind && width == 2 * d && groups > 0 && heads % groups == 0,
        "a KV pool of {:?} {:?} for queries of {kind:?} {:?}",
        pool.kind(),
        pool.size(),
        query.size()
    );
    ensure!(
        table_rows == rows
            && positions.size() == [rows]
            && tables.kind() == Kind::Int64
            && positions.kind() == Kind::Int64,
        "block tables {:?} and positions {:?} for {rows} rows",
        tables.size(),
        positions.size()
    );
    ensure!(
        [&*pool, tables, positions]
            .iter()
            .all(|t| t.device() == query.device() && t.is_contiguous()),
        "the KV pool, block tables and positions must be contiguous on the query's device"
    );
    let new = match new {
        None => None,
        Some(new) => {
            ensure!(
                new.kv.size() == [rows, groups, 2 * d]
                    && new.kv.kind() == kind
                    && new.kv.device() == query.device(),
                "new keys and values of {:?} {:?} for a pool of {:?} and {rows} rows",
                new.kv.kind(),
                new.kv.size(),
                pool.size()
            );
            ensure!(
                new.write_slots.size() == [rows]
                    && new.write_slots.kind() == Kind::Int64
                    && new.write_slots.device() == query.device()
                    && new.write_slots.is_contiguous(),
                "write slots {:?} of {:?} for {rows} rows",
                new.write_slots.size(),
                new.write_slots.kind()
            );
            // Rows and groups may be strided (a view of the QKV projection), channels not.
            let kv = if new.kv.stride()[2] == 1 {
                new.kv.shallow_clone()
            } else {
                new.kv.contiguous()
            };
            Some((kv, new.write_slots))
        }
    };
    // Rows and heads may be strided (the query is a view of the QKV projection), channels not.
    let query = if query.stride()[2] == 1 {
        query.shallow_clone()
    } else {
        query.contiguous()
    };
    let out = Tensor::empty([rows, heads, d], (kind, query.device()));
    if rows == 0 {
        return Ok(out);
    }
    let function = format!("paged_decode_{}_{d}", dtype_name(kind)?);
    let module = kernels(&SOURCE, device)?;
    let [mut q, mut pool, mut tables, mut positions, mut out_ptr] =
        [&query, &*pool, tables, positions, &out].map(|t| t.data_ptr() as u64);
    let (mut fresh, mut fresh_row_stride, mut fresh_group_stride, mut write_slots) = match &new {
        Some((kv, slots)) => (
            kv.data_ptr() as u64,
            kv.stride()[0],
            kv.stride()[1],
            slots.data_ptr() as u64,
        ),
        None => (0u64, 0i64, 0i64, 0u64),
    };
    let (mut row_stride, mut head_stride) = (query.stride()[0], query.stride()[1]);
    let (mut heads_arg, mut groups_arg, mut per_row_arg) =
        (heads as i32, groups as i32, per_row as i32);
    let mut scale = 1.0f32 / (d as f32).sqrt();
    let mut args = [
        kernel_arg(&mut q),
        kernel_arg(&mut row_stride),
        kernel_arg(&mut head_stride),
        kernel_arg(&mut pool),
        kernel_arg(&mut tables),
        kernel_arg(&mut positions),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut heads_arg),
        kernel_arg(&mut groups_arg),
        kernel_arg(&mut per_row_arg),
        kernel_arg(&mut scale),
        kernel_arg(&mut fresh),
        kernel_arg(&mut fresh_row_stride),
        kernel_arg(&mut fresh_group_stride),
        kernel_arg(&mut write_slots),
    ];
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // strides as i64, counts as i32, the scale as f32); the tensors are on the device, of the
    // shapes and layouts checked above (the new keys and values and write slots null together);
    // memory the caching allocator gets back (a copied query dropped here) is only reused by
    // work queued on the stream after the kernel, which waits for this one before it writes.
    unsafe {
        module.launch_overlapping(
            &function,
            (heads as u32, rows as u32, 1),
            (32 * WARPS, 1, 1),
            0,
            &mut args,
        )?;
    }
    Ok(out)
}

/// Runs the kernel on CUDA device `device` for head dim `d` in `kind` on a small made-up cache
/// (two rows of 5 and 40 positions, two query heads on one key/value head), reading the new
/// positions from the pool and taking and storing them itself, and compares it with the same
/// attention computed from plain tensor operations: a launch or a result that goes wrong is an
/// error here, before any request depends on it.
pub fn self_check(device: usize, kind: Kind, d: i64) -> Result<()> {
    let cuda = Device::Cuda(device);
    let made_up = super::made_up(kind, cuda);
    let (heads, lengths) = (2, [5i64, 40]);
    // Row 0 owns blocks 1..=3, row 1 blocks 4..=6 (block 0 is padding).
    let pool = made_up(&[7 * BLOCK_SIZE, 1, 2 * d], 0.37, 1.0);
    let query = made_up(&[2, heads, d], 0.11, 1.0);
    let tables = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6])
        .view([2, 3])
        .to_device(cuda);
    let positions = Tensor::from_slice(&[lengths[0] - 1, lengths[1] - 1]).to_device(cuda);
    // The new positions' keys and values as a strided view, and their slots: position 4 in
    // block 1, position 39 in block 6.
    let new_kv = made_up(&[2, 2, 2 * d], 0.53, 1.0).narrow(1, 1, 1);
    let write_slots = Tensor::from_slice(&[BLOCK_SIZE + 4, 6 * BLOCK_SIZE + 7]).to_device(cuda);
    let mut stored = pool.copy();
    let _ = stored.index_copy_(0, &write_slots, &new_kv);
    let tolerance = match kind {
        Kind::Float => 1e-4,
        Kind::Half => 1e-2,
        _ => 5e-2,
    };
    for storing in [false, true] {
        let new = NewKeysValues {
            kv: &new_kv,
            write_slots: &write_slots,
        };
        let mut kernel_pool = pool.copy();
        let got = paged_decode_attention(
            &query,
            &mut kernel_pool,
            &tables,
            &positions,
            storing.then_some(&new),
        )?
        .to_kind(Kind::Float);
        let expected_pool = if storing { &stored } else { &pool };
        ensure!(
            kernel_pool.equal(expected_pool),
            "the paged decode kernel's self-check ({kind:?}, head dim {d}): the pool after the \
             kernel is not the pool with the new keys and values stored"
        );
        for (row, length) in lengths.into_iter().enumerate() {
            let slots = expected_pool
                .narrow(0, (1 + 3 * row as i64) * BLOCK_SIZE, length)
                .select(1, 0)
                .to_kind(Kind::Float);
            let (keys, values) = (slots.narrow(1, 0, d), slots.narrow(1, d, d));
            let q = query.get(row as i64).to_kind(Kind::Float);
            let weights = (q.matmul(&keys.tr()) / (d as f64).sqrt()).softmax(-1, Kind::Float);
            let want = weights.matmul(&values);
            let difference = (got.get(row as i64) - want).abs().max().double_value(&[]);
            ensure!(
                difference <= tolerance,
                "the paged decode kernel's self-check ({kind:?}, head dim {d}, new keys and \
                 values {}) is off by {difference} on row {row}",
                if storing {
                    "stored by it"
                } else {
                    "in the pool"
                }
            );
        }
    }
    Ok(())
}
