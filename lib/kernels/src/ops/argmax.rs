//! The index of each row's largest value (greedy decoding's token) in two small kernels.
//! libtorch reduces a row of a language model's logits (50,000 to 150,000 values) in one block,
//! on one multiprocessor: about 16 µs of a 0.65 ms batch-1 decode step on an H100. Here blocks
//! of many rows' chunks find their chunk's largest value at once, and a second kernel picks each
//! row's among its chunks, in order.
//!
//! The answer is libtorch's: the first index of the largest value, NaN counting as the largest
//! (the first NaN), so a greedy token is the same whichever path draws it.
//!
//! Compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's current stream.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{ceil_div, dtype_name, kernel_arg};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Values of a row each block of the first kernel looks at (the kernel's `CHUNK`).
const CHUNK: i64 = 4096;

/// Threads of a block of the first kernel (the kernel's `THREADS`).
const THREADS: u32 = 256;

/// The kernels' CUDA source (`lib/kernels/cuda/argmax.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "argmax",
    source: include_str!("../../cuda/argmax.cu"),
    headers: super::HEADERS,
    functions: &[
        "argmax_chunks_bf16",
        "argmax_chunks_f16",
        "argmax_chunks_f32",
        "argmax_rows",
    ],
    prefer_shared_memory: false,
};

/// Rows of the second kernel's blocks (a warp each).
const ROWS_PER_BLOCK: i64 = 8;

/// The index of the largest value of each row of `x` (`[rows, columns]`, bf16, fp16 or fp32,
/// on a CUDA device; columns contiguous, rows at any stride), as `x.argmax(-1)`: `[rows]`
/// int64.
pub fn argmax_rows(x: &Tensor) -> Result<Tensor> {
    let (rows, columns) = x.size2()?;
    let Device::Cuda(device) = x.device() else {
        bail!("the argmax kernels run on CUDA devices");
    };
    ensure!(columns > 0, "an argmax of rows without values");
    let x = if x.stride()[1] == 1 {
        x.shallow_clone()
    } else {
        x.contiguous()
    };
    let out = Tensor::empty([rows], (Kind::Int64, x.device()));
    if rows == 0 {
        return Ok(out);
    }
    let chunks = ceil_div(columns, CHUNK);
    ensure!(
        rows < i64::from(u16::MAX) && chunks < i64::from(i32::MAX),
        "no argmax kernel for {rows} rows of {columns} values"
    );
    let values = Tensor::empty([rows, chunks], (Kind::Float, x.device()));
    let indices = Tensor::empty([rows, chunks], (Kind::Int64, x.device()));
    let module = kernels(&SOURCE, device)?;
    let function = format!("argmax_chunks_{}", dtype_name(x.kind())?);
    let [mut x_ptr, mut values_ptr, mut indices_ptr, mut out_ptr] =
        [&x, &values, &indices, &out].map(|t| t.data_ptr() as u64);
    let (mut row_stride, mut columns_arg) = (x.stride()[0], columns);
    let (mut chunks_arg, mut rows_arg) = (chunks as i32, rows as i32);
    // SAFETY: the arguments match the kernels' parameters in order and type (pointers as u64,
    // the stride and columns as i64, counts as i32); `x` holds `rows` rows of `columns` values
    // at `row_stride`, the partial buffers `[rows, chunks]` and `out` `[rows]` are fresh device
    // tensors of the types the kernels write; the second kernel runs after the first on the
    // stream.
    unsafe {
        module.launch(
            &function,
            (chunks as u32, rows as u32, 1),
            (THREADS, 1, 1),
            &mut [
                kernel_arg(&mut x_ptr),
                kernel_arg(&mut row_stride),
                kernel_arg(&mut columns_arg),
                kernel_arg(&mut chunks_arg),
                kernel_arg(&mut values_ptr),
                kernel_arg(&mut indices_ptr),
            ],
        )?;
        module.launch(
            "argmax_rows",
            (ceil_div(rows, ROWS_PER_BLOCK) as u32, 1, 1),
            (32 * ROWS_PER_BLOCK as u32, 1, 1),
            &mut [
                kernel_arg(&mut values_ptr),
                kernel_arg(&mut indices_ptr),
                kernel_arg(&mut rows_arg),
                kernel_arg(&mut chunks_arg),
                kernel_arg(&mut out_ptr),
            ],
        )?;
    }
    Ok(out)
}

/// `x.argmax(-1)` for `[rows, columns]` logits: through [`argmax_rows`] on CUDA devices for the
/// dtypes it takes, libtorch's otherwise.
pub fn greedy(x: &Tensor) -> Result<Tensor> {
    if x.device().is_cuda() && matches!(x.kind(), Kind::BFloat16 | Kind::Half | Kind::Float) {
        argmax_rows(x)
    } else {
        Ok(x.argmax(-1, false))
    }
}
