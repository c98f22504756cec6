//! FP8 quantization on CUDA devices in one pass, as Transformer Engine's cast kernels: read a
//! bf16 (fp16, fp32) matrix once, write it scaled to e4m3 or e5m2 (rounded to nearest even,
//! saturated to the largest finite value), optionally also transposed (the layout the weight-
//! and input-gradient GEMMs need), and record its amax for delayed scaling. Done with libtorch
//! operations it takes five passes over the tensor and about ten launches per quantization
//! (`model::fp8` keeps that path for the CPU).
//!
//! Matrices whose sides are multiples of 4 (every activation and weight of a model whose sizes
//! suit fp8 GEMMs) take the four-element kernels: 8- or 16-byte loads and 4-byte stores, in
//! and out of a shared-memory tile for the transpose; other shapes the one-element ones.
//!
//! The scale comes either from the device scalar of the delayed-scaling state or from an amax
//! computed just before (current scaling), in which case the kernel derives the scale from it
//! with the same float32 division and fallback as `model::fp8`. Each launch writes the inverse
//! scale of its use to a scalar of its own, which the GEMMs of this use read even after the
//! delayed state has moved on.

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::{dtype_name, kernel_arg};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Rows of a tile, and its columns in the one-element kernels; a block of 32 × 8 threads casts
/// one tile.
const TILE: i64 = 32;

/// Columns of a tile in the four-element kernels.
const WIDE: i64 = 128;

/// Threads of the delayed-scaling update.
const UPDATE_THREADS: u32 = 256;

pub const SOURCE: KernelSource = KernelSource {
    name: "fp8_cast",
    source: concat!(
        cuda_scalars!(),
        r#"
__device__ __forceinline__ bool finite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}

constexpr float FLOAT_MAX = 3.402823466e38f;

// `max / amax`, or 1 when the amax is zero or not finite (model::fp8::scale_from_amax).
__device__ __forceinline__ float scale_from_amax(float amax, float max) {
    return amax > 0.f && finite(amax) ? fminf(max / amax, FLOAT_MAX) : 1.f;
}

// Round to nearest even, saturating to the largest finite value; the value goes in the low
// byte of the converted pair.
template <bool E5M2> __device__ __forceinline__ unsigned char to_fp8(float v) {
    unsigned short pair;
    if (E5M2) {
        asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
    } else {
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(v));
    }
    return (unsigned char)(pair & 0xff);
}

constexpr int TILE = 32;
constexpr int ROWS_PER_PASS = 8;

// The end of a cast block of 32 × ROWS_PER_PASS threads: with amax_out, the block's largest
// |x| (each thread's `amax`) is max-ed into it (as float bits: non-negative floats order as
// their bits); block (0, 0) writes 1 / scale to *scale_inv.
__device__ void finish_block(float amax, unsigned int* amax_out, float scale, float* scale_inv) {
    __shared__ float warp_amax[ROWS_PER_PASS];
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    if (amax_out) {
        for (int offset = 16; offset > 0; offset /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
        }
        if (tx == 0) warp_amax[ty] = amax;
        __syncthreads();
        if (tx == 0 && ty == 0) {
            for (int w = 1; w < ROWS_PER_PASS; ++w) amax = fmaxf(amax, warp_amax[w]);
            atomicMax(amax_out, __float_as_uint(amax));
        }
    }
    if (scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && tx == 0 && ty == 0) {
        *scale_inv = 1.f / scale;
    }
}

// x [rows, cols] contiguous. out [rows, cols] and out_t [cols, rows] (either may be null).
// The scale is *scale, or derived from *amax_in when amax_in is not null; see finish_block for
// scale_inv and amax_out.
template <typename T, bool E5M2>
__device__ void cast_transpose(const T* x, long long rows, long long cols, unsigned char* out,
                               unsigned char* out_t, const float* scale_in,
                               const float* amax_in, float max, float* scale_inv,
                               unsigned int* amax_out) {
    __shared__ unsigned char tile[TILE][TILE + 4];
    const float scale = amax_in ? scale_from_amax(*amax_in, max) : *scale_in;
    const long long row0 = (long long)blockIdx.x * TILE;
    const long long col0 = (long long)blockIdx.y * TILE;
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    float amax = 0.f;
    for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
        const long long r = row0 + i;
        const long long c = col0 + tx;
        unsigned char q = 0;
        if (r < rows && c < cols) {
            const float v = load(x + r * cols + c);
            amax = fmaxf(amax, fabsf(v));
            q = to_fp8<E5M2>(v * scale);
            if (out) out[r * cols + c] = q;
        }
        tile[i][tx] = q;
    }
    if (out_t) {
        __syncthreads();
        for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
            const long long c = col0 + i;
            const long long r = row0 + tx;
            if (r < rows && c < cols) out_t[c * rows + r] = tile[tx][i];
        }
    }
    finish_block(amax, amax_out, scale, scale_inv);
}

// Four consecutive elements at once (8- or 16-byte loads, 4-byte stores), for matrices whose
// rows and columns are multiples of 4 and an input aligned to its vector: a block casts a
// tile of 32 rows × 128 columns, a thread four columns of a row per pass.
struct alignas(8) u16x4 { unsigned short v[4]; };
struct alignas(16) f32x4 { float v[4]; };

__device__ __forceinline__ void load4(const float* p, float* o) {
    const f32x4 w = *reinterpret_cast<const f32x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = w.v[k];
}
__device__ __forceinline__ void load4(const bf16* p, float* o) {
    const u16x4 w = *reinterpret_cast<const u16x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = __uint_as_float(((unsigned int)w.v[k]) << 16);
}
__device__ __forceinline__ void load4(const f16* p, float* o) {
    const u16x4 w = *reinterpret_cast<const u16x4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) asm("cvt.f32.f16 %0, %1;" : "=f"(o[k]) : "h"(w.v[k]));
}

constexpr int WIDE = 128;

template <typename T, bool E5M2>
__device__ void cast_transpose4(const T* x, long long rows, long long cols, unsigned char* out,
                                unsigned char* out_t, const float* scale_in,
                                const float* amax_in, float max, float* scale_inv,
                                unsigned int* amax_out) {
    __shared__ unsigned char tile[TILE][WIDE + 4];
    const float scale = amax_in ? scale_from_amax(*amax_in, max) : *scale_in;
    const long long row0 = (long long)blockIdx.x * TILE;
    const long long col0 = (long long)blockIdx.y * WIDE;
    const int tx = threadIdx.x;
    const int ty = threadIdx.y;
    float amax = 0.f;
    for (int i = ty; i < TILE; i += ROWS_PER_PASS) {
        const long long r = row0 + i;
        const long long c = col0 + 4 * tx;
        unsigned int packed = 0u;
        if (r < rows && c < cols) {
            float v[4];
            load4(x + r * cols + c, v);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                amax = fmaxf(amax, fabsf(v[k]));
                packed |= ((unsigned int)to_fp8<E5M2>(v[k] * scale)) << (8 * k);
            }
            if (out) *reinterpret_cast<unsigned int*>(out + r * cols + c) = packed;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) tile[i][4 * tx + k] = (unsigned char)(packed >> (8 * k));
    }
    if (out_t) {
        __syncthreads();
        // out_t's rows col0.. hold this tile's columns; each row's 32 bytes are 8 words of 4
        // consecutive input rows.
        const int thread = ty * 32 + tx;
        for (int word = thread; word < WIDE * (TILE / 4); word += 32 * ROWS_PER_PASS) {
            const int column = word / (TILE / 4);
            const int first = 4 * (word % (TILE / 4));
            const long long c = col0 + column;
            const long long r = row0 + first;
            if (r < rows && c < cols) {
                unsigned int packed = 0u;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    packed |= ((unsigned int)tile[first + k][column]) << (8 * k);
                }
                *reinterpret_cast<unsigned int*>(out_t + c * rows + r) = packed;
            }
        }
    }
    finish_block(amax, amax_out, scale, scale_inv);
}

#define FP8_CAST(NAME, T, E5M2)                                                             \
    extern "C" __global__ void NAME(const T* x, long long rows, long long cols,             \
                                    unsigned char* out, unsigned char* out_t,                \
                                    const float* scale_in, const float* amax_in, float max,  \
                                    float* scale_inv, unsigned int* amax_out) {              \
        cast_transpose<T, E5M2>(x, rows, cols, out, out_t, scale_in, amax_in, max,          \
                                scale_inv, amax_out);                                        \
    }

#define FP8_CAST4(NAME, T, E5M2)                                                            \
    extern "C" __global__ void NAME(const T* x, long long rows, long long cols,             \
                                    unsigned char* out, unsigned char* out_t,                \
                                    const float* scale_in, const float* amax_in, float max,  \
                                    float* scale_inv, unsigned int* amax_out) {              \
        cast_transpose4<T, E5M2>(x, rows, cols, out, out_t, scale_in, amax_in, max,         \
                                 scale_inv, amax_out);                                       \
    }

FP8_CAST(fp8_cast_bf16_e4m3, bf16, false)
FP8_CAST(fp8_cast_bf16_e5m2, bf16, true)
FP8_CAST(fp8_cast_f16_e4m3, f16, false)
FP8_CAST(fp8_cast_f16_e5m2, f16, true)
FP8_CAST(fp8_cast_f32_e4m3, float, false)
FP8_CAST(fp8_cast_f32_e5m2, float, true)
FP8_CAST4(fp8_cast4_bf16_e4m3, bf16, false)
FP8_CAST4(fp8_cast4_bf16_e5m2, bf16, true)
FP8_CAST4(fp8_cast4_f16_e4m3, f16, false)
FP8_CAST4(fp8_cast4_f16_e5m2, f16, true)
FP8_CAST4(fp8_cast4_f32_e4m3, float, false)
FP8_CAST4(fp8_cast4_f32_e5m2, float, true)

// Delayed scaling after a use: counters [amax of the use (float bits), ring position]; the
// amax goes into the history ring (len entries), the counters move on, and the scale becomes
// max_over_margin / (the amax, or the history's max with use_max), unless that amax is zero
// or not finite. One block.
extern "C" __global__ void fp8_delayed_update(float* scale, unsigned int* counters,
                                              float* history, int len, int use_max,
                                              float max_over_margin) {
    __shared__ float partial[256];
    const float amax = __uint_as_float(counters[0]);
    const unsigned int position = counters[1];
    __syncthreads();
    if (threadIdx.x == 0) {
        history[position] = amax;
        counters[0] = 0u;
        counters[1] = (position + 1) % (unsigned int)len;
    }
    __syncthreads();
    float reduced = amax;
    if (use_max) {
        float m = 0.f;
        for (int i = threadIdx.x; i < len; i += blockDim.x) m = fmaxf(m, history[i]);
        partial[threadIdx.x] = m;
        __syncthreads();
        for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
            if (threadIdx.x < stride) {
                partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + stride]);
            }
            __syncthreads();
        }
        reduced = partial[0];
    }
    if (threadIdx.x == 0 && reduced > 0.f && finite(reduced)) {
        *scale = fminf(max_over_margin / reduced, FLOAT_MAX);
    }
}
"#
    ),
    functions: &[
        "fp8_cast_bf16_e4m3",
        "fp8_cast_bf16_e5m2",
        "fp8_cast_f16_e4m3",
        "fp8_cast_f16_e5m2",
        "fp8_cast_f32_e4m3",
        "fp8_cast_f32_e5m2",
        "fp8_cast4_bf16_e4m3",
        "fp8_cast4_bf16_e5m2",
        "fp8_cast4_f16_e4m3",
        "fp8_cast4_f16_e5m2",
        "fp8_cast4_f32_e4m3",
        "fp8_cast4_f32_e5m2",
        "fp8_delayed_update",
    ],
    prefer_shared_memory: false,
};

/// Where a cast takes its scale from.
pub enum ScaleSource<'a> {
    /// The delayed-scaling state's scale; the use's amax is max-ed into `amax_out` (a
    /// `[2]` int32 counters tensor whose first entry holds float bits).
    Delayed {
        scale: &'a Tensor,
        amax_out: &'a Tensor,
    },
    /// Current scaling from this amax (a float32 scalar computed just before).
    Amax(&'a Tensor),
}

/// What a cast gives: the fp8 matrix, its transpose when asked, and the inverse scale.
pub struct Cast {
    pub data: Tensor,
    pub data_t: Option<Tensor>,
    pub scale_inv: Tensor,
}

fn device_index(tensor: &Tensor) -> Result<usize> {
    match tensor.device() {
        Device::Cuda(index) => Ok(index),
        other => anyhow::bail!("the fp8 cast kernels run on CUDA devices, not {other:?}"),
    }
}

/// Casts the 2-D `x` to `kind` (e4m3 or e5m2) with the scale `source` gives, whose largest
/// finite value is `max`.
pub fn cast(
    x: &Tensor,
    kind: Kind,
    max: f64,
    source: ScaleSource,
    transposed: bool,
) -> Result<Cast> {
    let device = device_index(x)?;
    let (rows, cols) = x.size2()?;
    let x = x.contiguous();
    let input = dtype_name(x.kind()).context("the fp8 cast's input")?;
    let output = match kind {
        Kind::Float8e4m3fn => "e4m3",
        Kind::Float8e5m2 => "e5m2",
        other => anyhow::bail!("no fp8 cast to {other:?}"),
    };
    let options = (kind, x.device());
    let data = Tensor::empty([rows, cols], options);
    let data_t = transposed.then(|| Tensor::empty([cols, rows], options));
    let scale_inv = Tensor::empty([], (Kind::Float, x.device()));
    let (scale_in, amax_in, amax_out) = match &source {
        ScaleSource::Delayed { scale, amax_out } => {
            ensure!(
                scale.kind() == Kind::Float && amax_out.kind() == Kind::Int,
                "fp8 delayed-scaling state of the wrong types"
            );
            (scale.data_ptr() as u64, 0u64, amax_out.data_ptr() as u64)
        }
        ScaleSource::Amax(amax) => {
            ensure!(amax.kind() == Kind::Float, "the amax must be float32");
            (0u64, amax.data_ptr() as u64, 0u64)
        }
    };
    if rows == 0 || cols == 0 {
        // Nothing to cast, but the GEMMs still read the inverse scale.
        let scale = match &source {
            ScaleSource::Delayed { scale, .. } => scale.view([]).shallow_clone(),
            ScaleSource::Amax(_) => Tensor::ones([], (Kind::Float, x.device())),
        };
        return Ok(Cast {
            data,
            data_t,
            scale_inv: scale.reciprocal(),
        });
    }
    let module = kernels(&SOURCE, device)?;
    let [mut x_ptr, mut out_ptr, mut scale_inv_ptr] =
        [&x, &data, &scale_inv].map(|t| t.data_ptr() as u64);
    let mut out_t_ptr = data_t.as_ref().map_or(0u64, |t| t.data_ptr() as u64);
    let (mut scale_in, mut amax_in, mut amax_out) = (scale_in, amax_in, amax_out);
    let (mut rows_arg, mut cols_arg, mut max_arg) = (rows, cols, max as f32);
    let mut args = [
        kernel_arg(&mut x_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut cols_arg),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut out_t_ptr),
        kernel_arg(&mut scale_in),
        kernel_arg(&mut amax_in),
        kernel_arg(&mut max_arg),
        kernel_arg(&mut scale_inv_ptr),
        kernel_arg(&mut amax_out),
    ];
    // Four elements a thread where the shape and the input's alignment allow vector accesses.
    let vector = 4 * x.kind().elt_size_in_bytes() as u64;
    let wide = rows % 4 == 0 && cols % 4 == 0 && x_ptr % vector == 0;
    let (variant, tile_cols) = if wide {
        ("cast4", WIDE)
    } else {
        ("cast", TILE)
    };
    let grid = ((rows + TILE - 1) / TILE, (cols + tile_cols - 1) / tile_cols);
    ensure!(
        grid.1 <= 65535,
        "fp8 cast of a matrix with {cols} columns: too wide for one launch"
    );
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // sizes as i64, the max as f32); `x` is contiguous [rows, cols] of the kernel's input type,
    // the outputs were allocated above with the shapes the kernel writes, the scalars are
    // float32 (the counters int32) on the same device; memory the caching allocator gets back
    // (a copied `x` dropped here) is only reused by work queued on the stream after the kernel.
    unsafe {
        module.launch(
            &format!("fp8_{variant}_{input}_{output}"),
            (grid.0 as u32, grid.1 as u32, 1),
            (TILE as u32, 8, 1),
            &mut args,
        )?;
    }
    Ok(Cast {
        data,
        data_t,
        scale_inv,
    })
}

/// Delayed scaling after a use (see the kernel): `scale` float32 `[1]`, `counters` int32 `[2]`,
/// `history` float32 `[len]`, all on one CUDA device.
pub fn delayed_update(
    scale: &Tensor,
    counters: &Tensor,
    history: &Tensor,
    use_max: bool,
    max_over_margin: f64,
) -> Result<()> {
    let device = device_index(scale)?;
    let module = kernels(&SOURCE, device)?;
    let [mut scale_ptr, mut counters_ptr, mut history_ptr] =
        [scale, counters, history].map(|t| t.data_ptr() as u64);
    let mut len = history.numel() as i32;
    let mut use_max = use_max as i32;
    let mut max_arg = max_over_margin as f32;
    let mut args = [
        kernel_arg(&mut scale_ptr),
        kernel_arg(&mut counters_ptr),
        kernel_arg(&mut history_ptr),
        kernel_arg(&mut len),
        kernel_arg(&mut use_max),
        kernel_arg(&mut max_arg),
    ];
    // SAFETY: the arguments match the kernel's parameters in order and type; the tensors are
    // the state's own, of the documented shapes and types, on this device.
    unsafe {
        module.launch(
            "fp8_delayed_update",
            (1, 1, 1),
            (UPDATE_THREADS, 1, 1),
            &mut args,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::nvrtc::compile_ptx;

    /// The kernels compile with NVRTC for Hopper, and their PTX (with the inline fp8
    /// conversions, which NVRTC passes through unchecked) assembles with the `ptxas` of the test
    /// Python's torch wheel when it has one; no GPU needed.
    #[test]
    fn the_fp8_cast_kernels_compile_for_hopper() {
        let ptx = compile_ptx(&SOURCE, "compute_90").unwrap();
        for function in SOURCE.functions {
            assert!(
                ptx.contains(&format!(".entry {function}(")),
                "{function} is missing from the PTX"
            );
        }
        let Some(ptxas) = torch_ptxas() else {
            eprintln!("ptxas not checked: no torch wheel with bin/ptxas");
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("fp8_cast.ptx");
        std::fs::write(&source, &ptx).unwrap();
        let output = std::process::Command::new(&ptxas)
            .args(["-arch=sm_90", "-o"])
            .arg(dir.path().join("fp8_cast.cubin"))
            .arg(&source)
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{} rejects the fp8 cast PTX:\n{}",
            ptxas.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// `torch/bin/ptxas` of `$MEGATRON_RS_TEST_PYTHON`'s torch, when both exist.
    fn torch_ptxas() -> Option<std::path::PathBuf> {
        let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")?;
        let output = std::process::Command::new(python)
            .args([
                "-c",
                "import os, torch; print(os.path.dirname(torch.__file__))",
            ])
            .output()
            .ok()?;
        let torch = String::from_utf8(output.stdout).ok()?;
        let ptxas = std::path::Path::new(torch.trim()).join("bin/ptxas");
        ptxas.is_file().then_some(ptxas)
    }
}
