//! The linear layers of a decode step of few rows as one kernel each: `[rows, K] · Wᵀ` for a
//! weight `W` `[N, K]` in `nn.Linear`'s layout, with the input's LayerNorm or RMSNorm computed
//! on the way in and the bias, a GeLU and a residual added on the way out. At a handful of rows
//! a linear layer is a matrix-vector product bound by reading its weight; cuBLAS runs these
//! far below the memory bandwidth, and the norms, bias adds, activations and residual adds
//! around them are kernels of their own. Here every weight is read once for all rows, in
//! 16-byte loads, several in flight per lane, and a transformer layer's four linear layers
//! with everything around them are four kernels. Where a weight's slices fit, each block
//! first copies its slice into shared memory, before waiting for the previous kernel, so that
//! the weights of the next kernels stream in while one computes (`*_cached`); larger weights
//! (a language-model head, wide models) are read in the loop.
//!
//! Every row is computed alone (no sums across rows), so a row's result does not depend on the
//! other rows of its batch. Results are rounded to the activations' dtype where the unfused
//! layers round them (the normed input, the product plus bias, the activation), so that the
//! two paths agree up to the order of the sums.
//!
//! Compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's current stream,
//! so a decode step using them is captured in CUDA graphs.

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::Normalization;
use super::{aligned, contiguous_aligned, dtype_name, kernel_arg, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource, Kernels};

/// The most rows the kernels take: more rows are a matrix product, cuBLAS's business.
pub const MAX_ROWS: i64 = 8;

/// Warps per block (the kernel's `WARPS`): each computes one or two output columns.
const WARPS: u32 = 8;

/// The kernels' CUDA source (`lib/kernels/cuda/decode_gemv.cu`, which says how a warp splits
/// the columns and `K`).
pub const SOURCE: KernelSource = KernelSource {
    name: "decode_gemv",
    source: include_str!("../../cuda/decode_gemv.cu"),
    headers: super::HEADERS,
    functions: &[
        "decode_gemv_bf16_1",
        "decode_gemv_bf16_1_cached",
        "decode_gemv_bf16_2",
        "decode_gemv_bf16_2_cached",
        "decode_gemv_bf16_4",
        "decode_gemv_bf16_4_cached",
        "decode_gemv_bf16_8",
        "decode_gemv_bf16_8_cached",
        "decode_gemv_f16_1",
        "decode_gemv_f16_1_cached",
        "decode_gemv_f16_2",
        "decode_gemv_f16_2_cached",
        "decode_gemv_f16_4",
        "decode_gemv_f16_4_cached",
        "decode_gemv_f16_8",
        "decode_gemv_f16_8_cached",
        "decode_gemv_f32_1",
        "decode_gemv_f32_1_cached",
        "decode_gemv_f32_2",
        "decode_gemv_f32_2_cached",
        "decode_gemv_f32_4",
        "decode_gemv_f32_4_cached",
        "decode_gemv_f32_8",
        "decode_gemv_f32_8_cached",
    ],
    prefer_shared_memory: true,
};

// The kernel's flags.
const NORM_LAYER: i32 = 1;
const NORM_RMS: i32 = 2;
const NORM_ONE_PLUS: i32 = 4;
pub(super) const ADD_BIAS: i32 = 8;
const GELU_TANH: i32 = 16;
const GELU_ERF: i32 = 32;
const ADD_RESIDUAL: i32 = 64;
pub(super) const STAGE_INPUT: i32 = 128;

/// Inputs up to this size are staged in dynamic shared memory: what a launch gets without
/// opting in (48 KiB) less room for the kernel's static shared memory.
const MAX_STAGED_BYTES: i64 = 47 * 1024;

/// `MEGATRON_RS_DECODE_CACHED_WEIGHTS=0` keeps every weight streamed (to compare).
pub const CACHED_WEIGHTS_VARIABLE: &str = "MEGATRON_RS_DECODE_CACHED_WEIGHTS";

/// Shared memory the system keeps for each resident block.
const RESERVED_SHARED_BYTES_PER_BLOCK: i64 = 1024;

/// The grid and shared memory of `decode_gemv_*_cached`: `blocks` blocks of `columns` weight
/// rows each; a block's dynamic shared memory holds its rows, the input rows of the kernel's
/// row count, and the biases in float32.
struct CachedLayout {
    blocks: u32,
    columns: i32,
    shared_bytes: u32,
}

/// The kernel template (1, 2, 4 or 8 rows) of the fewest rows that holds `rows`.
pub(super) fn template_rows(rows: i64) -> i64 {
    match rows {
        1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    }
}

/// Dynamic shared memory a block may take when it takes at most a third of a multiprocessor's
/// (so that blocks of three successive kernels fit side by side) beside `static_bytes` of
/// static shared memory.
pub(super) fn third_of_multiprocessor(module: &Kernels, static_bytes: i64) -> i64 {
    i64::from(module.shared_bytes_per_multiprocessor) / 3
        - RESERVED_SHARED_BYTES_PER_BLOCK
        - static_bytes
}

impl CachedLayout {
    /// One block per multiprocessor, its slice of an `[n, k]` weight of `element`-byte values
    /// in shared memory, where all that takes at most a third of a multiprocessor's shared
    /// memory: then the blocks of three successive kernels fit side by side, and each kernel
    /// copies its slices in while the ones before it run. `None` for weights too large (a
    /// language-model head, wide models), which stream.
    fn of(module: &Kernels, template_rows: i64, k: i64, n: i64, element: i64) -> Option<Self> {
        if turned_off(CACHED_WEIGHTS_VARIABLE) {
            return None;
        }
        let multiprocessors = i64::from(module.multiprocessors.max(1));
        let columns = (n + multiprocessors - 1) / multiprocessors;
        let blocks = (n + columns - 1) / columns;
        let shared_bytes = (columns + template_rows) * k * element + columns * 4;
        // The kernel's static shared memory: the rows' norm statistics.
        let static_bytes = 2 * template_rows * 4;
        let share = third_of_multiprocessor(module, static_bytes);
        (shared_bytes <= share).then_some(CachedLayout {
            blocks: blocks as u32,
            columns: columns as i32,
            shared_bytes: shared_bytes as u32,
        })
    }
}

/// A LayerNorm or RMSNorm over the last dimension: the model's norms (see
/// `megatron_models::layers::Norm`) as plain tensor math, and as the kernels' prologue.
pub struct InputNorm<'a> {
    pub kind: Normalization,
    pub weight: &'a Tensor,
    /// LayerNorm's shift (RMSNorm has none).
    pub bias: Option<&'a Tensor>,
    pub eps: f64,
    /// `--apply-layernorm-1p`: the stored weight is zero-centred, gamma = 1 + weight.
    pub one_plus: bool,
}

impl InputNorm<'_> {
    /// The norm of `input` with libtorch's operations.
    pub fn apply(&self, input: &Tensor) -> Tensor {
        let gamma = if self.one_plus {
            self.weight + 1.0
        } else {
            self.weight.shallow_clone()
        };
        let hidden = *input
            .size()
            .last()
            .expect("normalised tensors have a hidden dimension");
        match self.kind {
            Normalization::LayerNorm => {
                input.layer_norm([hidden], Some(&gamma), self.bias, self.eps, true)
            }
            Normalization::RMSNorm => {
                // Statistics in float32 whatever the activation dtype, as Megatron's RMSNorm.
                let x = input.to_kind(Kind::Float);
                let inv_rms = (x.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
                (x * inv_rms).to_kind(input.kind()) * gamma
            }
        }
    }
}

/// A norm as the kernels' prologue reads it: its weights and its flags.
pub(super) struct NormPrologue {
    pub gamma: Tensor,
    /// LayerNorm's shift.
    pub beta: Option<Tensor>,
    pub flags: i32,
}

impl InputNorm<'_> {
    /// The norm's weights (contiguous, aligned copies where needed) for `input`'s rows and its
    /// flags, as the kernels take them.
    pub(super) fn prologue(&self, input: &Tensor) -> Result<NormPrologue> {
        let k = *input.size().last().unwrap_or(&0);
        let gamma = kernel_input(self.weight, &[k], input, "norm weight")?;
        let (beta, mut flags) = match (self.kind, self.bias) {
            (Normalization::LayerNorm, Some(bias)) => (
                Some(kernel_input(bias, &[k], input, "norm bias")?),
                NORM_LAYER,
            ),
            (Normalization::LayerNorm, None) => bail!("a LayerNorm without its bias"),
            (Normalization::RMSNorm, _) => (None, NORM_RMS),
        };
        if self.one_plus {
            flags |= NORM_ONE_PLUS;
        }
        Ok(NormPrologue { gamma, beta, flags })
    }
}

/// `t` as a kernel reads it beside `input`: of `shape`, `input`'s dtype and device (else an
/// error naming it `what`), contiguous and 16-byte aligned (a copy where it is not).
pub(super) fn kernel_input(
    t: &Tensor,
    shape: &[i64],
    input: &Tensor,
    what: &str,
) -> Result<Tensor> {
    let kind = input.kind();
    ensure!(
        t.size() == shape && t.kind() == kind && t.device() == input.device(),
        "the {what} is {:?} {:?} on {:?}; expected {kind:?} {shape:?} on {:?}",
        t.kind(),
        t.size(),
        t.device(),
        input.device()
    );
    Ok(contiguous_aligned(t))
}

/// The GeLU of the MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// The tanh approximation.
    Tanh,
    /// The exact one, through erf.
    Erf,
}

/// What follows the product, in this order: `+ bias` (`[N]`), the GeLU, `+ residual`
/// (`[rows, N]`).
#[derive(Default)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a Tensor>,
    pub gelu: Option<Gelu>,
    pub residual: Option<&'a Tensor>,
}

/// Whether the kernels have a version for activations of `kind`.
pub fn supports(kind: Kind) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
}

/// Whether [`decode_linear`] takes `rows` rows through `weight` (`[N, K]`): 1 to
/// [`MAX_ROWS`] rows, a contiguous, 16-byte aligned CUDA weight of a supported dtype whose
/// rows are whole 16-byte loads.
pub fn fits(rows: i64, weight: &Tensor) -> bool {
    let size = weight.size();
    let lanes = 16 / weight.kind().elt_size_in_bytes().max(1) as i64;
    (1..=MAX_ROWS).contains(&rows)
        && size.len() == 2
        && size[0] > 0
        && size[1] > 0
        && (size[1] % lanes) == 0
        && size[0] < i32::MAX as i64
        && size[1] < i32::MAX as i64
        && supports(weight.kind())
        && weight.device().is_cuda()
        && weight.is_contiguous()
        && aligned(weight)
}

/// `epilogue(norm(input) · weightᵀ)`: `input` `[rows, K]` (1 to [`MAX_ROWS`] rows),
/// `weight` `[N, K]`, the optional `norm` over `K`; returns `[rows, N]` in the input's dtype.
/// On a CUDA device; the weight must [`fits`].
pub fn decode_linear(
    input: &Tensor,
    weight: &Tensor,
    norm: Option<&InputNorm>,
    epilogue: &Epilogue,
) -> Result<Tensor> {
    let (rows, k) = input.size2()?;
    let kind = input.kind();
    let Device::Cuda(device) = input.device() else {
        bail!("the decode linear kernels run on CUDA devices");
    };
    ensure!(
        weight.kind() == kind && weight.device() == input.device() && weight.dim() == 2,
        "a weight of {:?} {:?} on {:?} for an input of {kind:?} {:?}",
        weight.kind(),
        weight.size(),
        weight.device(),
        input.size()
    );
    let n = weight.size()[0];
    ensure!(
        weight.size()[1] == k,
        "a weight of {:?} for inputs of {k} channels",
        weight.size()
    );
    if rows == 0 {
        return Ok(Tensor::empty([0, n], (kind, input.device())));
    }
    ensure!(
        fits(rows, weight),
        "no decode linear kernel for {rows} rows through a {kind:?} weight of {:?} (at most \
         {MAX_ROWS} rows; contiguous, 16-byte aligned rows)",
        weight.size()
    );
    // Contiguous and aligned copies of what is not (the kernel reads rows as 16-byte loads).
    let ready = |t: &Tensor, shape: &[i64], what: &str| kernel_input(t, shape, input, what);
    let x = ready(input, &[rows, k], "input")?;
    let mut flags = 0;
    let (gamma, beta, eps) = match norm {
        None => (None, None, 0.0),
        Some(norm) => {
            let prologue = norm.prologue(input)?;
            flags |= prologue.flags;
            (Some(prologue.gamma), prologue.beta, norm.eps as f32)
        }
    };
    let bias = epilogue.bias.map(|b| ready(b, &[n], "bias")).transpose()?;
    if bias.is_some() {
        flags |= ADD_BIAS;
    }
    flags |= match epilogue.gelu {
        None => 0,
        Some(Gelu::Tanh) => GELU_TANH,
        Some(Gelu::Erf) => GELU_ERF,
    };
    let residual = epilogue
        .residual
        .map(|r| ready(r, &[rows, n], "residual"))
        .transpose()?;
    if residual.is_some() {
        flags |= ADD_RESIDUAL;
    }
    let out = Tensor::empty([rows, n], (kind, input.device()));
    let dtype = dtype_name(kind)?;
    // The kernel of the fewest rows that holds them.
    let template_rows = template_rows(rows);
    let columns_per_warp = if template_rows <= 2 { 1 } else { 2 };
    let module = kernels(&SOURCE, device)?;
    let element = kind.elt_size_in_bytes() as i64;
    // The cached kernel always stages its input (its shared memory has room for it) and takes
    // its columns per block as one more argument.
    let (function, blocks, shared_bytes, mut columns) =
        match CachedLayout::of(module, template_rows, k, n, element) {
            Some(cached) => {
                flags |= STAGE_INPUT;
                (
                    format!("decode_gemv_{dtype}_{template_rows}_cached"),
                    cached.blocks,
                    cached.shared_bytes,
                    Some(cached.columns),
                )
            }
            None => {
                let staged_bytes = rows * k * element;
                let staged = staged_bytes <= MAX_STAGED_BYTES;
                if staged {
                    flags |= STAGE_INPUT;
                }
                let per_block = (WARPS * columns_per_warp) as i64;
                let function = format!("decode_gemv_{dtype}_{template_rows}");
                let shared_bytes = if staged { staged_bytes as u32 } else { 0 };
                // One wave of blocks, striding over the columns: a language-model head has
                // thousands of column groups, and a block per group would run in many waves,
                // each staging and norming the input again.
                let resident = module.resident_blocks(&function, 32 * WARPS, shared_bytes)?;
                let wave = i64::from(module.multiprocessors) * i64::from(resident);
                let blocks = ((n + per_block - 1) / per_block).min(wave);
                (function, blocks as u32, shared_bytes, None)
            }
        };
    let pointer = |t: Option<&Tensor>| t.map_or(0u64, |t| t.data_ptr() as u64);
    let (mut x_ptr, mut w_ptr, mut out_ptr) = (
        pointer(Some(&x)),
        pointer(Some(weight)),
        pointer(Some(&out)),
    );
    let (mut gamma_ptr, mut beta_ptr, mut bias_ptr, mut residual_ptr) = (
        pointer(gamma.as_ref()),
        pointer(beta.as_ref()),
        pointer(bias.as_ref()),
        pointer(residual.as_ref()),
    );
    let (mut rows_arg, mut k_arg, mut n_arg, mut flags_arg, mut eps_arg) =
        (rows as i32, k as i32, n as i32, flags, eps);
    let mut args = vec![
        kernel_arg(&mut x_ptr),
        kernel_arg(&mut w_ptr),
        kernel_arg(&mut out_ptr),
        kernel_arg(&mut gamma_ptr),
        kernel_arg(&mut beta_ptr),
        kernel_arg(&mut bias_ptr),
        kernel_arg(&mut residual_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut k_arg),
        kernel_arg(&mut n_arg),
        kernel_arg(&mut flags_arg),
        kernel_arg(&mut eps_arg),
    ];
    if let Some(columns) = columns.as_mut() {
        args.push(kernel_arg(columns));
    }
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // counts and flags as i32, eps as f32); every tensor is on the device, contiguous, of the
    // shape checked above, the ones read in 16-byte loads aligned with rows of whole loads
    // (`fits`, `ready`); null pointers only where the flags say the kernel does not read them;
    // the shared memory holds what the kernel puts there (`CachedLayout`, `MAX_STAGED_BYTES`).
    // Copies dropped here return to the caching allocator, which reuses them only for work
    // queued on the stream after the kernel. The kernel waits for the previous one before it
    // reads anything but the weight, the bias and the norm's weights, and writes only after
    // that wait.
    unsafe {
        module.launch_overlapping(
            &function,
            (blocks, 1, 1),
            (32 * WARPS, 1, 1),
            shared_bytes,
            &mut args,
        )?;
    }
    Ok(out)
}

/// What [`decode_linear`] computes, with libtorch's operations (the unfused layers' math).
pub fn reference_linear(
    input: &Tensor,
    weight: &Tensor,
    norm: Option<&InputNorm>,
    epilogue: &Epilogue,
) -> Tensor {
    let normed = norm.map_or_else(|| input.shallow_clone(), |norm| norm.apply(input));
    let product = normed.linear(weight, epilogue.bias);
    let activated = match epilogue.gelu {
        None => product,
        Some(Gelu::Tanh) => product.gelu("tanh"),
        Some(Gelu::Erf) => product.gelu("none"),
    };
    match epilogue.residual {
        Some(residual) => residual + activated,
        None => activated,
    }
}

/// Whether `got` is within `absolute + relative · |want|` of `want` everywhere: the largest
/// excess, 0 when within.
pub fn excess_difference(got: &Tensor, want: &Tensor, absolute: f64, relative: f64) -> f64 {
    let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    ((got - &want).abs() - want.abs() * relative - absolute)
        .clamp_min(0.0)
        .max()
        .double_value(&[])
}

/// The tolerances ([`excess_difference`]) of the kernels against [`reference_linear`] in
/// `kind`: the two round to the same format, a unit in the last place or so apart, with
/// products of `K ≤ 8192` summed in another order.
pub fn tolerance(kind: Kind) -> (f64, f64) {
    match kind {
        Kind::Float => (1e-4, 1e-4),
        Kind::Half => (4e-3, 4.0 / 1024.0),
        _ => (3e-2, 4.0 / 128.0),
    }
}

/// Runs the kernels on CUDA device `device` in `kind` on small made-up inputs, each prologue
/// and epilogue once, and compares them with [`reference_linear`]: a launch or a result that
/// goes wrong is an error here, before any request depends on them. Draws no random numbers
/// (seeded sampling must not depend on whether it ran).
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let inputs = super::self_check_inputs(kind, cuda);
    let (absolute, relative) = tolerance(kind);
    struct Case {
        rows: i64,
        k: i64,
        n: i64,
        norm: Option<Normalization>,
        one_plus: bool,
        bias: bool,
        gelu: Option<Gelu>,
        residual: bool,
    }
    let cases = [
        Case {
            rows: 1,
            k: 256,
            n: 77,
            norm: Some(Normalization::LayerNorm),
            one_plus: false,
            bias: true,
            gelu: Some(Gelu::Tanh),
            residual: false,
        },
        Case {
            rows: 3,
            k: 512,
            n: 40,
            norm: Some(Normalization::RMSNorm),
            one_plus: true,
            bias: false,
            gelu: Some(Gelu::Erf),
            residual: false,
        },
        Case {
            rows: 8,
            k: 128,
            n: 200,
            norm: None,
            one_plus: false,
            bias: true,
            gelu: None,
            residual: true,
        },
        Case {
            rows: 5,
            k: 64,
            n: 33,
            norm: Some(Normalization::LayerNorm),
            one_plus: true,
            bias: true,
            gelu: None,
            residual: true,
        },
    ];
    for Case {
        rows,
        k,
        n,
        norm: norm_kind,
        one_plus,
        bias,
        gelu,
        residual,
    } in cases
    {
        let input = inputs(&[rows, k], 0.37, 2.0);
        let weight = inputs(&[n, k], 0.11, 1.0 / (k as f64).sqrt());
        let gamma = inputs(&[k], 0.7, 0.5) + if one_plus { 0.0 } else { 1.0 };
        let beta = inputs(&[k], 0.3, 0.1);
        let bias_tensor = inputs(&[n], 0.9, 0.2);
        let residual_tensor = inputs(&[rows, n], 0.23, 1.0);
        let norm = norm_kind.map(|kind| InputNorm {
            kind,
            weight: &gamma,
            bias: (kind == Normalization::LayerNorm).then_some(&beta),
            eps: 1e-5,
            one_plus,
        });
        let epilogue = Epilogue {
            bias: bias.then_some(&bias_tensor),
            gelu,
            residual: residual.then_some(&residual_tensor),
        };
        let got = decode_linear(&input, &weight, norm.as_ref(), &epilogue)?;
        let want = reference_linear(&input, &weight, norm.as_ref(), &epilogue);
        let excess = excess_difference(&got, &want, absolute, relative);
        ensure!(
            excess == 0.0,
            "the decode linear kernels' self-check ({kind:?}, {rows} rows, K {k}, N {n}) is off \
             by {excess} beyond the tolerance"
        );
    }
    Ok(())
}
