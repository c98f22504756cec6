//! The optimizer-step kernels: their source compiles with NVRTC for Hopper (no GPU needed, so a
//! syntax error fails CI); on a GPU the AdamW kernel equals ATen's fused AdamW plus the copy
//! into the model parameters (bit for bit is expected: the count of elements that differ at all
//! is printed; asserted is at most one unit in the last place of each tensor's largest value
//! per step), touches nothing outside its segments and zeroes the gradients it read; the sum of squares is the same bits run after run and agrees with
//! libtorch's; and the optimizer's step on them equals its step on ATen's kernels.

use std::ops::Range;

use megatron_kernels::ops::optimizer_kernels::{
    self, AdamwBuffers, AdamwSegment, AdamwTable, SquaresTable, CHUNK, SOURCE,
};
use megatron_kernels::ops::{foreach_copy_, fused_adamw, AdamwHyper};
use megatron_kernels::runtime::nvrtc::compile_ptx;
use megatron_models::{NamedParameter, ParamAttributes};
use megatron_optim::{
    LearningRates, MixedPrecisionOptimizer, OptimizerKind, OptimizerSettings, DEFAULT_BUCKET_SIZE,
};
use megatron_parallel::ParallelState;
use tch::{Device, Kind, Tensor};

#[test]
fn the_optimizer_kernels_compile_for_hopper() {
    let ptx = compile_ptx(&SOURCE, "compute_90").unwrap();
    for function in SOURCE.functions {
        assert!(
            ptx.contains(&format!(".entry {function}(")),
            "{function} is missing from the PTX"
        );
    }
    assert!(
        ptx.contains(".target sm_90"),
        "{}",
        &ptx[..400.min(ptx.len())]
    );
}

fn cuda() -> Option<Device> {
    if tch::Cuda::is_available() {
        Some(Device::Cuda(0))
    } else {
        eprintln!("skipped: no CUDA device");
        None
    }
}

/// How two tensors of one float dtype differ: how many elements differ at all, and the largest
/// difference in units in the last place of the largest magnitude in `want` (so that an element
/// near zero, where one rounding of a larger intermediate is many of its own units, is judged on
/// the scale of the tensor's values).
fn difference(got: &Tensor, want: &Tensor) -> (usize, f64) {
    let mantissa_bits = match want.kind() {
        Kind::Float => 23,
        Kind::BFloat16 => 7,
        _ => 10,
    };
    let differing = got.ne_tensor(want).sum(Kind::Int64).int64_value(&[]) as usize;
    let (got, want) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
    let gap = (got - &want).abs().max().double_value(&[]);
    if gap == 0.0 {
        return (differing, 0.0);
    }
    let largest = want.abs().max().double_value(&[]).max(f64::MIN_POSITIVE);
    let unit = 2f64.powi(largest.log2().floor() as i32 - mantissa_bits);
    (differing, gap / unit)
}

/// Segments of odd and even lengths, one of several chunks, decayed and not, at 64-element
/// aligned buffer offsets; the shard offsets equal them except for one segment that starts
/// off 16-byte alignment (the kernel's scalar path). Also the buffers' lengths.
fn segments() -> (Vec<AdamwSegment>, usize, usize) {
    let lengths = [1, 3, 64, 4097, 2 * CHUNK + 5, 1000, 37, 130];
    let mut out = Vec::new();
    let (mut buffer, mut shard) = (0, 0);
    for (i, &len) in lengths.iter().enumerate() {
        let misaligned = usize::from(i == 5);
        out.push(AdamwSegment {
            buffer_start: buffer,
            shard_start: shard + misaligned,
            len,
            decayed: i % 3 != 1,
        });
        buffer = (buffer + len).next_multiple_of(64) + 64;
        shard = (shard + len + misaligned).next_multiple_of(64);
    }
    (out, buffer, shard + 64)
}

fn refs(tensors: &[Tensor]) -> Vec<&Tensor> {
    tensors.iter().collect()
}

fn shard_of(t: &Tensor, s: &AdamwSegment) -> Tensor {
    t.narrow(0, s.shard_start as i64, s.len as i64)
}

fn buffer_of(t: &Tensor, s: &AdamwSegment) -> Tensor {
    t.narrow(0, s.buffer_start as i64, s.len as i64)
}

/// Marks every element of `t` outside `ranges` with `marker`.
fn mark_outside(t: &Tensor, ranges: &[Range<usize>], marker: f64) {
    let outside = Tensor::ones([t.numel() as i64], (Kind::Bool, t.device()));
    for r in ranges {
        let _ = outside.narrow(0, r.start as i64, r.len() as i64).fill_(0);
    }
    let _ = t.shallow_clone().masked_fill_(&outside, marker);
}

/// Whether every element of `t` outside `ranges` still equals `marker`.
fn untouched_outside(t: &Tensor, ranges: &[Range<usize>], marker: f64) -> bool {
    let outside = Tensor::ones([t.numel() as i64], (Kind::Bool, t.device()));
    for r in ranges {
        let _ = outside.narrow(0, r.start as i64, r.len() as i64).fill_(0);
    }
    let kept = t.to_kind(Kind::Double).masked_select(&outside);
    kept.eq(marker).all().int64_value(&[]) == 1
}

#[test]
fn the_adamw_kernel_equals_atens_fused_adamw_on_a_gpu() {
    let Some(device) = cuda() else { return };
    let (segments, buffer_len, shard_len) = segments();
    let buffer_ranges: Vec<Range<usize>> = segments
        .iter()
        .map(|s| s.buffer_start..s.buffer_start + s.len)
        .collect();
    let shard_ranges: Vec<Range<usize>> = segments
        .iter()
        .map(|s| s.shard_start..s.shard_start + s.len)
        .collect();
    let table = AdamwTable::new(&segments, device).unwrap();
    let hyper = AdamwHyper {
        lr: 3e-4,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    tch::manual_seed(20);
    for kind in [Kind::BFloat16, Kind::Half] {
        // None: no clipping; 1.0: clipping inactive (the clamped divisor); 3.7: active.
        for divisor in [None, Some(1.0f32), Some(3.7)] {
            let divisor = divisor.map(|d| Tensor::from(d).to_device(device));
            let floats = |len: usize| Tensor::randn([len as i64], (Kind::Float, device));
            let main = floats(shard_len);
            let exp_avg = floats(shard_len) * 1e-3;
            let exp_avg_sq = floats(shard_len).square() * 1e-6;
            let model = floats(buffer_len).to_kind(kind);
            for (t, ranges) in [
                (&main, &shard_ranges),
                (&exp_avg, &shard_ranges),
                (&exp_avg_sq, &shard_ranges),
                (&model, &buffer_ranges),
            ] {
                mark_outside(t, ranges, 7.0);
            }
            // ATen's state: copies, with one step counter per segment.
            let want = [&main, &exp_avg, &exp_avg_sq, &model].map(|t| t.copy());
            let steps: Vec<Tensor> = segments
                .iter()
                .map(|_| Tensor::zeros([], (Kind::Float, device)))
                .collect();
            let step = Tensor::zeros([1], (Kind::Float, device));
            for iteration in 0..3 {
                let grads = floats(buffer_len) * 1e-2;
                mark_outside(&grads, &buffer_ranges, 7.0);
                let grads_want = grads.copy();
                for decayed in [true, false] {
                    let chosen: Vec<usize> = (0..segments.len())
                        .filter(|&i| segments[i].decayed == decayed)
                        .collect();
                    let views = |t: &Tensor, at: fn(&Tensor, &AdamwSegment) -> Tensor| {
                        chosen
                            .iter()
                            .map(|&i| at(t, &segments[i]))
                            .collect::<Vec<_>>()
                    };
                    let (p, g, m, v, h) = (
                        views(&want[0], shard_of),
                        views(&grads_want, buffer_of),
                        views(&want[1], shard_of),
                        views(&want[2], shard_of),
                        views(&want[3], buffer_of),
                    );
                    let s: Vec<&Tensor> = chosen.iter().map(|&i| &steps[i]).collect();
                    let hyper = AdamwHyper {
                        weight_decay: if decayed { hyper.weight_decay } else { 0.0 },
                        ..hyper
                    };
                    fused_adamw(
                        &refs(&p),
                        &refs(&g),
                        &refs(&m),
                        &refs(&v),
                        &s,
                        hyper,
                        divisor.as_ref(),
                    )
                    .unwrap();
                    foreach_copy_(&refs(&h), &refs(&p)).unwrap();
                }
                let _ = step.shallow_clone().g_add_scalar_(1.0);
                let buffers = AdamwBuffers {
                    main: &main,
                    exp_avg: &exp_avg,
                    exp_avg_sq: &exp_avg_sq,
                    grads: &grads,
                    model: &model,
                };
                optimizer_kernels::adamw(&buffers, &table, hyper, &step, divisor.as_ref(), true)
                    .unwrap();
                for (name, got, expected) in [
                    ("main parameters", &main, &want[0]),
                    ("first moments", &exp_avg, &want[1]),
                    ("second moments", &exp_avg_sq, &want[2]),
                    ("model parameters", &model, &want[3]),
                ] {
                    let (differing, units) = difference(got, expected);
                    eprintln!(
                        "{kind:?}, divisor {:?}, step {}: {name} differ in {differing} elements, \
                         by at most {units} units in the last place of the largest",
                        divisor.as_ref().map(|d| d.double_value(&[])),
                        iteration + 1
                    );
                    assert!(units <= 1.0, "{name}: {units} units apart");
                }
                for (t, ranges) in [
                    (&main, &shard_ranges),
                    (&exp_avg, &shard_ranges),
                    (&exp_avg_sq, &shard_ranges),
                    (&model, &buffer_ranges),
                ] {
                    assert!(
                        untouched_outside(t, ranges, 7.0),
                        "a write outside the segments"
                    );
                }
                assert!(
                    untouched_outside(&grads, &buffer_ranges, 7.0),
                    "a gradient zeroed outside the segments"
                );
                for s in &segments {
                    assert_eq!(
                        buffer_of(&grads, s).abs().max().double_value(&[]),
                        0.0,
                        "gradients left unzeroed"
                    );
                }
                // The next step starts from the same state on both sides, so the bound above
                // holds per step.
                for (ours, theirs) in [&main, &exp_avg, &exp_avg_sq, &model]
                    .into_iter()
                    .zip(&want)
                {
                    ours.shallow_clone().copy_(theirs);
                }
            }
        }
    }
    // Without zeroing, the gradients are left as they were (the distributed optimizer fills
    // its whole buffer itself).
    let grads = Tensor::randn([buffer_len as i64], (Kind::Float, device));
    let before = grads.copy();
    let floats = |len: usize| Tensor::zeros([len as i64], (Kind::Float, device));
    let (main, m, v) = (floats(shard_len), floats(shard_len), floats(shard_len));
    let model = floats(buffer_len).to_kind(Kind::BFloat16);
    let buffers = AdamwBuffers {
        main: &main,
        exp_avg: &m,
        exp_avg_sq: &v,
        grads: &grads,
        model: &model,
    };
    let step = Tensor::ones([1], (Kind::Float, device));
    optimizer_kernels::adamw(&buffers, &table, hyper, &step, None, false).unwrap();
    assert!(grads.equal(&before));
    // Tables that reach past the buffers are refused before any launch.
    let shard_end = segments
        .iter()
        .map(|s| s.shard_start + s.len)
        .max()
        .unwrap();
    let short = floats(shard_end - 1);
    let buffers = AdamwBuffers {
        main: &short,
        exp_avg: &short,
        exp_avg_sq: &short,
        grads: &grads,
        model: &model,
    };
    let error = optimizer_kernels::adamw(&buffers, &table, hyper, &step, None, false).unwrap_err();
    assert!(error.to_string().contains("reaches element"), "{error}");
    optimizer_kernels::self_check(0, Kind::BFloat16).unwrap();
    optimizer_kernels::self_check(0, Kind::Half).unwrap();
}

#[test]
fn the_sum_of_squares_is_deterministic_and_agrees_with_libtorch_on_a_gpu() {
    let Some(device) = cuda() else { return };
    tch::manual_seed(21);
    // Odd lengths and offsets, several chunks each, more chunks than the first pass has blocks.
    let mut ranges = Vec::new();
    let mut start = 3;
    for i in 0..700usize {
        let len = 1 + (i * 7919) % (3 * CHUNK);
        ranges.push(start..start + len);
        start += len + 1 + i % 5;
    }
    let values = Tensor::randn([start as i64 + 10], (Kind::Float, device));
    mark_outside(&values, &ranges, 1e6);
    let table = SquaresTable::new(&ranges, device);
    let first = optimizer_kernels::sum_of_squares(&values, &table).unwrap();
    let second = optimizer_kernels::sum_of_squares(&values, &table).unwrap();
    assert!(
        first.equal(&second),
        "two runs gave {first:?} and {second:?}"
    );
    let want: f64 = ranges
        .iter()
        .map(|r| {
            values
                .narrow(0, r.start as i64, r.len() as i64)
                .to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[])
        })
        .sum();
    let got = first.double_value(&[]);
    assert!((got - want).abs() <= 1e-5 * want, "{got} against {want}");
    let empty = SquaresTable::new(&[], device);
    assert_eq!(
        optimizer_kernels::sum_of_squares(&values, &empty)
            .unwrap()
            .double_value(&[]),
        0.0
    );
}

/// A small model's parameters in `kind` on `device`: odd shapes, a matrix of several chunks,
/// biases and norms (not decayed).
fn parameters(kind: Kind, device: Device) -> Vec<NamedParameter> {
    tch::manual_seed(22);
    [
        ("layers.0.linear.weight", vec![37i64, 29]),
        ("layers.0.linear.bias", vec![29]),
        ("layers.0.norm.weight", vec![129]),
        ("layers.1.big.weight", vec![301, 129]),
        ("layers.1.big.bias", vec![301]),
        ("output.weight", vec![3, 5]),
    ]
    .into_iter()
    .map(|(name, shape)| NamedParameter {
        name: name.into(),
        tensor: (Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * 0.1)
            .to_kind(kind)
            .to_device(device)
            .set_requires_grad(true),
        attributes: ParamAttributes::default(),
        main_grad: None,
    })
    .collect()
}

#[test]
fn the_optimizer_step_on_the_kernels_equals_the_step_on_atens_on_a_gpu() {
    let Some(device) = cuda() else { return };
    for (kind, loss_scale) in [(Kind::BFloat16, None), (Kind::Half, Some(1024.0f32))] {
        for clip_grad in [0.0, 1.0] {
            let settings = OptimizerSettings {
                kind: OptimizerKind::Adam {
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                },
                clip_grad,
                distributed: false,
                bucket_size: DEFAULT_BUCKET_SIZE,
                overlap_grad_reduce: false,
                overlap_param_gather: false,
                gradient_accumulation_fusion: false,
                decoupled_lr: false,
            };
            let parallel = ParallelState::single();
            let ours_params = parameters(kind, device);
            let aten_params = parameters(kind, device);
            let handles = |ps: &[NamedParameter]| -> Vec<Tensor> {
                ps.iter().map(|p| p.tensor.shallow_clone()).collect()
            };
            let (ours_handles, aten_handles) = (handles(&ours_params), handles(&aten_params));
            let mut ours = MixedPrecisionOptimizer::new(ours_params, settings, &parallel).unwrap();
            assert!(
                ours.uses_step_kernels(),
                "the kernels' self-check failed (see above)"
            );
            let mut aten = MixedPrecisionOptimizer::new(aten_params, settings, &parallel)
                .unwrap()
                .without_step_kernels();
            for iteration in 0..4 {
                // Gradients large enough for clipping to act, scaled by the loss scale.
                let coefficients: Vec<Tensor> = ours_handles
                    .iter()
                    .map(|p| Tensor::randn(p.size().as_slice(), (Kind::Float, device)) * 0.3)
                    .collect();
                for (handles, optimizer) in [(&ours_handles, &mut ours), (&aten_handles, &mut aten)]
                {
                    let loss = handles
                        .iter()
                        .zip(&coefficients)
                        .map(|(p, c)| (p.to_kind(Kind::Float) * c).sum(Kind::Float))
                        .reduce(|a, b| a + b)
                        .unwrap()
                        * f64::from(loss_scale.unwrap_or(1.0));
                    loss.backward();
                    optimizer.accumulate_grads().unwrap();
                }
                let (a, b) = (
                    ours.step(LearningRates::uniform(1e-3), 0.1, loss_scale)
                        .unwrap(),
                    aten.step(LearningRates::uniform(1e-3), 0.1, loss_scale)
                        .unwrap(),
                );
                assert!(!a.skipped && !b.skipped);
                let (a, b) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
                assert!((a - b).abs() <= 1e-5 * b, "gradient norms {a} and {b}");
                let theirs = aten.state_tensors();
                for (name, got) in ours.state_tensors() {
                    let want = &theirs.iter().find(|(n, _)| *n == name).unwrap().1;
                    let (differing, units) = difference(&got, want);
                    eprintln!(
                        "{kind:?}, clip {clip_grad}, step {}: {name} differ in {differing} \
                         elements, by at most {units} units in the last place of the largest",
                        iteration + 1
                    );
                    // Up to one unit per step (see the kernel's test), and with clipping a few
                    // more: its divisor comes from norms summed in different orders.
                    let bound = if clip_grad > 0.0 { 16.0 } else { 4.0 };
                    assert!(units <= bound, "{name}: {units} units apart");
                }
                for (got, want) in ours_handles.iter().zip(&aten_handles) {
                    let (_, units) = difference(got, want);
                    assert!(units <= 1.0, "model parameters {units} units apart");
                }
            }
        }
    }
}
