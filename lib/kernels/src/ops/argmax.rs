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

/// The kernels' CUDA source.
pub const SOURCE: KernelSource = KernelSource {
    name: "argmax",
    source: concat!(
        cuda_scalars!(),
        r#"
constexpr int CHUNK = 4096;
constexpr int THREADS = 256;

// Whether (a, ai) comes before (b, bi) as libtorch's argmax ranks them: NaN first, then the
// larger value, then the smaller index.
__device__ __forceinline__ bool better(float a, long long ai, float b, long long bi) {
    const bool a_nan = a != a;
    const bool b_nan = b != b;
    if (a_nan || b_nan) return a_nan && (!b_nan || ai < bi);
    return a > b || (a == b && ai < bi);
}

__device__ __forceinline__ void keep_better(float& value, long long& index, float other,
                                            long long other_index) {
    if (better(other, other_index, value, index)) {
        value = other;
        index = other_index;
    }
}

// The best (value, index) of a warp's lanes, in every lane.
__device__ __forceinline__ void warp_best(float& value, long long& index) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xffffffffu, value, offset);
        const long long other_index = __shfl_xor_sync(0xffffffffu, index, offset);
        keep_better(value, index, other, other_index);
    }
}

// Block (c, r) finds the best of row r's values [c·CHUNK, (c+1)·CHUNK) (row r at
// x + r·row_stride, `columns` values) and writes it to values/indices [r, chunks] at c.
template <typename T>
__device__ void chunk_best(const T* x, long long row_stride, long long columns, int chunks,
                           float* values, long long* indices) {
    const long long row = blockIdx.y;
    const long long start = (long long)blockIdx.x * CHUNK;
    const long long end = start + CHUNK < columns ? start + CHUNK : columns;
    const T* values_of_row = x + row * row_stride;
    float value = neg_inf();
    long long index = end;
    // Loads in flight together: each thread's values are THREADS apart.
    constexpr int PER = CHUNK / THREADS;
    float loaded[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const long long k = start + threadIdx.x + (long long)i * THREADS;
        loaded[i] = k < end ? load(values_of_row + k) : neg_inf();
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const long long k = start + threadIdx.x + (long long)i * THREADS;
        if (k < end) keep_better(value, index, loaded[i], k);
    }
    warp_best(value, index);
    __shared__ float warp_values[THREADS / 32];
    __shared__ long long warp_indices[THREADS / 32];
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        warp_values[warp] = value;
        warp_indices[warp] = index;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < THREADS / 32; ++w) keep_better(value, index, warp_values[w], warp_indices[w]);
        values[row * chunks + blockIdx.x] = value;
        indices[row * chunks + blockIdx.x] = index;
    }
}

// Warp r picks row r's best among its chunks' and writes its index to out[r].
__device__ void row_best(const float* values, const long long* indices, int rows, int chunks,
                         long long* out) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    float value = neg_inf();
    long long index = 0x7fffffffffffffffLL;
    for (int c = lane; c < chunks; c += 32)
        keep_better(value, index, values[(long long)row * chunks + c],
                    indices[(long long)row * chunks + c]);
    warp_best(value, index);
    if (lane == 0) out[row] = index;
}

#define CHUNK_BEST(NAME, T)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS)                                  \
        NAME(const T* x, long long row_stride, long long columns, int chunks, float* values, \
             long long* indices) {                                                          \
        chunk_best<T>(x, row_stride, columns, chunks, values, indices);                     \
    }

CHUNK_BEST(argmax_chunks_bf16, bf16)
CHUNK_BEST(argmax_chunks_f16, f16)
CHUNK_BEST(argmax_chunks_f32, float)

extern "C" __global__ void argmax_rows(const float* values, const long long* indices, int rows,
                                       int chunks, long long* out) {
    row_best(values, indices, rows, chunks, out);
}
"#
    ),
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
