//! The mixed-precision optimizer step in two kernels over the flat float32 buffers, instead of
//! ATen's multi-tensor kernels (a gradient norm of two passes, `_fused_adamw_` in launches of at
//! most 320 blocks, a copy into the half-precision model parameters and a fill of the gradient
//! buffer):
//! - the sum of squares of the gradients that count in the norm: a fixed grid of blocks, each
//!   adding up its chunks in float32, then one block adding the blocks' partial sums in a fixed
//!   order (float64), so the result is the same bits run after run;
//! - one AdamW launch over every segment, each block one chunk of at most [`CHUNK`] elements:
//!   it divides the gradient by the clipping divisor (a device scalar, so the host never waits
//!   for it), updates the float32 parameter and both moments with the arithmetic of ATen's fused
//!   AdamW, writes the bf16/fp16 model copy and zeroes the gradient it read.
//!
//! Segments are described by tables built once on the host ([`SquaresTable`], [`AdamwTable`]);
//! the kernels are compiled at run time ([`crate::runtime::nvrtc`]) and launched on libtorch's
//! current stream.

use std::ops::Range;

use anyhow::{bail, ensure, Result};
use tch::{Device, Kind, Tensor};

use super::multi_tensor::{foreach_copy_, fused_adamw, AdamwHyper};
use super::{kernel_arg, passes_self_check, turned_off};
use crate::runtime::nvrtc::{kernels, KernelSource};

/// Elements per chunk of a table, a multiple of 4 so that the chunks of a 16-byte aligned
/// segment stay aligned for the kernels' vector loads.
pub const CHUNK: usize = 16384;
const _: () = assert!(CHUNK.is_multiple_of(4));

/// Blocks of the first pass of the sum of squares (at most): a fixed number, so that how the
/// elements are summed depends on the table alone, never on the device.
const SQUARES_BLOCKS: usize = 1024;
const SQUARES_THREADS: u32 = 512;
const ADAMW_THREADS: u32 = 256;

/// The kernels' CUDA source (`lib/kernels/cuda/optimizer_kernels.cu`). The AdamW arithmetic is ATen's (`adam_math` in
/// `ATen/native/cuda/fused_adam_utils.cuh`, torch 2.11, ADAMW mode, no AMSGrad, no maximize):
/// the same float32 operations in the same order, with the same explicit `fma`s, compiled with
/// NVRTC's defaults (which are nvcc's: contraction on, IEEE division and square root), so that
/// the results are ATen's bits. Two things differ on purpose: the gradient divided by the
/// divisor is not written back (the gradient is zeroed instead, or left as it was), and the
/// model copy is rounded here (round to nearest even, as ATen's float→bf16/fp16 copy).
pub const SOURCE: KernelSource = KernelSource {
    name: "optimizer_kernels",
    source: include_str!("../../cuda/optimizer_kernels.cu"),
    headers: super::HEADERS,
    functions: &[
        "sum_squares_partial",
        "sum_squares_final",
        "adamw_bf16",
        "adamw_f16",
    ],
    prefer_shared_memory: false,
};

/// Set to `0`, the environment variable that keeps the optimizer step on ATen's multi-tensor
/// kernels instead of these (for benchmarks and comparisons).
pub const VARIABLE: &str = "MEGATRON_RS_OPTIMIZER_KERNELS";

/// Whether the AdamW kernel writes model copies of this dtype.
pub fn supports(model_kind: Kind) -> bool {
    matches!(model_kind, Kind::BFloat16 | Kind::Half)
}

/// Whether the step should run on these kernels for model parameters of `kind` on CUDA device
/// `device`: a dtype they take, [`VARIABLE`] not `0`, and [`self_check`] passed there (once per
/// device and dtype; a failure is reported once and ATen's multi-tensor kernels are used).
pub fn usable_on(device: usize, kind: Kind) -> bool {
    supports(kind)
        && !turned_off(VARIABLE)
        && passes_self_check(
            "the optimizer step's own kernels",
            Device::Cuda(device),
            kind,
            0,
            "ATen's multi-tensor kernels",
            || self_check(device, kind),
        )
}

/// `range` cut into chunks of at most [`CHUNK`] elements, each starting where the range starts
/// or a multiple of [`CHUNK`] after it.
fn chunks_of(range: &Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
    range
        .clone()
        .step_by(CHUNK)
        .map(move |start| start..(start + CHUNK).min(range.end))
}

/// A table of int64 rows on `device`; an empty table holds one unused element so that its
/// pointer is a real allocation.
fn device_table(rows: &[i64], device: Device) -> Tensor {
    if rows.is_empty() {
        Tensor::zeros([1], (Kind::Int64, device))
    } else {
        Tensor::from_slice(rows).to_device(device)
    }
}

fn cuda_index(tensor: &Tensor, what: &str) -> Result<usize> {
    match tensor.device() {
        Device::Cuda(index) => Ok(index),
        other => bail!("the optimizer kernels run on CUDA devices; {what} is on {other:?}"),
    }
}

/// The ranges of a float32 buffer whose squares [`sum_of_squares`] adds up, as chunks on the
/// device.
pub struct SquaresTable {
    chunks: Tensor,
    count: usize,
    /// One past the last element any chunk reads.
    end: usize,
}

impl SquaresTable {
    pub fn new(ranges: &[Range<usize>], device: Device) -> Self {
        let mut rows = Vec::new();
        let mut end = 0;
        for range in ranges {
            for chunk in chunks_of(range) {
                end = end.max(chunk.end);
                rows.extend([chunk.start as i64, chunk.len() as i64]);
            }
        }
        SquaresTable {
            count: rows.len() / 2,
            chunks: device_table(&rows, device),
            end,
        }
    }
}

/// The sum of the squares of `values` (float32, contiguous, on a CUDA device) over the ranges
/// of `table`, as a float32 scalar on the device; the same bits every time for the same values.
pub fn sum_of_squares(values: &Tensor, table: &SquaresTable) -> Result<Tensor> {
    let device = cuda_index(values, "the buffer")?;
    ensure!(
        values.kind() == Kind::Float && values.is_contiguous(),
        "the sum of squares reads a contiguous float32 buffer, not {:?}",
        values.kind()
    );
    ensure!(
        table.end <= values.numel() && table.chunks.device() == values.device(),
        "the sum-of-squares table reaches element {} of a buffer of {} on {:?}",
        table.end,
        values.numel(),
        values.device()
    );
    if table.count == 0 {
        return Ok(Tensor::zeros([], (Kind::Float, values.device())));
    }
    let out = Tensor::empty([], (Kind::Float, values.device()));
    let blocks = table.count.min(SQUARES_BLOCKS);
    let partials = Tensor::empty([blocks as i64], (Kind::Float, values.device()));
    let module = kernels(&SOURCE, device)?;
    let [mut values_ptr, mut chunks_ptr, mut partials_ptr, mut out_ptr] =
        [values, &table.chunks, &partials, &out].map(|t| t.data_ptr() as u64);
    let mut n_chunks = table.count as i64;
    let mut count = blocks as i32;
    // SAFETY: the arguments match the kernels' parameters in order and type (pointers as u64,
    // the chunk count as i64, the partial count as i32); every chunk lies inside `values`
    // (checked above), `partials` holds one float per block and `out` one float; all stay
    // alive until the kernels have run, as they are freed back to the caching allocator only
    // for work queued after them on this stream.
    unsafe {
        let mut first = [
            kernel_arg(&mut values_ptr),
            kernel_arg(&mut chunks_ptr),
            kernel_arg(&mut n_chunks),
            kernel_arg(&mut partials_ptr),
        ];
        module.launch(
            "sum_squares_partial",
            (blocks as u32, 1, 1),
            (SQUARES_THREADS, 1, 1),
            &mut first,
        )?;
        let mut second = [
            kernel_arg(&mut partials_ptr),
            kernel_arg(&mut count),
            kernel_arg(&mut out_ptr),
        ];
        module.launch(
            "sum_squares_final",
            (1, 1, 1),
            (SQUARES_THREADS, 1, 1),
            &mut second,
        )?;
    }
    Ok(out)
}

/// A piece of a parameter that one AdamW step updates: where its gradient and model copy lie
/// in the full buffers, and where its main parameter and moments lie in the shard buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamwSegment {
    pub buffer_start: usize,
    pub shard_start: usize,
    pub len: usize,
    /// Whether weight decay applies.
    pub decayed: bool,
}

/// The segments of an AdamW step, as chunks on the device.
pub struct AdamwTable {
    chunks: Tensor,
    count: usize,
    buffer_end: usize,
    shard_end: usize,
}

impl AdamwTable {
    pub fn new(segments: &[AdamwSegment], device: Device) -> Result<Self> {
        let mut rows = Vec::new();
        let (mut buffer_end, mut shard_end) = (0, 0);
        for segment in segments {
            let range = 0..segment.len;
            for chunk in chunks_of(&range) {
                rows.extend([
                    (segment.buffer_start + chunk.start) as i64,
                    (segment.shard_start + chunk.start) as i64,
                    chunk.len() as i64,
                    segment.decayed.into(),
                ]);
            }
            buffer_end = buffer_end.max(segment.buffer_start + segment.len);
            shard_end = shard_end.max(segment.shard_start + segment.len);
        }
        let count = rows.len() / 4;
        ensure!(
            count < i32::MAX as usize,
            "{count} chunks are more blocks than one launch takes"
        );
        Ok(AdamwTable {
            chunks: device_table(&rows, device),
            count,
            buffer_end,
            shard_end,
        })
    }
}

/// The buffers one AdamW step reads and writes: float32 main parameters and moments (shard
/// offsets), float32 gradients and the half-precision model parameters (buffer offsets); all
/// contiguous on one CUDA device.
pub struct AdamwBuffers<'a> {
    pub main: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub grads: &'a Tensor,
    pub model: &'a Tensor,
}

/// One AdamW step over the segments of `table`: gradients divided by `grad_divisor` when given
/// (a float32 scalar on the device), bias correction from `step` (a float32 tensor on the
/// device whose first element is the step count, already incremented), `hyper.weight_decay` on
/// decayed segments only. The model copies are written, and with `zero_grads` the gradients
/// read are zeroed. One launch, queued on the current stream; the host does not wait.
pub fn adamw(
    buffers: &AdamwBuffers,
    table: &AdamwTable,
    hyper: AdamwHyper,
    step: &Tensor,
    grad_divisor: Option<&Tensor>,
    zero_grads: bool,
) -> Result<()> {
    let AdamwBuffers {
        main,
        exp_avg,
        exp_avg_sq,
        grads,
        model,
    } = *buffers;
    let device = cuda_index(grads, "the gradient buffer")?;
    let function = match model.kind() {
        Kind::BFloat16 => "adamw_bf16",
        Kind::Half => "adamw_f16",
        other => bail!("the AdamW kernel writes bf16 or fp16 model parameters, not {other:?}"),
    };
    if table.count == 0 {
        return Ok(());
    }
    let float_buffers = [main, exp_avg, exp_avg_sq, grads];
    ensure!(
        float_buffers.iter().all(|t| t.kind() == Kind::Float)
            && float_buffers
                .iter()
                .chain([&model])
                .all(|t| t.is_contiguous() && t.device() == grads.device()),
        "the AdamW kernel needs contiguous float32 main parameters, moments and gradients and \
         the model parameters on one device"
    );
    ensure!(
        [exp_avg, exp_avg_sq]
            .iter()
            .all(|t| t.numel() == main.numel())
            && model.numel() == grads.numel()
            && table.shard_end <= main.numel()
            && table.buffer_end <= grads.numel(),
        "the AdamW table reaches element {} of the shards and {} of the buffers, which hold {} \
         and {}",
        table.shard_end,
        table.buffer_end,
        main.numel(),
        grads.numel()
    );
    ensure!(
        step.kind() == Kind::Float && step.numel() >= 1 && step.device() == grads.device(),
        "the step count must be a float32 tensor on the gradients' device"
    );
    if let Some(divisor) = grad_divisor {
        ensure!(
            divisor.kind() == Kind::Float
                && divisor.numel() == 1
                && divisor.device() == grads.device(),
            "the gradient divisor must be a float32 scalar on the gradients' device"
        );
    }
    let module = kernels(&SOURCE, device)?;
    let [mut main_ptr, mut m_ptr, mut v_ptr, mut g_ptr, mut h_ptr, mut chunks_ptr, mut step_ptr] =
        [main, exp_avg, exp_avg_sq, grads, model, &table.chunks, step].map(|t| t.data_ptr() as u64);
    let mut divisor_ptr = grad_divisor.map_or(0u64, |d| d.data_ptr() as u64);
    // ATen turns its double hyper-parameters into float32 the same way.
    let [mut lr, mut beta1, mut beta2, mut weight_decay, mut eps] = [
        hyper.lr,
        hyper.beta1,
        hyper.beta2,
        hyper.weight_decay,
        hyper.eps,
    ]
    .map(|x| x as f32);
    let mut zero = i32::from(zero_grads);
    let mut args = [
        kernel_arg(&mut main_ptr),
        kernel_arg(&mut m_ptr),
        kernel_arg(&mut v_ptr),
        kernel_arg(&mut g_ptr),
        kernel_arg(&mut h_ptr),
        kernel_arg(&mut chunks_ptr),
        kernel_arg(&mut step_ptr),
        kernel_arg(&mut divisor_ptr),
        kernel_arg(&mut lr),
        kernel_arg(&mut beta1),
        kernel_arg(&mut beta2),
        kernel_arg(&mut weight_decay),
        kernel_arg(&mut eps),
        kernel_arg(&mut zero),
    ];
    // SAFETY: the arguments match the kernel's parameters in order and type (pointers as u64,
    // hyper-parameters as f32, the flag as i32); every chunk lies inside the buffers (checked
    // above: the shard offsets inside the main parameters and moments, the buffer offsets
    // inside the gradients and model parameters), the tensors are contiguous on this device
    // and the caller keeps them alive.
    unsafe {
        module.launch(
            function,
            (table.count as u32, 1, 1),
            (ADAMW_THREADS, 1, 1),
            &mut args,
        )?;
    }
    Ok(())
}

/// Runs both kernels once on CUDA device `device` with model parameters of `kind` on made-up
/// segments (aligned and not, decayed and not, several chunks long and one element long), and
/// compares them with ATen's fused AdamW, the copy into the model parameters and libtorch's
/// sum of squares: a launch or a result that goes wrong is an error here, before training
/// depends on the kernels.
pub fn self_check(device: usize, kind: Kind) -> Result<()> {
    let cuda = Device::Cuda(device);
    let inputs = super::self_check_inputs(Kind::Float, cuda);
    // (buffer start, shard start, length, decayed): the last starts off 16-byte alignment.
    let layout = [
        (0, 0, 2 * CHUNK + 37, true),
        (2 * CHUNK + 64, 2 * CHUNK + 64, 1, false),
        (2 * CHUNK + 128, 2 * CHUNK + 129, 203, true),
    ];
    let segments: Vec<AdamwSegment> = layout
        .iter()
        .map(|&(buffer_start, shard_start, len, decayed)| AdamwSegment {
            buffer_start,
            shard_start,
            len,
            decayed,
        })
        .collect();
    let len = (2 * CHUNK + 384) as i64;
    let grads = inputs(&[len], 0.71, 1e-2);
    let main = inputs(&[len], 0.13, 1.0);
    let exp_avg = inputs(&[len], 0.29, 1e-3);
    let exp_avg_sq = inputs(&[len], 0.53, 1e-4).square();
    let model = main.to_kind(kind);
    let divisor = Tensor::from(1.5f32).to_device(cuda);
    let step = Tensor::from(3.0f32).to_device(cuda);
    let hyper = AdamwHyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    // ATen's step on copies, one tensor per segment.
    let copies = [&main, &exp_avg, &exp_avg_sq, &grads, &model].map(|t| t.copy());
    let [main_want, m_want, v_want, g_want, model_want] = &copies;
    for decayed in [true, false] {
        let chosen: Vec<&AdamwSegment> = segments.iter().filter(|s| s.decayed == decayed).collect();
        let views =
            |t: &Tensor, at: Part| -> Vec<Tensor> { chosen.iter().map(|s| at(t, s)).collect() };
        let (p, g, m, v) = (
            views(main_want, shard_of),
            views(g_want, buffer_of),
            views(m_want, shard_of),
            views(v_want, shard_of),
        );
        // ATen increments its counters before the update: start them one lower.
        let steps: Vec<Tensor> = chosen.iter().map(|_| &step - 1.0).collect();
        let hyper = AdamwHyper {
            weight_decay: if decayed { hyper.weight_decay } else { 0.0 },
            ..hyper
        };
        tch::no_grad(|| {
            fused_adamw(
                &refs(&p),
                &refs(&g),
                &refs(&m),
                &refs(&v),
                &refs(&steps),
                hyper,
                Some(&divisor),
            )
        })?;
        let targets = views(model_want, buffer_of);
        foreach_copy_(&refs(&targets), &refs(&p))?;
    }
    let counted: Vec<Range<usize>> = segments
        .iter()
        .map(|s| s.buffer_start..s.buffer_start + s.len)
        .collect();
    let squares = sum_of_squares(&grads, &SquaresTable::new(&counted, cuda))?;
    let squares_want: f64 = segments
        .iter()
        .map(|s| {
            buffer_of(&grads, s)
                .square()
                .sum(Kind::Double)
                .double_value(&[])
        })
        .sum();
    let relative = (squares.double_value(&[]) - squares_want).abs() / squares_want;
    ensure!(
        relative < 1e-5,
        "the optimizer kernels' self-check: the sum of squares is {} where libtorch's is \
         {squares_want}",
        squares.double_value(&[])
    );
    let table = AdamwTable::new(&segments, cuda)?;
    let buffers = AdamwBuffers {
        main: &main,
        exp_avg: &exp_avg,
        exp_avg_sq: &exp_avg_sq,
        grads: &grads,
        model: &model,
    };
    adamw(&buffers, &table, hyper, &step, Some(&divisor), true)?;
    for s in &segments {
        let compared: [(&str, &Tensor, &Tensor, Part); 4] = [
            ("main parameters", &main, main_want, shard_of),
            ("first moments", &exp_avg, m_want, shard_of),
            ("second moments", &exp_avg_sq, v_want, shard_of),
            ("model parameters", &model, model_want, buffer_of),
        ];
        for (name, got, want, at) in compared {
            let (got, want) = (
                at(got, s).to_kind(Kind::Double),
                at(want, s).to_kind(Kind::Double),
            );
            let difference = (&got - &want).abs().max().double_value(&[]);
            let size = want.abs().max().double_value(&[]).max(1e-30);
            // Up to a few units in the last place of the stored format.
            let tolerance = if name == "model parameters" {
                1e-2
            } else {
                1e-6
            };
            ensure!(
                difference <= tolerance * size,
                "the optimizer kernels' self-check: the {name} of a segment of {} elements \
                 differ from ATen's fused AdamW by {difference}",
                s.len
            );
        }
        let left = buffer_of(&grads, s).abs().max().double_value(&[]);
        ensure!(
            left == 0.0,
            "the optimizer kernels' self-check: the AdamW kernel left gradients unzeroed"
        );
    }
    Ok(())
}

/// Where a segment lies in a buffer: [`shard_of`] or [`buffer_of`].
type Part = fn(&Tensor, &AdamwSegment) -> Tensor;

/// A segment's part of a shard buffer (main parameters, moments).
fn shard_of(tensor: &Tensor, segment: &AdamwSegment) -> Tensor {
    tensor.narrow(0, segment.shard_start as i64, segment.len as i64)
}

/// A segment's part of a full buffer (gradients, model parameters).
fn buffer_of(tensor: &Tensor, segment: &AdamwSegment) -> Tensor {
    tensor.narrow(0, segment.buffer_start as i64, segment.len as i64)
}

fn refs(tensors: &[Tensor]) -> Vec<&Tensor> {
    tensors.iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_cover_every_segment_once_in_aligned_chunks() {
        let segments = [
            (0, 0, 2 * CHUNK + 5, true),
            (2 * CHUNK + 64, 2 * CHUNK + 67, 1, false),
            (3 * CHUNK, 3 * CHUNK + 1, CHUNK, true),
        ]
        .map(|(buffer_start, shard_start, len, decayed)| AdamwSegment {
            buffer_start,
            shard_start,
            len,
            decayed,
        });
        let table = AdamwTable::new(&segments, Device::Cpu).unwrap();
        let rows = Vec::<i64>::try_from(&table.chunks).unwrap();
        let rows: Vec<&[i64]> = rows.chunks(4).collect();
        assert_eq!(
            rows,
            [
                [0, 0, CHUNK as i64, 1],
                [CHUNK as i64, CHUNK as i64, CHUNK as i64, 1],
                [2 * CHUNK as i64, 2 * CHUNK as i64, 5, 1],
                [2 * CHUNK as i64 + 64, 2 * CHUNK as i64 + 67, 1, 0],
                [3 * CHUNK as i64, 3 * CHUNK as i64 + 1, CHUNK as i64, 1],
            ]
        );
        assert_eq!(
            (table.count, table.buffer_end, table.shard_end),
            (5, 4 * CHUNK, 4 * CHUNK + 1)
        );
        let squares = SquaresTable::new(&[3..3 + CHUNK + 1, 100_000..100_002], Device::Cpu);
        let rows = Vec::<i64>::try_from(&squares.chunks).unwrap();
        assert_eq!(rows, [3, CHUNK as i64, 3 + CHUNK as i64, 1, 100_000, 2]);
        assert_eq!((squares.count, squares.end), (3, 100_002));
        let empty = SquaresTable::new(&[], Device::Cpu);
        assert_eq!((empty.count, empty.chunks.numel()), (0, 1));
    }

    #[test]
    fn cpu_tensors_are_turned_away_with_a_message() {
        let values = Tensor::zeros([8], (Kind::Float, Device::Cpu));
        let table = SquaresTable::new(std::slice::from_ref(&(0..8)), Device::Cpu);
        let error = sum_of_squares(&values, &table).unwrap_err().to_string();
        assert!(error.contains("CUDA"), "{error}");
        let segments = [AdamwSegment {
            buffer_start: 0,
            shard_start: 0,
            len: 8,
            decayed: true,
        }];
        let table = AdamwTable::new(&segments, Device::Cpu).unwrap();
        let model = values.to_kind(Kind::BFloat16);
        let buffers = AdamwBuffers {
            main: &values,
            exp_avg: &values,
            exp_avg_sq: &values,
            grads: &values,
            model: &model,
        };
        let hyper = AdamwHyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let step = Tensor::ones([1], (Kind::Float, Device::Cpu));
        let error = adamw(&buffers, &table, hyper, &step, None, true)
            .unwrap_err()
            .to_string();
        assert!(error.contains("CUDA"), "{error}");
        assert!(supports(Kind::BFloat16) && supports(Kind::Half) && !supports(Kind::Float));
    }
}
