//! Rotary position embeddings in one kernel, Megatron's `apply_rope_fusion` (on by default,
//! `--no-rope-fusion` turns it off). libtorch's ops rotate a head in six passes (the halves'
//! negation and concatenation, the tables' conversion to the activation dtype, two products and
//! their sum), and its backward as many again; the kernel reads each query or key channel once
//! and writes the rotated one, and its backward is the same kernel with the sine negated (the
//! rotation's transpose).
//!
//! For the first `r` channels of each head, with `h = r / 2`, channel `i < h` and the tables'
//! cosine `c` and sine `s` of position and frequency `i` (Megatron's non-interleaved "rotate
//! half"): `y[i] = x[i]·c − x[i+h]·s`, `y[i+h] = x[i+h]·c + x[i]·s`; channels from `r` on pass
//! through. The arithmetic is float32 with one rounding to the activation dtype, where
//! libtorch's path rounds the tables and each product to it first.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::{dtype_name, kernel_arg, passes_self_check, relative_error};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Threads per block: one warp a head, 8 heads a block.
const WARPS: u32 = 8;

/// The kernels' CUDA source (`lib/kernels/cuda/rope.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "rope",
    source: include_str!("../../cuda/rope.cu"),
    headers: super::HEADERS,
    functions: &["rope_bf16", "rope_f16", "rope_f32"],
    prefer_shared_memory: false,
};

/// Which way [`rotate`] turns: the embedding itself, or its transpose (the backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Forward,
    Backward,
}

impl Direction {
    fn sine_sign(self) -> f32 {
        match self {
            Direction::Forward => 1.0,
            Direction::Backward => -1.0,
        }
    }
}

/// `x` (`[s, b, heads, d]`, bf16, fp16 or float32 on a CUDA device, any strides) with its first
/// `r` channels rotated by the float32 tables `cos` and `sin` (`r` values per position, `s`
/// positions, contiguous: `[s, r]` or `[s, 1, 1, r]`), as a new contiguous tensor.
/// [`Direction::Backward`] negates the sine: for rotary tables, whose second half repeats the
/// first (each frequency's angle for both channels of its pair), that is the transpose, the
/// gradient of the forward.
pub fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor, direction: Direction) -> Result<Tensor> {
    let (kind, device) = (x.kind(), x.device());
    let Device::Cuda(index) = device else {
        bail!("the fused rotary embedding runs on CUDA devices, not {device:?}");
    };
    let (s, b, heads, d) = x.size4()?;
    let r = *cos.size().last().unwrap_or(&0);
    for (name, table) in [("cosine", cos), ("sine", sin)] {
        ensure!(
            table.kind() == Kind::Float
                && table.device() == device
                && table.is_contiguous()
                && table.numel() as i64 == s * r,
            "the fused rotary embedding needs a contiguous float32 {name} table of {s} positions \
             × {r} channels on {device:?}, not {:?} {:?} on {:?}",
            table.kind(),
            table.size(),
            table.device()
        );
    }
    ensure!(
        r > 0 && r % 2 == 0 && r <= d,
        "the fused rotary embedding rotates an even number of channels up to the head's {d}, not {r}"
    );
    let rows = s * b * heads;
    ensure!(
        rows <= i32::MAX as i64 && d <= i32::MAX as i64,
        "{rows} heads of {d} channels are more than one launch takes"
    );
    let x = if x.stride()[3] == 1 {
        x.shallow_clone()
    } else {
        x.contiguous()
    };
    let out = Tensor::empty([s, b, heads, d], (kind, device));
    if rows == 0 {
        return Ok(out);
    }
    let module = kernels(&SOURCE, index)?;
    let function = format!("rope_{}", dtype_name(kind)?);
    let strides = x.stride();
    let [mut x_ptr, mut out_ptr, mut cos_ptr, mut sin_ptr] =
        [&x, &out, cos, sin].map(|t| t.data_ptr() as u64);
    let [mut stride_s, mut stride_b, mut stride_h] = [strides[0], strides[1], strides[2]];
    let [mut batch, mut heads_arg, mut d_arg, mut r_arg, mut rows_arg] =
        [b, heads, d, r, rows].map(|v| v as i32);
    let mut sign = direction.sine_sign();
    let mut args = [
        kernel_arg(&mut x_ptr),
        kernel_arg(&mut stride_s),
        kernel_arg(&mut stride_b),
        kernel_arg(&mut stride_h),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut cos_ptr),
        kernel_arg(&mut sin_ptr),
        kernel_arg(&mut batch),
        kernel_arg(&mut heads_arg),
        kernel_arg(&mut d_arg),
        kernel_arg(&mut r_arg),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut sign),
    ];
    let blocks = (rows as u64).div_ceil(u64::from(WARPS)) as u32;
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // strides as i64, sizes as i32, the sign as f32); `x` is [s, b, heads, d] of the kernel's
    // dtype with unit channel stride, `out` a contiguous tensor of its shape and dtype, the
    // tables float32 with s · r values, all on this device; every row index the grid reaches
    // below `rows` addresses inside them. `x`, the tables and `out` are held until the kernel
    // is queued, and the caching allocator reuses their memory only for later work on this
    // stream.
    unsafe {
        module.launch(&function, (blocks, 1, 1), (32 * WARPS, 1, 1), &mut args)?;
    }
    Ok(out)
}

/// The rotation by libtorch's ops in `x`'s dtype, the tables rounded to it first and each
/// product and the sum after (the path of `--no-rope-fusion`, CPUs and inference). The tables
/// broadcast over `x`: `[s, 1, 1, r]`, or `[s, b, 1, r]` for rows at positions of their own.
pub fn rotate_unfused(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let rotary_dim = *cos.size().last().expect("tables have a channel dimension");
    let head_dim = *x.size().last().expect("heads have a channel dimension");
    let rotated_part = x.narrow(-1, 0, rotary_dim);
    let halves = rotated_part.chunk(2, -1);
    let rotate_half = Tensor::cat(&[&halves[1].neg(), &halves[0]], -1);
    let out = rotated_part * cos.to_kind(x.kind()) + rotate_half * sin.to_kind(x.kind());
    if rotary_dim == head_dim {
        out
    } else {
        Tensor::cat(
            &[&out, &x.narrow(-1, rotary_dim, head_dim - rotary_dim)],
            -1,
        )
    }
}

/// The kernel's rotation by libtorch's ops in float32 (the reference of the self-check and the
/// tests), `[s, b, heads, d]` float32.
pub fn reference(x: &Tensor, cos: &Tensor, sin: &Tensor, direction: Direction) -> Tensor {
    let s = x.size()[0];
    let r = *cos.size().last().expect("tables have channels");
    let sin = sin.view([s, 1, 1, r]) * f64::from(direction.sine_sign());
    rotate_unfused(&x.to_kind(Kind::Float), &cos.view([s, 1, 1, r]), &sin)
}

/// Whether the kernel should run for `kind` activations on `device`: a CUDA device, a dtype it
/// takes and [`self_check`] passed there (once per device and dtype; a failure is reported once
/// and libtorch's ops are used).
pub fn usable_on(device: Device, kind: Kind) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    dtype_name(kind).is_ok()
        && passes_self_check(
            "the fused rotary embedding",
            device,
            kind,
            0,
            "libtorch's ops",
            || self_check(index, kind),
        )
}

/// Runs the kernel on CUDA device `device` on made-up heads of `kind` (strided like the
/// attention's query view, part of the channels rotated, both directions, rotary tables)
/// against [`reference`].
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let (s, b, heads, d, r) = (5, 3, 4, 96, 64);
    let packed = ((Tensor::arange(s * b * heads * 2 * d, (Kind::Float, cuda)) * 0.37).sin() * 3.0)
        .view([s, b, heads, 2 * d])
        .to_kind(kind);
    let x = packed.narrow(-1, d, d);
    let angles =
        (Tensor::arange(s * r / 2, (Kind::Float, cuda)).view([s, r / 2]) * 0.11).repeat([1, 2]);
    let (cos, sin) = (angles.cos(), angles.sin());
    for direction in [Direction::Forward, Direction::Backward] {
        let got = rotate(&x, &cos, &sin, direction)?;
        let error = relative_error(&got, &reference(&x, &cos, &sin, direction));
        ensure!(
            error <= 1e-2,
            "the {direction:?} rotation differs from libtorch's by {error:.3e} (relative)"
        );
    }
    Ok(())
}
