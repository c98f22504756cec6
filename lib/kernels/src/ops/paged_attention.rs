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

/// The kernels' CUDA source (`lib/kernels/cuda/paged_attention.cu`), launched with [`WARPS`]
/// warps per (head, row).
pub const SOURCE: KernelSource = KernelSource {
    name: "paged_attention",
    source: include_str!("../../cuda/paged_attention.cu"),
    headers: super::HEADERS,
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
    let inputs = super::self_check_inputs(kind, cuda);
    let (heads, lengths) = (2, [5i64, 40]);
    // Row 0 owns blocks 1..=3, row 1 blocks 4..=6 (block 0 is padding).
    let pool = inputs(&[7 * BLOCK_SIZE, 1, 2 * d], 0.37, 1.0);
    let query = inputs(&[2, heads, d], 0.11, 1.0);
    let tables = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6])
        .view([2, 3])
        .to_device(cuda);
    let positions = Tensor::from_slice(&[lengths[0] - 1, lengths[1] - 1]).to_device(cuda);
    // The new positions' keys and values as a strided view, and their slots: position 4 in
    // block 1, position 39 in block 6.
    let new_kv = inputs(&[2, 2, 2 * d], 0.53, 1.0).narrow(1, 1, 1);
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
