//! Bias gradients summed by one NVRTC kernel into the optimizer's float32 buffer:
//! - the backward of fc1's bias + tanh-GeLU (`megatron_models::layers::linear_gelu`) in one
//!   pass: the GeLU gradient `g · gelu'(x)` written in the activations' dtype, and at once its
//!   column sums, fc1's bias gradient. libtorch takes a GeLU backward kernel and then a GEMV that
//!   reads the whole gradient again (1.6 + 0.7 ms of a GPT-345M step on an H100);
//! - the bias gradient of a narrow linear ([`add_bias_grad`], up to [`NARROW_BIAS_COLUMNS`]
//!   columns: the attention projection's and fc2's), where libtorch's GEMV reaches under half
//!   the memory bandwidth (23.5 µs against 12.0 for `[8192, 2048]` bf16 on an H100; from 3,072
//!   columns on the two are even and the GEMV is ahead by 7–10% at 4,096 and 8,192);
//! - the backward of self-attention's QKV projection ([`pack_qkv_grad`], for
//!   `megatron_models::layers::qkv_projection`): the query, key and value gradients attention's
//!   backward returns are gathered into the projection's packed output layout and summed into
//!   its bias gradient in the same pass, where libtorch concatenates them and a GEMV reads the
//!   result again.
//!
//! Each block takes 256 columns (8 per thread, 16-byte accesses) of a run of rows and writes
//! one float32 partial row of its column sums; `column_totals_into_main` adds the partial rows
//! in block order, so the same inputs give the same bits. The derivative is ATen's tanh-GeLU
//! backward in float32.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{
    aligned, ceil_div, contiguous_aligned, dtype_name, kernel_arg, passes_self_check,
    relative_error, turned_off, COLUMN_TOTAL_GROUPS,
};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Set to `0`, the environment variable that keeps the bias gradients on libtorch's GEMV (and
/// fc1's GeLU gradient on libtorch's kernel); Megatron has no flag for this.
pub const VARIABLE: &str = "MEGATRON_RS_FUSED_BIAS_GRAD";

/// The widest linear whose bias gradient [`add_bias_grad`] sums ([`sums_bias_of`]; see the
/// module's figures).
const NARROW_BIAS_COLUMNS: i64 = 2048;

/// Elements per thread (one 16-byte access of bf16/fp16).
const VEC: i64 = 8;
/// Threads across the columns and down the rows of a block.
const COLUMN_THREADS: i64 = 32;
const ROW_THREADS: i64 = 8;
/// Rows a block covers at least; more when that keeps the partial rows under [`MAX_PARTIALS`].
const MIN_ROWS_PER_BLOCK: i64 = 64;
const MAX_PARTIALS: i64 = 64;

/// The kernels' CUDA source (`lib/kernels/cuda/bias_grad.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "bias_grad",
    source: include_str!("../../cuda/bias_grad.cu"),
    headers: super::HEADERS,
    functions: &[
        "gelu_bias_grad_bf16",
        "gelu_bias_grad_f16",
        "bias_grad_bf16",
        "bias_grad_f16",
        "qkv_grad_pack_bf16",
        "qkv_grad_pack_f16",
        "column_totals_into_main",
    ],
    prefer_shared_memory: false,
};

/// Whether the kernel takes `[rows, columns]` gradients of `kind`.
pub fn supports(kind: Kind, columns: i64) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half) && columns > 0 && columns % VEC == 0
}

/// The gradient of `gelu_tanh(preactivation)` given `grad` (both `[rows, columns]`, bf16 or
/// fp16, on one CUDA device; `columns` a multiple of 8), with its column sums added to
/// `bias_main_grad` (float32 `[columns]`).
pub fn gelu_backward_with_bias_grad(
    grad: &Tensor,
    preactivation: &Tensor,
    bias_main_grad: &Tensor,
) -> Result<Tensor> {
    let (rows, columns) = grad.size2()?;
    ensure!(
        preactivation.size() == [rows, columns]
            && preactivation.kind() == grad.kind()
            && preactivation.device() == grad.device(),
        "GeLU's argument is {:?} {:?}; expected {:?} [{rows}, {columns}]",
        preactivation.kind(),
        preactivation.size(),
        grad.kind()
    );
    let grad_input = column_sums_into(grad, Some(preactivation), bias_main_grad)?;
    Ok(grad_input.expect("the GeLU kernel writes the GeLU gradient"))
}

/// Adds the column sums of `grad` (`[rows, columns]`, bf16 or fp16, on one CUDA device;
/// `columns` a multiple of 8) to `bias_main_grad` (float32 `[columns]`): the bias gradient of a
/// linear, which libtorch computes as a GEMV at under half the memory bandwidth.
pub fn add_bias_grad(grad: &Tensor, bias_main_grad: &Tensor) -> Result<()> {
    column_sums_into(grad, None, bias_main_grad).map(|_| ())
}

/// The kernel and the column totals: with `preactivation`, the GeLU gradient (returned) and its
/// column sums; without, the column sums of `grad`.
fn column_sums_into(
    grad: &Tensor,
    preactivation: Option<&Tensor>,
    bias_main_grad: &Tensor,
) -> Result<Option<Tensor>> {
    let (kind, device) = (grad.kind(), grad.device());
    let Device::Cuda(index) = device else {
        bail!("the fused bias gradient runs on CUDA devices, not {device:?}");
    };
    let (rows, columns) = grad.size2()?;
    ensure!(
        supports(kind, columns),
        "no fused bias gradient kernel for {kind:?} rows of {columns}"
    );
    check_main_grad(bias_main_grad, columns, device)?;
    ensure!(
        columns <= i32::MAX as i64,
        "{columns} columns are more than the kernel takes"
    );
    let grad = contiguous_aligned(grad);
    let preactivation = preactivation.map(contiguous_aligned);
    let grad_input = preactivation
        .as_ref()
        .map(|_| Tensor::empty([rows, columns], (kind, device)));
    if rows == 0 {
        return Ok(grad_input);
    }
    let blocks = RowBlocks::of(rows);
    let module = kernels(&SOURCE, index)?;
    let pointer = |t: Option<&Tensor>| t.map_or(0, |t| t.data_ptr() as u64);
    let (mut grad_ptr, mut pre_ptr, mut input_ptr) = (
        pointer(Some(&grad)),
        pointer(preactivation.as_ref()),
        pointer(grad_input.as_ref()),
    );
    let partial = blocks.partial(columns, device);
    let mut partial_ptr = partial.data_ptr() as u64;
    let (mut rows_arg, mut columns_arg) = (rows, columns as i32);
    let mut rows_per_block_arg = i32::try_from(blocks.rows_per_block)?;
    let mut args = [
        kernel_arg(&mut grad_ptr),
        kernel_arg(&mut pre_ptr),
        kernel_arg(&mut input_ptr),
        kernel_arg(&mut partial_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut rows_per_block_arg),
    ];
    let kernel = match preactivation {
        Some(_) => format!("gelu_bias_grad_{}", dtype_name(kind)?),
        None => format!("bias_grad_{}", dtype_name(kind)?),
    };
    // SAFETY: the arguments match the kernels' parameters in order and type (pointers as u64,
    // rows as i64, columns and rows per block as i32); the gradients and GeLU's argument are
    // contiguous, 16-byte aligned [rows, columns] of the kernel's dtype with columns a multiple
    // of 8 (every row starts aligned), and null exactly for the kernel that does not touch them;
    // the partial rows and main gradient are as `launch_then_add_totals` asks. All live on this
    // device until the kernels have run: memory returned to the caching allocator is reused only
    // by work queued after them on this stream.
    unsafe {
        blocks.launch_then_add_totals(
            module,
            &kernel,
            columns,
            &mut args,
            &partial,
            bias_main_grad,
        )?;
    }
    Ok(grad_input)
}

/// That `bias_main_grad` is what the column totals add into: contiguous float32 `[columns]` on
/// `device`.
fn check_main_grad(bias_main_grad: &Tensor, columns: i64, device: Device) -> Result<()> {
    ensure!(
        bias_main_grad.size() == [columns]
            && bias_main_grad.kind() == Kind::Float
            && bias_main_grad.is_contiguous()
            && bias_main_grad.device() == device,
        "the bias's main gradient is {:?} {:?} on {:?}; expected float32 [{columns}] on {device:?}",
        bias_main_grad.kind(),
        bias_main_grad.size(),
        bias_main_grad.device()
    );
    Ok(())
}

/// How the kernels split `rows` into blocks of rows: each block writes one float32 partial row
/// of column sums.
struct RowBlocks {
    rows_per_block: i64,
    count: i64,
}

impl RowBlocks {
    fn of(rows: i64) -> Self {
        let rows_per_block = ceil_div(rows, MAX_PARTIALS).max(MIN_ROWS_PER_BLOCK);
        RowBlocks {
            rows_per_block,
            count: ceil_div(rows, rows_per_block),
        }
    }

    fn partial(&self, columns: i64, device: Device) -> Tensor {
        Tensor::empty([self.count, columns], (Kind::Float, device))
    }

    /// Launches `kernel` over `columns` × these row blocks with `args`, then
    /// `column_totals_into_main`, which adds the partial rows into `bias_main_grad`.
    ///
    /// # Safety
    /// `args` must match `kernel`'s parameters and point at memory the kernel may access for the
    /// grid; `partial` is float32 `[self.count, columns]` and `bias_main_grad` float32
    /// `[columns]`, both contiguous on the module's device and alive until the kernels have run.
    unsafe fn launch_then_add_totals(
        &self,
        module: &crate::runtime::nvrtc::Kernels,
        kernel: &str,
        columns: i64,
        args: &mut [*mut std::ffi::c_void],
        partial: &Tensor,
        bias_main_grad: &Tensor,
    ) -> Result<()> {
        let column_blocks = ceil_div(columns, COLUMN_THREADS * VEC);
        let (mut partial_a, mut partial_b) = (partial.data_ptr() as u64, 0u64);
        let (mut main_a, mut main_b) = (bias_main_grad.data_ptr() as u64, 0u64);
        let (mut blocks_arg, mut columns_arg) = (self.count, i32::try_from(columns)?);
        let mut total_args = [
            kernel_arg(&mut partial_a),
            kernel_arg(&mut partial_b),
            kernel_arg(&mut blocks_arg),
            kernel_arg(&mut columns_arg),
            kernel_arg(&mut main_a),
            kernel_arg(&mut main_b),
        ];
        // SAFETY: the caller vouches for `args`; the totals read the float32 partial rows
        // [count, columns] and add into the float32 [columns] main gradient, the second partials
        // and output are null and only grid row 0 runs.
        unsafe {
            module.launch(
                kernel,
                (column_blocks as u32, self.count as u32, 1),
                (COLUMN_THREADS as u32, ROW_THREADS as u32, 1),
                args,
            )?;
            module.launch(
                "column_totals_into_main",
                (ceil_div(columns, 32) as u32, 1, 1),
                (32, COLUMN_TOTAL_GROUPS, 1),
                &mut total_args,
            )?;
        }
        Ok(())
    }
}

/// One part of the QKV projection's output gradient for [`pack_qkv_grad`]: `[s, b, groups,
/// width]` with a unit last stride, a 16-byte aligned start and the other strides multiples of
/// 8 elements (itself), or a contiguous aligned copy.
fn kernel_readable_part(part: &Tensor) -> Tensor {
    let strides = part.stride();
    let readable = strides[3] == 1 && strides[..3].iter().all(|s| s % VEC == 0) && aligned(part);
    if readable {
        part.shallow_clone()
    } else {
        contiguous_aligned(part)
    }
}

/// The QKV projection's output gradient, packed as its output is laid out (`[s·b, groups ·
/// (query_width + 2·head_dim)]`: per group its queries, its key, its value), from the parts'
/// gradients `query` (`[s, b, groups, query_width]`), `key` and `value` (`[s, b, groups,
/// head_dim]`) in any strides, with its column sums, the projection's bias gradient, added to
/// `bias_main_grad` (float32) in the same pass. Replaces a concatenation and a GEMV that reads
/// its result again. bf16 or fp16 on one CUDA device; widths multiples of 8.
pub fn pack_qkv_grad(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    bias_main_grad: &Tensor,
) -> Result<Tensor> {
    let (kind, device) = (query.kind(), query.device());
    let Device::Cuda(index) = device else {
        bail!("the packed QKV gradient runs on CUDA devices, not {device:?}");
    };
    let (s, b, groups, query_width) = query.size4()?;
    let (_, _, _, head_dim) = key.size4()?;
    for (name, part, width) in [("key", key, head_dim), ("value", value, head_dim)] {
        ensure!(
            part.size() == [s, b, groups, width] && part.kind() == kind && part.device() == device,
            "the {name} gradient is {:?} {:?}; expected {kind:?} [{s}, {b}, {groups}, {width}]",
            part.kind(),
            part.size()
        );
    }
    let columns = groups * (query_width + 2 * head_dim);
    let rows = s * b;
    ensure!(
        supports(kind, query_width) && supports(kind, head_dim),
        "no packed QKV gradient kernel for {kind:?} parts {query_width} and {head_dim} wide"
    );
    ensure!(
        rows <= u32::MAX as i64 && columns <= i32::MAX as i64,
        "[{rows}, {columns}] is more than the packed QKV gradient kernel takes"
    );
    check_main_grad(bias_main_grad, columns, device)?;
    let packed = Tensor::empty([rows, columns], (kind, device));
    if rows == 0 {
        return Ok(packed);
    }
    let parts = [query, key, value].map(kernel_readable_part);
    let blocks = RowBlocks::of(rows);
    let partial = blocks.partial(columns, device);
    let module = kernels(&SOURCE, index)?;
    let [mut query_ptr, mut key_ptr, mut value_ptr] = parts.each_ref().map(|p| p.data_ptr() as u64);
    let mut strides = parts.each_ref().map(|p| {
        let st = p.stride();
        [st[0], st[1], st[2]]
    });
    let [[qs, qb, qg], [ks, kb, kg], [vs, vb, vg]] = &mut strides;
    let (mut batch_arg, mut query_width_arg, mut head_dim_arg) =
        (b as u32, query_width as i32, head_dim as i32);
    let (mut packed_ptr, mut partial_ptr) = (packed.data_ptr() as u64, partial.data_ptr() as u64);
    let (mut rows_arg, mut columns_arg) = (rows, columns as i32);
    let mut rows_per_block_arg = i32::try_from(blocks.rows_per_block)?;
    let mut args = [
        kernel_arg(&mut query_ptr),
        kernel_arg(&mut key_ptr),
        kernel_arg(&mut value_ptr),
        kernel_arg(qs),
        kernel_arg(qb),
        kernel_arg(qg),
        kernel_arg(ks),
        kernel_arg(kb),
        kernel_arg(kg),
        kernel_arg(vs),
        kernel_arg(vb),
        kernel_arg(vg),
        kernel_arg(&mut batch_arg),
        kernel_arg(&mut query_width_arg),
        kernel_arg(&mut head_dim_arg),
        kernel_arg(&mut packed_ptr),
        kernel_arg(&mut partial_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut rows_per_block_arg),
    ];
    let kernel = format!("qkv_grad_pack_{}", dtype_name(kind)?);
    // SAFETY: the arguments match `qkv_grad_pack`'s parameters in order and type (pointers as
    // u64, strides and rows as i64, the batch as u32, widths, columns and rows per block as
    // i32); each part is [s, b, groups, width] of the kernel's dtype on this device with a unit
    // last stride, the others multiples of 8 and a 16-byte aligned start
    // (`kernel_readable_part`), its width a multiple of 8, so every 8-column load stays in one
    // part and row; `packed` is contiguous [rows, columns] and rows fit in 32 bits; the partial
    // rows and main gradient are as `launch_then_add_totals` asks. All live on this device until
    // the kernels have run (the caching allocator reuses freed memory only for later work on
    // this stream).
    unsafe {
        blocks.launch_then_add_totals(
            module,
            &kernel,
            columns,
            &mut args,
            &partial,
            bias_main_grad,
        )?;
    }
    Ok(packed)
}

/// Whether [`add_bias_grad`] should sum the bias gradient of a linear with `columns` outputs:
/// a narrow one ([`NARROW_BIAS_COLUMNS`]; libtorch's GEMV is as fast from 3,072 on) where
/// [`usable_on`] holds.
pub fn sums_bias_of(device: Device, kind: Kind, columns: i64) -> bool {
    columns <= NARROW_BIAS_COLUMNS && usable_on(device, kind, columns)
}

/// Whether the kernels should run for `kind` gradients of `columns` on `device`: a CUDA device,
/// [`supports`], [`VARIABLE`] not `0`, and [`self_check`] passed there (once per device and
/// dtype; a failure is reported once and libtorch's ops are used).
pub fn usable_on(device: Device, kind: Kind, columns: i64) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    supports(kind, columns)
        && !turned_off(VARIABLE)
        && passes_self_check(
            "the fused bias gradients",
            device,
            kind,
            0,
            "libtorch's GeLU backward and GEMVs",
            || self_check(index, kind),
        )
}

/// What libtorch's ops give: the GeLU gradient in the activations' dtype and its column sums in
/// float32 (the reference of the self-check and the tests).
pub fn reference(grad: &Tensor, preactivation: &Tensor) -> (Tensor, Tensor) {
    let grad_input = preactivation.gelu_backward(grad, "tanh");
    let sums =
        grad_input
            .to_kind(Kind::Float)
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    (grad_input, sums)
}

/// Runs the kernels on CUDA device `device` on made-up `[300, 1032]` gradients of `kind` and
/// [`made_up_qkv_grad`], and compares the GeLU gradient, the packed QKV gradient and the bias
/// gradients with [`reference`], the concatenation and column sums.
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let (rows, columns) = (300, 1032);
    let inputs = super::self_check_inputs(kind, cuda);
    let (grad, preactivation) = (
        inputs(&[rows, columns], 0.37, 1.0),
        inputs(&[rows, columns], 0.11, 3.0),
    );
    let (want_input, want_sums) = reference(&grad, &preactivation);
    let main = Tensor::zeros([columns], (Kind::Float, cuda));
    let got = gelu_backward_with_bias_grad(&grad, &preactivation, &main)?;
    let plain_main = Tensor::zeros([columns], (Kind::Float, cuda));
    add_bias_grad(&grad, &plain_main)?;
    let plain_sums =
        grad.to_kind(Kind::Float)
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    let (packed_want, query, key, value) = made_up_qkv_grad(cuda, kind);
    let packed_main = Tensor::zeros([packed_want.size()[1]], (Kind::Float, cuda));
    let packed = pack_qkv_grad(&query, &key, &value, &packed_main)?;
    ensure!(
        packed.equal(&packed_want),
        "the packed QKV gradient differs from the concatenated parts"
    );
    let packed_sums =
        packed_want
            .to_kind(Kind::Float)
            .sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    for (what, got, want) in [
        ("GeLU gradient", &got, &want_input),
        ("bias gradient after GeLU", &main, &want_sums),
        ("bias gradient", &plain_main, &plain_sums),
        ("QKV bias gradient", &packed_main, &packed_sums),
    ] {
        let error = relative_error(got, want);
        ensure!(
            error <= 1e-2,
            "the {what} differs from libtorch's by {error:.3e} (relative)"
        );
    }
    Ok(())
}

/// A made-up packed QKV gradient `[s·b, groups · (2 + 2)·8]` (two query heads a group) and its
/// three parts as attention's backward may leave them: the queries as a strided view of it, the
/// keys in `[b, groups, s, d]` memory order, the values in their own contiguous tensor.
pub fn made_up_qkv_grad(device: Device, kind: Kind) -> (Tensor, Tensor, Tensor, Tensor) {
    let (s, b, groups, head_dim) = (37, 5, 3, 8);
    let (query_width, width) = (2 * head_dim, 4 * head_dim);
    let packed = ((Tensor::arange(s * b * groups * width, (Kind::Float, device)) * 0.29).sin()
        * 2.0)
        .view([s, b, groups, width])
        .to_kind(kind);
    let query = packed.narrow(3, 0, query_width);
    let key = packed
        .narrow(3, query_width, head_dim)
        .permute([1, 2, 0, 3])
        .contiguous()
        .permute([2, 0, 1, 3]);
    let value = packed
        .narrow(3, query_width + head_dim, head_dim)
        .contiguous();
    (packed.view([s * b, groups * width]), query, key, value)
}
