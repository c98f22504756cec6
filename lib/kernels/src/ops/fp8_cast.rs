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

/// The kernels' CUDA source (`lib/kernels/cuda/fp8_cast.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "fp8_cast",
    source: include_str!("../../cuda/fp8_cast.cu"),
    headers: super::HEADERS,
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
