//! The residual add and the norm that follows it in one kernel, forward and backward, for
//! training on CUDA devices (what Transformer Engine fuses for Megatron):
//! - forward `(residual, delta) → (sum, norm(sum))`, keeping each row's mean and reciprocal
//!   standard deviation in float32 for backward: one read of both inputs and one write of both
//!   outputs, where libtorch adds in one kernel and normalises in another;
//! - backward `(grad of the norm's output, grad of the sum) → grad_input`, the norm's input
//!   gradient plus the sum's (the gradient of both `residual` and `delta`), so no separate add
//!   of the two gradients; and the gamma/beta gradients without another pass over the
//!   activations: each block adds up its rows' contributions in registers and writes one
//!   partial row, and a second kernel adds the partial rows in block order. Both sums run in a
//!   fixed order, so the same inputs give the same bits run after run.
//!
//! A row of `hidden` elements is read as 8-element vectors (16 bytes of bf16/fp16, 32 of
//! float32) by a group of threads that keeps it in registers; a block holds several such row
//! groups. LayerNorm and RMSNorm, with `--apply-layernorm-1p`'s gamma = 1 + w, bf16, fp16 and
//! float32 activations with parameters of the same dtype, hidden sizes that are multiples of 8
//! up to [`MAX_HIDDEN`].
//!
//! The arithmetic follows libtorch's unfused path (`InputNorm::apply`): the sum rounded to the
//! activation dtype before the norm reads it; LayerNorm as ATen's vectorized kernel,
//! `gamma · (rstd · (x − mean)) + beta` in float32 with `rstd = rsqrt(var + eps)`; RMSNorm as
//! ours, `round(round(x · rstd) · gamma)`, with 1 + w rounded to the parameter dtype as the
//! unfused `weight + 1` is. What differs: the mean and variance are two exact passes over the
//! registers, summed in another order than ATen's Welford (the last bits of the statistics
//! differ); the input gradient is computed in float32 throughout, where the unfused RMSNorm
//! rounds `grad · gamma` to the activation dtype first; the gamma/beta gradients are summed in
//! another order (float32 either way).

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::decode_gemv::InputNorm;
use super::Normalization;
use super::{
    ceil_div, contiguous_aligned, dtype_name, kernel_arg, passes_self_check, relative_error,
    turned_off, COLUMN_TOTAL_GROUPS,
};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Set to `0`, the environment variable that keeps the residual adds and norms of training on
/// libtorch's separate kernels (Megatron has no flag for this).
pub const VARIABLE: &str = "MEGATRON_RS_FUSED_ADD_NORM";

/// The widest row the kernels take: 4 vectors of 8 elements in each of 256 threads.
pub const MAX_HIDDEN: i64 = 8192;

/// Elements per vector access.
const VEC: i64 = 8;

/// Threads per block of the forward and backward kernels (row groups × threads per row).
const BLOCK_THREADS: i64 = 256;

/// The backward kernel gives each row group at least this many rows, and more when that keeps
/// the partial gamma/beta rows under [`MAX_PARTIALS`].
const MIN_ROWS_PER_GROUP: i64 = 8;
const MAX_PARTIALS: i64 = 512;

/// The kernels' CUDA source (`lib/kernels/cuda/add_norm.cu`).
pub const SOURCE: KernelSource = KernelSource {
    name: "add_norm",
    source: include_str!("../../cuda/add_norm.cu"),
    headers: super::HEADERS,
    functions: &[
        "add_norm_forward_bf16_1",
        "add_norm_forward_bf16_2",
        "add_norm_forward_bf16_4",
        "add_norm_forward_f16_1",
        "add_norm_forward_f16_2",
        "add_norm_forward_f16_4",
        "add_norm_forward_f32_1",
        "add_norm_forward_f32_2",
        "add_norm_forward_f32_4",
        "add_norm_backward_bf16_1",
        "add_norm_backward_bf16_2",
        "add_norm_backward_bf16_4",
        "add_norm_backward_f16_1",
        "add_norm_backward_f16_2",
        "add_norm_backward_f16_4",
        "add_norm_backward_f32_1",
        "add_norm_backward_f32_2",
        "add_norm_backward_f32_4",
        "add_norm_param_grad_bf16",
        "add_norm_param_grad_f16",
        "add_norm_param_grad_f32",
        "column_totals_into_main",
    ],
    prefer_shared_memory: false,
};

/// Whether the kernels take activations (and norm parameters) of `kind` with rows of `hidden`.
pub fn supports(kind: Kind, hidden: i64) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half | Kind::Float)
        && hidden > 0
        && hidden % VEC == 0
        && hidden <= MAX_HIDDEN
}

/// How the kernels lay a row of `hidden` elements over a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowLayout {
    /// Vectors of 8 elements each thread holds: 1, 2 or 4.
    pub vectors_per_thread: i64,
    /// Threads of a row group (`blockDim.x`), a multiple of 32.
    pub threads: i64,
    /// Row groups of a block (`blockDim.y`).
    pub groups: i64,
}

impl RowLayout {
    /// The layout for rows of `hidden` elements ([`supports`] must hold): the fewest vectors per
    /// thread that fit the row in [`BLOCK_THREADS`] threads, and as many row groups as fit
    /// beside it.
    pub fn new(hidden: i64) -> RowLayout {
        let vectors = hidden / VEC;
        let vectors_per_thread = [1, 2, 4]
            .into_iter()
            .find(|per| ceil_div(vectors, *per) <= BLOCK_THREADS)
            .unwrap_or(4);
        let threads = ceil_div(ceil_div(vectors, vectors_per_thread), 32) * 32;
        RowLayout {
            vectors_per_thread,
            threads,
            groups: (BLOCK_THREADS / threads).max(1),
        }
    }

    /// Rows per block of the backward kernel over `rows` rows: a multiple of the row groups,
    /// each group taking at least [`MIN_ROWS_PER_GROUP`] rows and enough that there are at most
    /// [`MAX_PARTIALS`] blocks. A function of the shape alone, so the order in which the
    /// gamma/beta gradients are summed is too.
    pub fn backward_rows_per_block(&self, rows: i64) -> i64 {
        let per_group = ceil_div(ceil_div(rows, self.groups), MAX_PARTIALS).max(MIN_ROWS_PER_GROUP);
        per_group * self.groups
    }
}

/// `tensor` contiguous and 16-byte aligned (copied where it is not), checked to be `kind` with
/// `shape` on `device`.
fn ready(tensor: &Tensor, kind: Kind, shape: &[i64], device: Device, what: &str) -> Result<Tensor> {
    ensure!(
        tensor.kind() == kind && tensor.size() == shape && tensor.device() == device,
        "the fused add + norm got {what} of {:?} {:?} on {:?}; expected {kind:?} {shape:?} on \
         {device:?}",
        tensor.kind(),
        tensor.size(),
        tensor.device()
    );
    Ok(contiguous_aligned(tensor))
}

/// The norm's shape, dtype and device as the kernels need them: `(device index, hidden)`.
fn check_norm(norm: &InputNorm, kind: Kind, device: Device) -> Result<(usize, i64)> {
    let Device::Cuda(index) = device else {
        bail!("the fused add + norm runs on CUDA devices, not {device:?}");
    };
    ensure!(
        norm.weight.dim() == 1,
        "the norm's weight is {:?}; expected one dimension",
        norm.weight.size()
    );
    let hidden = norm.weight.size()[0];
    ensure!(
        supports(kind, hidden),
        "no fused add + norm kernel for {kind:?} rows of {hidden} (a multiple of {VEC} up to \
         {MAX_HIDDEN})"
    );
    ensure!(
        (norm.kind == Normalization::LayerNorm) == norm.bias.is_some(),
        "LayerNorm has a bias and RMSNorm none"
    );
    Ok((index, hidden))
}

/// Dropout of `delta` inside the kernels, before the add (where Megatron's bias-dropout-add
/// fusion drops it out): an element is dropped with probability `p` and the others are scaled by
/// `1 / (1 − p)`, as libtorch's dropout does, but the mask comes from a counter-based hash of
/// `seed` and the element's index (rounds of a 32-bit mixer, 24 bits compared with p · 2²⁴), so
/// backward draws it again instead of storing and reading a mask. `seed` is int64 `[1]` on
/// the device, drawn from libtorch's generator ([`Dropout::draw`]): seeded runs repeat, and CUDA
/// graphs replay a new seed each time.
pub struct Dropout {
    pub p: f64,
    pub seed: Tensor,
}

impl Dropout {
    /// Dropout with probability `p` (`0 < p < 1`) and a seed drawn from the current generator of
    /// `device`.
    pub fn draw(p: f64, device: Device) -> Result<Dropout> {
        ensure!(
            p > 0.0 && p < 1.0,
            "the fused dropout takes probabilities in (0, 1), not {p}"
        );
        let seed = Tensor::empty([1], (Kind::Int64, device)).f_random_()?;
        Ok(Dropout { p, seed })
    }

    /// The kernels' arguments: the seed's address, the drop threshold of the hash's 24 bits and
    /// the scale of kept elements.
    fn arguments(&self, device: Device) -> Result<(u64, u32, f32)> {
        ensure!(
            self.p > 0.0 && self.p < 1.0,
            "the fused dropout takes probabilities in (0, 1), not {}",
            self.p
        );
        ensure!(
            self.seed.kind() == Kind::Int64
                && self.seed.numel() == 1
                && self.seed.device() == device,
            "the fused dropout's seed is {:?} {:?} on {:?}; expected one int64 on {device:?}",
            self.seed.kind(),
            self.seed.size(),
            self.seed.device()
        );
        let threshold = (self.p * (1u32 << 24) as f64).round() as u32;
        Ok((
            self.seed.data_ptr() as u64,
            threshold,
            (1.0 / (1.0 - self.p)) as f32,
        ))
    }
}

impl Clone for Dropout {
    fn clone(&self) -> Dropout {
        Dropout {
            p: self.p,
            seed: self.seed.shallow_clone(),
        }
    }
}

/// The kernels' dropout arguments: a null seed when there is none.
fn dropout_arguments(dropout: Option<&Dropout>, device: Device) -> Result<(u64, u32, f32)> {
    dropout.map_or(Ok((0, 0, 1.0)), |d| d.arguments(device))
}

/// What the forward kernel keeps for backward: the sum (shaped like the inputs), each row's
/// float32 mean (0 for RMSNorm) and reciprocal standard deviation, `[rows]`, and the dropout
/// of `delta`, if any.
pub struct Saved {
    pub sum: Tensor,
    pub mean: Tensor,
    pub rstd: Tensor,
    pub dropout: Option<Dropout>,
}

/// What the forward kernel gives: the sum's norm and what backward needs, the sum included.
pub struct Forward {
    pub normed: Tensor,
    pub saved: Saved,
}

/// `residual + delta` and its norm, in one kernel on libtorch's current stream, with `delta`
/// dropped out first under `dropout`. Both inputs are `[..., hidden]` of the norm's dtype on
/// one CUDA device.
pub fn forward(
    residual: &Tensor,
    delta: &Tensor,
    norm: &InputNorm,
    dropout: Option<Dropout>,
) -> Result<Forward> {
    let (kind, device, shape) = (residual.kind(), residual.device(), residual.size());
    let (index, hidden) = check_norm(norm, kind, device)?;
    ensure!(
        shape.last() == Some(&hidden),
        "the fused add + norm got rows of {shape:?} for a norm over {hidden}"
    );
    let rows = residual.numel() as i64 / hidden;
    let residual = ready(residual, kind, &shape, device, "a residual")?;
    let delta = ready(delta, kind, &shape, device, "a delta")?;
    let weight = ready(norm.weight, kind, &[hidden], device, "a weight")?;
    let bias = norm
        .bias
        .map(|b| ready(b, kind, &[hidden], device, "a bias"))
        .transpose()?;
    let sum = Tensor::empty(shape.as_slice(), (kind, device));
    let normed = Tensor::empty(shape.as_slice(), (kind, device));
    let mean = Tensor::empty([rows], (Kind::Float, device));
    let rstd = Tensor::empty([rows], (Kind::Float, device));
    let (mut seed_ptr, mut threshold, mut scale) = dropout_arguments(dropout.as_ref(), device)?;
    if rows > 0 {
        let layout = RowLayout::new(hidden);
        let blocks = ceil_div(rows, layout.groups);
        ensure!(
            blocks <= i32::MAX as i64,
            "{rows} rows are more blocks than one launch takes"
        );
        let module = kernels(&SOURCE, index)?;
        let function = format!(
            "add_norm_forward_{}_{}",
            dtype_name(kind)?,
            layout.vectors_per_thread
        );
        let [mut residual_ptr, mut delta_ptr, mut weight_ptr, mut sum_ptr, mut normed_ptr, mut mean_ptr, mut rstd_ptr] =
            [&residual, &delta, &weight, &sum, &normed, &mean, &rstd].map(|t| t.data_ptr() as u64);
        let mut bias_ptr = bias.as_ref().map_or(0u64, |b| b.data_ptr() as u64);
        let (mut rows_arg, mut hidden_arg, mut eps) = (rows, hidden as i32, norm.eps as f32);
        let mut rms = i32::from(norm.kind == Normalization::RMSNorm);
        let mut one_plus = i32::from(norm.one_plus);
        let mut args = [
            kernel_arg(&mut residual_ptr),
            kernel_arg(&mut delta_ptr),
            kernel_arg(&mut weight_ptr),
            kernel_arg(&mut bias_ptr),
            kernel_arg(&mut sum_ptr),
            kernel_arg(&mut normed_ptr),
            kernel_arg(&mut mean_ptr),
            kernel_arg(&mut rstd_ptr),
            kernel_arg(&mut rows_arg),
            kernel_arg(&mut hidden_arg),
            kernel_arg(&mut eps),
            kernel_arg(&mut rms),
            kernel_arg(&mut one_plus),
            kernel_arg(&mut seed_ptr),
            kernel_arg(&mut threshold),
            kernel_arg(&mut scale),
        ];
        // SAFETY: the arguments match the kernel's parameters in order and type (pointers as
        // u64, rows as i64, the hidden size and flags as i32, the threshold as u32, eps and the
        // scale as f32); the seed is null or one int64 on this device; the activations are
        // contiguous, 16-byte aligned [rows, hidden] of the kernel's dtype (hidden a multiple
        // of 8, so every row starts aligned), the weight and bias [hidden], mean and rstd
        // float32 [rows], all on this device; the grid covers the rows and the layout's
        // threads the row's vectors. Memory the caching allocator gets back (copies dropped
        // here) is reused only by work queued on this stream after the kernel.
        unsafe {
            module.launch(
                &function,
                (blocks as u32, 1, 1),
                (layout.threads as u32, layout.groups as u32, 1),
                &mut args,
            )?;
        }
    }
    Ok(Forward {
        normed,
        saved: Saved {
            sum,
            mean,
            rstd,
            dropout,
        },
    })
}

/// The gradients of [`forward`]'s inputs: the sum's (the norm's input gradient plus the
/// sum's own), which is `residual`'s, and `delta`'s, the same tensor unless `delta` was dropped
/// out.
pub struct InputGrads {
    pub residual: Tensor,
    pub delta: Tensor,
}

/// What the backward kernels give: the inputs' gradients, and those of the norm's weight and
/// (LayerNorm) bias in their dtype.
pub struct Grads {
    pub inputs: InputGrads,
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

/// The gradients of [`forward`] from those of its `normed` and `sum` outputs, given what it
/// saved (`sum`, `mean`, `rstd`) and the same norm.
pub fn backward(
    grad_normed: &Tensor,
    grad_sum: &Tensor,
    saved: &Saved,
    norm: &InputNorm,
) -> Result<Grads> {
    let (inputs, params) = run_backward(grad_normed, grad_sum, saved, norm, None)?;
    let (weight, bias) = params.expect("asked for the parameters' gradients");
    Ok(Grads {
        inputs,
        weight,
        bias,
    })
}

/// The optimizer's float32 gradients of a norm's weight and (LayerNorm) bias, `[hidden]`.
pub struct MainGrads<'a> {
    pub weight: &'a Tensor,
    pub bias: Option<&'a Tensor>,
}

/// Like [`backward`], with the weight and bias gradients added in float32 to `main` instead of
/// returned in the parameters' dtype; gives the inputs' gradients.
pub fn backward_into(
    grad_normed: &Tensor,
    grad_sum: &Tensor,
    saved: &Saved,
    norm: &InputNorm,
    main: MainGrads,
) -> Result<InputGrads> {
    Ok(run_backward(grad_normed, grad_sum, saved, norm, Some(main))?.0)
}

/// The inputs' gradients and, without `main`, the parameters' gradients.
#[allow(clippy::type_complexity)]
fn run_backward(
    grad_normed: &Tensor,
    grad_sum: &Tensor,
    saved: &Saved,
    norm: &InputNorm,
    main: Option<MainGrads>,
) -> Result<(InputGrads, Option<(Tensor, Option<Tensor>)>)> {
    let (kind, device, shape) = (saved.sum.kind(), saved.sum.device(), saved.sum.size());
    let (index, hidden) = check_norm(norm, kind, device)?;
    let rows = saved.sum.numel() as i64 / hidden;
    // Gradients may arrive in another dtype or layout than the outputs.
    let as_output = |grad: &Tensor, what: &str| {
        ensure!(
            grad.size() == shape,
            "the gradient of the fused add + norm's {what} is {:?}; expected {shape:?}",
            grad.size()
        );
        ready(&grad.to_kind(kind), kind, &shape, device, what)
    };
    let grad_normed = as_output(grad_normed, "normed output")?;
    let grad_sum = as_output(grad_sum, "sum")?;
    let sum = ready(&saved.sum, kind, &shape, device, "a saved sum")?;
    let weight = ready(norm.weight, kind, &[hidden], device, "a weight")?;
    for (what, stat) in [("mean", &saved.mean), ("rstd", &saved.rstd)] {
        ensure!(
            stat.kind() == Kind::Float && stat.size() == [rows] && stat.is_contiguous(),
            "the fused add + norm's saved {what} is {:?} {:?}; expected float32 [{rows}]",
            stat.kind(),
            stat.size()
        );
    }
    let grad_input = Tensor::empty(shape.as_slice(), (kind, device));
    let grad_delta = match &saved.dropout {
        Some(_) => Tensor::empty(shape.as_slice(), (kind, device)),
        None => grad_input.shallow_clone(),
    };
    let (mut seed_ptr, mut threshold, mut scale) =
        dropout_arguments(saved.dropout.as_ref(), device)?;
    let mut grad_delta_ptr = match &saved.dropout {
        Some(_) => grad_delta.data_ptr() as u64,
        None => 0,
    };
    let inputs = InputGrads {
        residual: grad_input.shallow_clone(),
        delta: grad_delta,
    };
    if let Some(main) = &main {
        for (what, target) in [("weight", Some(main.weight)), ("bias", main.bias)] {
            if let Some(target) = target {
                ensure!(
                    target.kind() == Kind::Float
                        && target.size() == [hidden]
                        && target.is_contiguous()
                        && target.device() == device,
                    "the main gradient of the norm's {what} is {:?} {:?}; expected float32 \
                     [{hidden}] on {device:?}",
                    target.kind(),
                    target.size()
                );
            }
        }
        ensure!(
            main.bias.is_some() == norm.bias.is_some(),
            "the norm's bias and its main gradient come together"
        );
    }
    // Without `main`, the parameters' gradients in their dtype.
    let new_grads = main.is_none().then(|| {
        let new = || Tensor::empty([hidden], (kind, device));
        (new(), norm.bias.is_some().then(new))
    });
    if rows == 0 {
        let zeroed =
            new_grads.map(|(mut weight, bias)| (weight.zero_(), bias.map(|mut b| b.zero_())));
        return Ok((inputs, zeroed));
    }
    let layout = RowLayout::new(hidden);
    let rows_per_block = layout.backward_rows_per_block(rows);
    let blocks = ceil_div(rows, rows_per_block);
    let partial_gamma = Tensor::empty([blocks, hidden], (Kind::Float, device));
    let partial_beta = norm
        .bias
        .is_some()
        .then(|| Tensor::empty([blocks, hidden], (Kind::Float, device)));
    let suffix = dtype_name(kind)?;
    let module = kernels(&SOURCE, index)?;
    let [mut grad_normed_ptr, mut grad_sum_ptr, mut sum_ptr, mut mean_ptr, mut rstd_ptr, mut weight_ptr, mut grad_input_ptr, mut gamma_ptr] =
        [
            &grad_normed,
            &grad_sum,
            &sum,
            &saved.mean,
            &saved.rstd,
            &weight,
            &grad_input,
            &partial_gamma,
        ]
        .map(|t| t.data_ptr() as u64);
    let mut beta_ptr = partial_beta.as_ref().map_or(0u64, |t| t.data_ptr() as u64);
    let (mut rows_arg, mut hidden_arg) = (rows, hidden as i32);
    let mut rows_per_block_arg = i32::try_from(rows_per_block)
        .context("too many rows for the fused add + norm's backward")?;
    let mut rms = i32::from(norm.kind == Normalization::RMSNorm);
    let mut one_plus = i32::from(norm.one_plus);
    let mut args = [
        kernel_arg(&mut grad_normed_ptr),
        kernel_arg(&mut grad_sum_ptr),
        kernel_arg(&mut sum_ptr),
        kernel_arg(&mut mean_ptr),
        kernel_arg(&mut rstd_ptr),
        kernel_arg(&mut weight_ptr),
        kernel_arg(&mut grad_input_ptr),
        kernel_arg(&mut gamma_ptr),
        kernel_arg(&mut beta_ptr),
        kernel_arg(&mut rows_arg),
        kernel_arg(&mut hidden_arg),
        kernel_arg(&mut rows_per_block_arg),
        kernel_arg(&mut rms),
        kernel_arg(&mut one_plus),
        kernel_arg(&mut grad_delta_ptr),
        kernel_arg(&mut seed_ptr),
        kernel_arg(&mut threshold),
        kernel_arg(&mut scale),
    ];
    let (mut partial_gamma_ptr, mut partial_beta_ptr) = (gamma_ptr, beta_ptr);
    let (mut blocks_arg, mut columns_arg) = (blocks, hidden as i32);
    let (weight_out, bias_out) = match (&main, &new_grads) {
        (Some(main), _) => (main.weight, main.bias),
        (None, Some((weight, bias))) => (weight, bias.as_ref()),
        (None, None) => unreachable!("new gradients are made without main ones"),
    };
    let mut grad_weight_ptr = weight_out.data_ptr() as u64;
    let mut grad_bias_ptr = bias_out.map_or(0u64, |t| t.data_ptr() as u64);
    let mut param_args = [
        kernel_arg(&mut partial_gamma_ptr),
        kernel_arg(&mut partial_beta_ptr),
        kernel_arg(&mut blocks_arg),
        kernel_arg(&mut columns_arg),
        kernel_arg(&mut grad_weight_ptr),
        kernel_arg(&mut grad_bias_ptr),
    ];
    let param_grids = if norm.bias.is_some() { 2 } else { 1 };
    let param_kernel = match main {
        Some(_) => "column_totals_into_main".to_string(),
        None => format!("add_norm_param_grad_{suffix}"),
    };
    // SAFETY: the arguments match the kernels' parameters in order and type (pointers as u64,
    // rows and the block count as i64, the hidden size, rows per block and flags as i32, the
    // threshold as u32, the scale as f32); the activations and gradients (grad_delta too, when
    // the seed, one int64 on this device, is not null) are contiguous, 16-byte aligned
    // [rows, hidden] of the kernels' dtype, the weight [hidden], mean and rstd float32 [rows], the partial rows float32
    // [blocks, hidden] with blocks · rows_per_block >= rows (rows_per_block a multiple of the
    // row groups), the parameter gradients [hidden] (float32 main gradients for
    // `column_totals_into_main`, checked above); the bias pointers are null exactly when
    // there is no bias (then one grid row of the second kernel). All live on this device until
    // the kernels have run: memory returned to the caching allocator is reused only by work
    // queued after them on this stream.
    unsafe {
        module.launch(
            &format!("add_norm_backward_{suffix}_{}", layout.vectors_per_thread),
            (blocks as u32, 1, 1),
            (layout.threads as u32, layout.groups as u32, 1),
            &mut args,
        )?;
        module.launch(
            &param_kernel,
            (ceil_div(hidden, 32) as u32, param_grids, 1),
            (32, COLUMN_TOTAL_GROUPS, 1),
            &mut param_args,
        )?;
    }
    Ok((inputs, new_grads))
}

/// Whether the fused add + norm should run for `kind` activations with rows of `hidden` on
/// `device`: a CUDA device, a width and dtype the kernels take ([`supports`]), [`VARIABLE`] not
/// `0`, and [`self_check`] passed there at that width (checked once per device, dtype and
/// width; a failure is reported once and the unfused ops are used).
pub fn usable_on(device: Device, kind: Kind, hidden: i64) -> bool {
    let Device::Cuda(index) = device else {
        return false;
    };
    supports(kind, hidden)
        && !turned_off(VARIABLE)
        && passes_self_check(
            "the fused residual add + norm",
            device,
            kind,
            hidden,
            "separate kernels",
            || self_check(index, kind, hidden),
        )
}

/// The tolerance [`self_check`] allows for `kind`: a few units in the last place of the
/// largest value.
fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Float => 1e-4,
        _ => 2e-2,
    }
}

/// Runs the kernels on CUDA device `device` in `kind` on 37 made-up rows of `hidden`
/// (LayerNorm, and RMSNorm with gamma = 1 + w; LayerNorm again with dropout 0.5 under a fixed
/// seed, so the check draws nothing from the generator) and compares outputs and gradients with
/// libtorch's unfused ops (under the kernels' mask): a launch or a result that goes wrong is an
/// error here, before training depends on the kernels.
pub fn self_check(device: usize, kind: Kind, hidden: i64) -> Result<()> {
    let cuda = Device::Cuda(device);
    let rows = 37;
    let inputs = super::self_check_inputs(kind, cuda);
    let residual = inputs(&[rows, hidden], 0.37, 2.0);
    let delta = inputs(&[rows, hidden], 0.71, 0.5);
    let grad_normed = inputs(&[rows, hidden], 0.13, 1.0);
    let grad_sum = inputs(&[rows, hidden], 0.29, 0.3);
    let weight = inputs(&[hidden], 0.53, 0.5) + 1.0;
    let bias = inputs(&[hidden], 0.17, 0.2);
    let fixed_seed = Dropout {
        p: 0.5,
        seed: Tensor::from_slice(&[0x5eed_1234_abcd_i64]).to_device(cuda),
    };
    for (kind_of_norm, one_plus, dropout) in [
        (Normalization::LayerNorm, false, None),
        (Normalization::RMSNorm, true, None),
        (Normalization::LayerNorm, false, Some(fixed_seed)),
    ] {
        let norm = InputNorm {
            kind: kind_of_norm,
            weight: &weight,
            bias: (kind_of_norm == Normalization::LayerNorm).then_some(&bias),
            eps: 1e-5,
            one_plus,
        };
        let kept = match &dropout {
            Some(d) => {
                let mask = kept_mask(d, &[rows, hidden], &norm)?;
                let fraction = mask.mean(Kind::Float).double_value(&[]);
                ensure!(
                    (0.4..=0.6).contains(&fraction),
                    "dropout 0.5 kept {fraction:.3} of the elements"
                );
                Some((mask, d.p))
            }
            None => None,
        };
        let fused = forward(&residual, &delta, &norm, dropout)?;
        let grads = backward(&grad_normed, &grad_sum, &fused.saved, &norm)?;
        let dropped = kept.as_ref().map(|(mask, p)| (mask, *p));
        let want = unfused(&residual, &delta, &grad_normed, &grad_sum, &norm, dropped)?;
        let mut compared = vec![
            ("sum", &fused.saved.sum, &want.sum),
            ("normed output", &fused.normed, &want.normed),
            ("input gradient", &grads.inputs.residual, &want.input),
            ("delta gradient", &grads.inputs.delta, &want.delta),
            ("weight gradient", &grads.weight, &want.weight),
        ];
        if let (Some(got), Some(expected)) = (&grads.bias, &want.bias) {
            compared.push(("bias gradient", got, expected));
        }
        let what = if kept.is_some() { " with dropout" } else { "" };
        for (name, got, expected) in compared {
            let error = relative_error(got, expected);
            ensure!(
                error <= tolerance(kind),
                "the {kind_of_norm:?}{what} {name} differs from the unfused ops' by {error:.3e} \
                 (relative)"
            );
        }
    }
    Ok(())
}

/// The elements `dropout` keeps of a delta of `shape` (rows of the norm's width), as float32
/// ones (kept) and zeros (dropped): the kernel's sum of a zero residual and a delta of ones.
pub fn kept_mask(dropout: &Dropout, shape: &[i64], norm: &InputNorm) -> Result<Tensor> {
    let (kind, device) = (norm.weight.kind(), norm.weight.device());
    let zeros = Tensor::zeros(shape, (kind, device));
    let ones = Tensor::ones(shape, (kind, device));
    let out = forward(&zeros, &ones, norm, Some(dropout.clone()))?;
    Ok(out.saved.sum.ne(0.0).to_kind(Kind::Float))
}

/// What the unfused ops give for a fused add + norm, outputs and gradients, the reference the
/// self-check and the tests compare with.
pub struct Unfused {
    pub sum: Tensor,
    pub normed: Tensor,
    /// The residual's gradient (and the sum's).
    pub input: Tensor,
    pub delta: Tensor,
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

/// `sum = residual + delta` and `norm(sum)` through libtorch's autograd, and the gradients of
/// `Σ normed · grad_normed + Σ sum · grad_sum` for both summands and the norm's parameters.
/// With `dropped`, a [`kept_mask`] and its probability, `delta` is dropped out first as
/// libtorch's dropout computes it: kept elements scaled in float32 and rounded.
pub fn unfused(
    residual: &Tensor,
    delta: &Tensor,
    grad_normed: &Tensor,
    grad_sum: &Tensor,
    norm: &InputNorm,
    dropped: Option<(&Tensor, f64)>,
) -> Result<Unfused> {
    tch::with_grad(|| {
        let input = residual.detach().set_requires_grad(true);
        let delta = delta.detach().set_requires_grad(true);
        let weight = norm.weight.detach().set_requires_grad(true);
        let bias = norm.bias.map(|b| b.detach().set_requires_grad(true));
        let added = match dropped {
            Some((mask, p)) => {
                (delta.to_kind(Kind::Float) * mask * (1.0 / (1.0 - p))).to_kind(delta.kind())
            }
            None => delta.shallow_clone(),
        };
        let sum = &input + &added;
        let normed = InputNorm {
            weight: &weight,
            bias: bias.as_ref(),
            ..*norm
        }
        .apply(&sum);
        let mut inputs = vec![&input, &delta, &weight];
        inputs.extend(bias.as_ref());
        let grads = crate::autograd::grad(
            &[&normed, &sum],
            &[grad_normed, grad_sum],
            &inputs,
            false,
            false,
        )?;
        let mut grads = grads.into_iter().map(|g| g.context("an unused input"));
        let mut next = || grads.next().context("a missing gradient")?;
        Ok(Unfused {
            sum: sum.detach(),
            normed: normed.detach(),
            input: next()?,
            delta: next()?,
            weight: next()?,
            bias: match bias {
                Some(_) => Some(next()?),
                None => None,
            },
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_laid_over_blocks_of_256_threads() {
        let layout = |hidden| {
            let l = RowLayout::new(hidden);
            (l.vectors_per_thread, l.threads, l.groups)
        };
        assert_eq!(layout(64), (1, 32, 8));
        assert_eq!(layout(1000), (1, 128, 2));
        assert_eq!(layout(1024), (1, 128, 2));
        assert_eq!(layout(2048), (1, 256, 1));
        assert_eq!(layout(4096), (2, 256, 1));
        assert_eq!(layout(6144), (4, 192, 1));
        assert_eq!(layout(8192), (4, 256, 1));
        let l = RowLayout::new(1024);
        assert_eq!(l.backward_rows_per_block(8192), 16);
        assert_eq!(l.backward_rows_per_block(3), 16);
        // 2^20 rows in 2 groups: 1024 rows a group keeps 512 blocks.
        assert_eq!(l.backward_rows_per_block(1 << 20), 2048);
        assert_eq!(ceil_div(1 << 20, 2048), MAX_PARTIALS);
    }

    #[test]
    fn only_row_widths_of_whole_vectors_up_to_8192_are_fused() {
        assert!(
            supports(Kind::BFloat16, 1024)
                && supports(Kind::Half, 8)
                && supports(Kind::Float, 8192)
        );
        assert!(!supports(Kind::BFloat16, 1020) && !supports(Kind::BFloat16, 8200));
        assert!(!supports(Kind::Double, 1024) && !supports(Kind::BFloat16, 0));
        assert!(!usable_on(Device::Cpu, Kind::BFloat16, 1024));
    }
}
