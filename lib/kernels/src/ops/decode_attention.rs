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
    kernel_input, reference_linear, template_rows, third_of_multiprocessor, Epilogue, InputNorm,
    NormPrologue, ADD_BIAS, STAGE_INPUT,
};
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

/// The kernel's CUDA source (`lib/kernels/cuda/decode_attention.cu`). Cluster instructions
/// exist from sm_90 on; for older GPUs the source compiles to kernels that are never launched.
pub const SOURCE: KernelSource = KernelSource {
    name: "decode_attention",
    source: include_str!("../../cuda/decode_attention.cu"),
    headers: super::HEADERS,
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
    let inputs = super::self_check_inputs(kind, cuda);
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
    let pool = inputs(&[pool_slots, groups, 2 * d], 0.37, 1.0);
    let input = inputs(&[rows, hidden], 0.29, 2.0);
    let width = (heads / groups + 2) * d;
    let weight = inputs(
        &[groups * width, hidden],
        0.11,
        1.0 / (hidden as f64).sqrt(),
    );
    let bias = inputs(&[groups * width], 0.9, 0.2);
    let gamma = inputs(&[hidden], 0.7, 0.5) + 1.0;
    let beta = inputs(&[hidden], 0.3, 0.1);
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
