//! The fused residual add + norm (`ops::add_norm`): on a GPU its outputs and every
//! gradient (residual, delta, gamma, beta) equal the unfused libtorch path's for LayerNorm and
//! RMSNorm, with and without gamma = 1 + w, in bf16, fp16 and fp32, over odd row counts and
//! widths from 8 to 8192; the same inputs give the same bits twice; through autograd
//! (`Norm::add_and_norm`) residual and delta get their gradients and the parameters theirs; and
//! a small GPT trains the same with and without the fusion. With hidden dropout inside the
//! kernels, everything equals the unfused ops under the kernels' mask, and the mask drops p of
//! the elements, independently and anew for each seed. Off a GPU, and with
//! `MEGATRON_RS_FUSED_ADD_NORM=0`, the unfused ops run, and layers outside a recomputed block
//! still hand each other the residual stream.

mod support;

use std::sync::Mutex;

use megatron_kernels::ops::add_norm::{self, unfused};
use megatron_kernels::ops::decode_gemv::InputNorm;
use megatron_kernels::ops::relative_error;
use megatron_models::config::Normalization;
use megatron_models::layers::Norm;
use megatron_models::param::Initializer;
use megatron_training::GptPretrainArgs;
use tch::{Device, Kind, Tensor};

/// Held by the tests that read or set `MEGATRON_RS_FUSED_ADD_NORM`.
static ENVIRONMENT: Mutex<()> = Mutex::new(());

/// Held by the tests that train: a run reseeds libtorch's process-wide generators, from which
/// a run beside it would draw.
static TRAINING: Mutex<()> = Mutex::new(());

fn training() -> std::sync::MutexGuard<'static, ()> {
    TRAINING.lock().unwrap_or_else(|p| p.into_inner())
}

/// Deterministic values without the global generator, which parallel tests share.
fn values(shape: &[i64], step: f64, scale: f64, kind: Kind, device: Device) -> Tensor {
    let count: i64 = shape.iter().product();
    ((Tensor::arange(count, (Kind::Float, device)) * step).sin() * scale)
        .view(shape)
        .to_kind(kind)
}

/// How far the fused results may be from the float32 ones, relative to the largest magnitude,
/// unless the unfused path is further off (then at most half as far again as it is):
/// the unfused RMSNorm input gradient is rounded to the activation dtype up to three times
/// (`grad · gamma`, its float32 result, the sum with the residual's gradient), each by up to half
/// a unit in the last place (2⁻⁸ of the value in bf16, 2⁻¹¹ in fp16), and ours once; float32
/// differs only in the order of its sums.
fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 => 2e-2,
        Kind::Half => 4e-3,
        _ => 1e-4,
    }
}

fn cuda_or_skip() -> Option<Device> {
    if tch::Cuda::is_available() {
        Some(Device::Cuda(0))
    } else {
        eprintln!("skipped: no CUDA device");
        None
    }
}

/// The norms compared: LayerNorm and RMSNorm, each with and without gamma = 1 + w.
const NORMS: [(Normalization, bool); 4] = [
    (Normalization::LayerNorm, false),
    (Normalization::LayerNorm, true),
    (Normalization::RMSNorm, false),
    (Normalization::RMSNorm, true),
];

/// Made-up inputs of one add + norm: activations and gradients of one shape (their values'
/// frequencies scaled by `spread`) and the norm's parameters.
struct Case {
    residual: Tensor,
    delta: Tensor,
    grad_normed: Tensor,
    grad_sum: Tensor,
    weight: Tensor,
    bias: Tensor,
    kind: Normalization,
    one_plus: bool,
}

impl Case {
    fn new(
        shape: &[i64],
        dtype: Kind,
        kind: Normalization,
        one_plus: bool,
        spread: f64,
        device: Device,
    ) -> Case {
        let hidden = *shape.last().unwrap();
        Case {
            residual: values(shape, 0.37 * spread, 3.0, dtype, device),
            delta: values(shape, 0.71 * spread, 1.0, dtype, device) + 0.5,
            grad_normed: values(shape, 0.13 * spread, 1.0, dtype, device),
            grad_sum: values(shape, 0.29 * spread, 0.5, dtype, device),
            weight: values(&[hidden], 0.53, 0.3, dtype, device) + if one_plus { 0.0 } else { 1.0 },
            bias: values(&[hidden], 0.17, 0.2, dtype, device),
            kind,
            one_plus,
        }
    }

    /// The norm over the case's parameters (a bias for LayerNorm only).
    fn norm(&self) -> InputNorm<'_> {
        InputNorm {
            kind: self.kind,
            weight: &self.weight,
            bias: (self.kind == Normalization::LayerNorm).then_some(&self.bias),
            eps: 1e-5,
            one_plus: self.one_plus,
        }
    }
}

#[test]
fn on_a_gpu_the_fused_add_norm_equals_the_unfused_ops() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    // Leading shapes with odd row counts (1, 37, 3·13, ...) and widths with idle threads (1000,
    // 6144) or several vectors a thread (4096, 8192).
    let shapes: [&[i64]; 8] = [
        &[1, 8],
        &[37, 64],
        &[13, 3, 1000],
        &[37, 1024],
        &[129, 2048],
        &[9, 4096],
        &[5, 6144],
        &[3, 8192],
    ];
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for shape in shapes {
            let hidden = *shape.last().unwrap();
            for (index, (norm_kind, one_plus)) in NORMS.into_iter().enumerate() {
                let what = format!("{kind:?} {norm_kind:?} 1p={one_plus} {shape:?}");
                let case = Case::new(shape, kind, norm_kind, one_plus, 0.1 + index as f64, device);
                let Case {
                    residual,
                    delta,
                    grad_normed,
                    grad_sum,
                    weight,
                    bias,
                    ..
                } = &case;
                let norm = case.norm();
                let fused = add_norm::forward(&residual, &delta, &norm, None).unwrap();
                let grads =
                    add_norm::backward(&grad_normed, &grad_sum, &fused.saved, &norm).unwrap();
                let want =
                    unfused(&residual, &delta, &grad_normed, &grad_sum, &norm, None).unwrap();
                // The same math in float32 from the same inputs: both paths are measured
                // against it, so that rounding the unfused path does is not held against ours.
                let float = |t: &Tensor| t.to_kind(Kind::Float);
                let (float_weight, float_bias) = (float(&weight), float(&bias));
                let exact = unfused(
                    &float(&residual),
                    &float(&delta),
                    &float(&grad_normed),
                    &float(&grad_sum),
                    &InputNorm {
                        weight: &float_weight,
                        bias: norm.bias.map(|_| &float_bias),
                        ..norm
                    },
                    None,
                )
                .unwrap();
                // The sum is one rounding of the same float32 sum on both paths.
                assert!(fused.saved.sum.equal(&want.sum), "{what}: the sums differ");
                let mut compared = vec![
                    ("normed output", &fused.normed, &want.normed, &exact.normed),
                    (
                        "input gradient",
                        &grads.inputs.residual,
                        &want.input,
                        &exact.input,
                    ),
                    (
                        "weight gradient",
                        &grads.weight,
                        &want.weight,
                        &exact.weight,
                    ),
                ];
                if let (Some(got), Some(expected), Some(exact)) =
                    (&grads.bias, &want.bias, &exact.bias)
                {
                    compared.push(("bias gradient", got, expected, exact));
                }
                assert_eq!(grads.bias.is_some(), want.bias.is_some(), "{what}");
                for (name, got, expected, exact) in compared {
                    assert_eq!(got.kind(), kind, "{what}: {name}");
                    assert_eq!(got.size(), expected.size(), "{what}: {name}");
                    let (ours, theirs) =
                        (relative_error(got, exact), relative_error(expected, exact));
                    assert!(
                        ours <= tolerance(kind).max(1.5 * theirs),
                        "{what}: the {name} is off the float32 result by {ours:.3e} (relative), \
                         the unfused path by {theirs:.3e}"
                    );
                }
                let stats = fused.saved.sum.to_kind(Kind::Float);
                let rows = stats.numel() as i64 / hidden;
                let rows_view = stats.view([rows, hidden]);
                if norm_kind == Normalization::LayerNorm {
                    let mean = rows_view.mean_dim(-1, false, Kind::Float);
                    let error = relative_error(&fused.saved.mean, &mean);
                    assert!(
                        error < 1e-5,
                        "{what}: the saved means differ by {error:.3e}"
                    );
                }
            }
        }
    }
}

/// Made-up LayerNorm weight and bias of `hidden` channels.
fn layer_norm_params(hidden: i64, kind: Kind, device: Device) -> [Tensor; 2] {
    [
        values(&[hidden], 0.53, 0.3, kind, device) + 1.0,
        values(&[hidden], 0.17, 0.2, kind, device),
    ]
}

fn layer_norm<'a>(weight: &'a Tensor, bias: &'a Tensor) -> InputNorm<'a> {
    InputNorm {
        kind: Normalization::LayerNorm,
        weight,
        bias: Some(bias),
        eps: 1e-5,
        one_plus: false,
    }
}

/// Strided and misaligned inputs are made contiguous and aligned; the gradients of a
/// non-contiguous layout arrive the same; no rows give empty outputs and zero parameter
/// gradients.
#[test]
fn on_a_gpu_odd_layouts_and_empty_inputs_are_handled() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let kind = Kind::BFloat16;
    let hidden = 256;
    let [weight, bias] = layer_norm_params(hidden, kind, device);
    let norm = layer_norm(&weight, &bias);
    // A transposed residual and a delta that starts one element into its storage.
    let residual = values(&[hidden, 11], 0.37, 3.0, kind, device).transpose(0, 1);
    let delta = values(&[11 * hidden + 1], 0.71, 1.0, kind, device)
        .narrow(0, 1, 11 * hidden)
        .view([11, hidden]);
    let grad_normed = values(&[11, hidden], 0.13, 1.0, kind, device);
    let grad_sum = values(&[hidden, 11], 0.29, 0.5, kind, device).transpose(0, 1);
    let fused = add_norm::forward(&residual, &delta, &norm, None).unwrap();
    let grads = add_norm::backward(&grad_normed, &grad_sum, &fused.saved, &norm).unwrap();
    let want = unfused(&residual, &delta, &grad_normed, &grad_sum, &norm, None).unwrap();
    assert!(fused.saved.sum.equal(&want.sum));
    for (name, got, expected) in [
        ("normed output", &fused.normed, &want.normed),
        ("input gradient", &grads.inputs.residual, &want.input),
        ("weight gradient", &grads.weight, &want.weight),
    ] {
        let error = relative_error(got, expected);
        assert!(
            error <= tolerance(kind),
            "the {name} differs by {error:.3e}"
        );
    }

    let empty = Tensor::zeros([0, 4, hidden], (kind, device));
    let fused = add_norm::forward(&empty, &empty, &norm, None).unwrap();
    assert_eq!(fused.normed.size(), [0, 4, hidden]);
    let grads = add_norm::backward(&empty, &empty, &fused.saved, &norm).unwrap();
    assert_eq!(grads.inputs.residual.size(), [0, 4, hidden]);
    assert_eq!(grads.weight.abs().max().double_value(&[]), 0.0);
    assert_eq!(grads.bias.unwrap().abs().max().double_value(&[]), 0.0);
}

/// Made-up `[rows, hidden]` residual, delta and gradients of the normed output and of the sum.
fn rows_of(rows: i64, hidden: i64, kind: Kind, device: Device) -> [Tensor; 4] {
    [(0.37, 3.0), (0.71, 1.0), (0.13, 1.0), (0.29, 0.5)]
        .map(|(step, scale)| values(&[rows, hidden], step, scale, kind, device))
}

/// With the optimizer's float32 gradients given (gradient-accumulation fusion), the weight and
/// bias gradients are added to them in float32: the same sums the bf16 gradients round, added to
/// what the buffers held, and the input gradient is unchanged.
#[test]
fn on_a_gpu_parameter_gradients_go_into_the_main_gradients() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let kind = Kind::BFloat16;
    let (rows, hidden) = (777, 1024);
    let [weight, bias] = layer_norm_params(hidden, kind, device);
    let norm = layer_norm(&weight, &bias);
    let [residual, delta, grad_normed, grad_sum] = rows_of(rows, hidden, kind, device);
    let fused = add_norm::forward(&residual, &delta, &norm, None).unwrap();
    let grads = add_norm::backward(&grad_normed, &grad_sum, &fused.saved, &norm).unwrap();
    let held = [0.25, -0.5].map(|v| Tensor::full([hidden], v, (Kind::Float, device)));
    let [main_weight, main_bias] = held.each_ref().map(Tensor::copy);
    let main = add_norm::MainGrads {
        weight: &main_weight,
        bias: Some(&main_bias),
    };
    let inputs =
        add_norm::backward_into(&grad_normed, &grad_sum, &fused.saved, &norm, main).unwrap();
    assert!(
        inputs.residual.equal(&grads.inputs.residual),
        "the input gradient changed"
    );
    for (name, main, start, rounded) in [
        ("weight", &main_weight, &held[0], &grads.weight),
        ("bias", &main_bias, &held[1], grads.bias.as_ref().unwrap()),
    ] {
        let added = main - start;
        // The bf16 gradient is the same float32 sum rounded once (half a unit in its last
        // place, 2⁻⁹ of the value).
        let error = relative_error(&added, rounded);
        assert!(
            error <= 4e-3,
            "the {name} gradient added differs from the bf16 one by {error:.3e}"
        );
        assert!(
            added.abs().max().double_value(&[]) > 0.0,
            "nothing was added"
        );
    }
}

/// The gamma/beta sums run in a fixed order: the same inputs give the same bits, over enough
/// rows for hundreds of partial rows.
#[test]
fn on_a_gpu_the_fused_add_norm_is_deterministic() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let kind = Kind::BFloat16;
    let (rows, hidden) = (8191, 1024);
    let [weight, bias] = layer_norm_params(hidden, kind, device);
    let norm = layer_norm(&weight, &bias);
    let [residual, delta, grad_normed, grad_sum] = rows_of(rows, hidden, kind, device);
    let run = || {
        let fused = add_norm::forward(&residual, &delta, &norm, None).unwrap();
        let grads = add_norm::backward(&grad_normed, &grad_sum, &fused.saved, &norm).unwrap();
        [
            fused.normed,
            grads.inputs.residual,
            grads.weight,
            grads.bias.unwrap(),
        ]
    };
    let (first, second) = (run(), run());
    for (a, b) in first.iter().zip(&second) {
        assert!(a.equal(b), "two runs differ");
    }
}

/// A norm of `kind` on `device` with made-up parameters.
fn made_up_norm(kind: Normalization, one_plus: bool, dtype: Kind, device: Device) -> Norm {
    let hidden = 128;
    let init = Initializer::new(dtype, device, 0, 1, 7).scope("norm");
    let norm = Norm::new(&init, kind, hidden, 1e-5, one_plus, false);
    tch::no_grad(|| {
        let mut weight = norm.weight.tensor().shallow_clone();
        weight.copy_(&(values(&[hidden], 0.53, 0.3, dtype, device) + 0.9));
        if let Some(bias) = &norm.bias {
            let mut bias = bias.tensor().shallow_clone();
            bias.copy_(&values(&[hidden], 0.17, 0.2, dtype, device));
        }
    });
    norm
}

/// Through autograd: `Norm::add_and_norm` in training on a GPU is one node whose backward
/// gives residual and delta the same gradient and accumulates the parameters' gradients, all
/// as the unfused ops (the same norm in evaluation) give them.
#[test]
fn on_a_gpu_the_fused_node_backpropagates_like_the_unfused_ops() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let _environment = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    for dtype in [Kind::BFloat16, Kind::Float] {
        assert!(
            add_norm::usable_on(device, dtype, 128),
            "the self-check failed for {dtype:?}"
        );
        for (kind, one_plus) in NORMS {
            let what = format!("{dtype:?} {kind:?} 1p={one_plus}");
            let mut grads = Vec::new();
            for train in [true, false] {
                let norm = made_up_norm(kind, one_plus, dtype, device);
                let residual =
                    values(&[7, 3, 128], 0.37, 3.0, dtype, device).set_requires_grad(true);
                let delta = values(&[7, 3, 128], 0.71, 1.0, dtype, device).set_requires_grad(true);
                let (sum, normed) = norm.add_and_norm(&residual, &delta, 0.0, train).unwrap();
                let loss = (normed.to_kind(Kind::Float)
                    * values(&[7, 3, 128], 0.13, 1.0, Kind::Float, device))
                .sum(Kind::Float)
                    + (sum.to_kind(Kind::Float) * values(&[128], 0.29, 0.5, Kind::Float, device))
                        .sum(Kind::Float);
                loss.backward();
                let mut got = vec![residual.grad(), delta.grad(), norm.weight.grad()];
                got.extend(norm.bias.as_ref().map(|b| b.grad()));
                grads.push(got);
            }
            let names = ["residual", "delta", "weight", "bias"];
            for ((name, fused), plain) in names.iter().zip(&grads[0]).zip(&grads[1]) {
                assert!(fused.defined(), "{what}: no {name} gradient");
                let error = relative_error(fused, plain);
                assert!(
                    error <= tolerance(dtype),
                    "{what}: the {name} gradients differ by {error:.3e}"
                );
            }
        }
    }
}

/// A fixed dropout seed on `device` (a test's own, not drawn from the shared generator).
fn fixed_dropout(p: f64, seed: i64, device: Device) -> add_norm::Dropout {
    add_norm::Dropout {
        p,
        seed: Tensor::from_slice(&[seed]).to_device(device),
    }
}

/// With dropout inside the kernels, outputs and gradients equal the unfused ops that drop out
/// `delta` under the kernels' own mask (libtorch's arithmetic: kept elements scaled in float32
/// and rounded): the sum bit for bit, the rest within the dtype's rounding; `delta`'s gradient
/// is the residual's through the mask and scale, zero where dropped.
#[test]
fn on_a_gpu_dropout_inside_the_add_norm_equals_the_unfused_ops_under_its_mask() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let shapes: [&[i64]; 3] = [&[37, 1024], &[13, 3, 1000], &[5, 6144]];
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (index, shape) in shapes.into_iter().enumerate() {
            for (norm_kind, one_plus) in [NORMS[0], NORMS[3]] {
                for p in [0.1, 0.5] {
                    let what = format!("{kind:?} {norm_kind:?} {shape:?} p={p}");
                    let dropout = fixed_dropout(p, 1_000_003 * index as i64 + 17, device);
                    let case = Case::new(shape, kind, norm_kind, one_plus, 1.0, device);
                    let Case {
                        residual,
                        delta,
                        grad_normed,
                        grad_sum,
                        ..
                    } = &case;
                    let norm = case.norm();
                    let mask = add_norm::kept_mask(&dropout, shape, &norm).unwrap();
                    let fused = add_norm::forward(&residual, &delta, &norm, Some(dropout)).unwrap();
                    let grads =
                        add_norm::backward(&grad_normed, &grad_sum, &fused.saved, &norm).unwrap();
                    let want = unfused(
                        &residual,
                        &delta,
                        &grad_normed,
                        &grad_sum,
                        &norm,
                        Some((&mask, p)),
                    )
                    .unwrap();
                    assert!(fused.saved.sum.equal(&want.sum), "{what}: the sums differ");
                    for (name, got, expected) in [
                        ("normed output", &fused.normed, &want.normed),
                        ("residual gradient", &grads.inputs.residual, &want.input),
                        ("delta gradient", &grads.inputs.delta, &want.delta),
                        ("weight gradient", &grads.weight, &want.weight),
                    ] {
                        let error = relative_error(got, expected);
                        assert!(
                            error <= tolerance(kind),
                            "{what}: the {name} differs by {error:.3e}"
                        );
                    }
                    let dropped_grad =
                        grads.inputs.delta.to_kind(Kind::Float) * mask.eq(0.0).to_kind(Kind::Float);
                    assert_eq!(
                        dropped_grad.abs().max().double_value(&[]),
                        0.0,
                        "{what}: a dropped element has a gradient"
                    );
                }
            }
        }
    }
}

/// Fraction of `a`'s elements that are 1 where `b`'s are too (float32 masks of ones and zeros).
fn both(a: &Tensor, b: &Tensor) -> f64 {
    (a * b).mean(Kind::Float).double_value(&[])
}

/// The mask drops p of the elements, independently of each other (neighbours in a row and in a
/// column are both dropped p² of the time), and every seed draws a mask of its own, whichever
/// half of its bits differs: two masks are both dropped p² of the time. The same seed draws the
/// same mask; seeds drawn from the generator repeat after `manual_seed`. Bounds are 6 standard
/// deviations of the fractions over 4M elements.
#[test]
fn on_a_gpu_the_dropout_mask_drops_p_independently_and_anew_for_each_seed() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let (rows, hidden) = (4096, 1024);
    let n = (rows * hidden) as f64;
    let [weight, bias] = layer_norm_params(hidden, Kind::BFloat16, device);
    let norm = layer_norm(&weight, &bias);
    let p = 0.1;
    let dropped = |seed: i64| -> Tensor {
        let kept = add_norm::kept_mask(&fixed_dropout(p, seed, device), &[rows, hidden], &norm);
        kept.unwrap().eq(0.0).to_kind(Kind::Float)
    };
    let within = |got: f64, want: f64, what: &str| {
        let sigma = (want * (1.0 - want) / n).sqrt();
        assert!(
            (got - want).abs() <= 6.0 * sigma,
            "{what}: {got:.6} against {want:.6} (σ {sigma:.2e})"
        );
    };
    let base = 0x1234_5678_9abc_def0_i64;
    let mask = dropped(base);
    within(
        mask.mean(Kind::Float).double_value(&[]),
        p,
        "dropped fraction",
    );
    let flat = mask.view([-1]);
    let count = flat.size()[0];
    within(
        both(&flat.narrow(0, 0, count - 1), &flat.narrow(0, 1, count - 1)),
        p * p,
        "neighbours in a row",
    );
    within(
        both(&mask.narrow(0, 0, rows - 1), &mask.narrow(0, 1, rows - 1)),
        p * p,
        "neighbours in a column",
    );
    assert!(
        mask.equal(&dropped(base)),
        "the same seed drew another mask"
    );
    for (other, what) in [
        (base + 1, "a seed one apart"),
        (base ^ (1 << 40), "a seed differing in its high bits"),
        (base ^ 0x8000, "a seed differing in its low bits"),
    ] {
        within(both(&mask, &dropped(other)), p * p, what);
    }
    let _training = training();
    let drawn = || {
        tch::manual_seed(31);
        let first = add_norm::Dropout::draw(p, device).unwrap().seed;
        let second = add_norm::Dropout::draw(p, device).unwrap().seed;
        (first, second)
    };
    let (first, second) = drawn();
    assert!(!first.equal(&second), "two draws gave the same seed");
    assert!(drawn().0.equal(&first), "a seeded draw did not repeat");
}

/// Through autograd: `Norm::add_and_norm` with dropout in training on a GPU draws its seed from
/// the generator (so a seeded call repeats its mask) and gives residual, delta and the
/// parameters the unfused ops' gradients under that mask.
#[test]
fn on_a_gpu_the_fused_node_drops_out_delta_like_the_unfused_ops() {
    let Some(device) = cuda_or_skip() else {
        return;
    };
    let _environment = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    // Seeded draws: no training run may reseed the generator in between.
    let _training = training();
    let (dtype, p) = (Kind::BFloat16, 0.25);
    let shape = [7, 3, 128];
    for (kind, one_plus) in [NORMS[0], NORMS[3]] {
        let what = format!("{kind:?} 1p={one_plus}");
        let norm = made_up_norm(kind, one_plus, dtype, device);
        tch::manual_seed(5);
        let zeros = Tensor::zeros(shape, (dtype, device));
        let ones = Tensor::ones(shape, (dtype, device));
        let (kept, _) = norm.add_and_norm(&zeros, &ones, p, true).unwrap();
        let mask = kept.ne(0.0).to_kind(Kind::Float);
        let fraction = mask.mean(Kind::Float).double_value(&[]);
        assert!(
            (0.6..0.9).contains(&fraction),
            "{what}: kept {fraction:.3} at p={p}"
        );

        tch::manual_seed(5);
        let residual = values(&shape, 0.37, 3.0, dtype, device).set_requires_grad(true);
        let delta = values(&shape, 0.71, 1.0, dtype, device).set_requires_grad(true);
        let (sum, normed) = norm.add_and_norm(&residual, &delta, p, true).unwrap();
        let grad_normed = values(&shape, 0.13, 1.0, dtype, device);
        let grad_sum = values(&shape, 0.29, 0.5, dtype, device);
        let loss = (normed.to_kind(Kind::Float) * grad_normed.to_kind(Kind::Float))
            .sum(Kind::Float)
            + (sum.to_kind(Kind::Float) * grad_sum.to_kind(Kind::Float)).sum(Kind::Float);
        loss.backward();
        let want = unfused(
            &residual,
            &delta,
            &grad_normed,
            &grad_sum,
            &norm.as_input_norm(),
            Some((&mask, p)),
        )
        .unwrap();
        assert!(sum.equal(&want.sum), "{what}: the sums differ");
        for (name, got, expected) in [
            ("residual", residual.grad(), &want.input),
            ("delta", delta.grad(), &want.delta),
            ("weight", norm.weight.grad(), &want.weight),
        ] {
            let error = relative_error(&got, expected);
            assert!(
                error <= tolerance(dtype),
                "{what}: the {name} gradients differ by {error:.3e}"
            );
        }
    }
}

/// Off a GPU the unfused ops run, training or not: the same values as the add and the norm.
#[test]
fn on_the_cpu_add_and_norm_is_the_add_and_the_norm() {
    for (kind, one_plus) in NORMS {
        let norm = made_up_norm(kind, one_plus, Kind::Float, Device::Cpu);
        let residual = values(&[5, 128], 0.37, 3.0, Kind::Float, Device::Cpu);
        let delta = values(&[5, 128], 0.71, 1.0, Kind::Float, Device::Cpu);
        let (sum, normed) = norm.add_and_norm(&residual, &delta, 0.0, true).unwrap();
        let expected = &residual + &delta;
        assert!(sum.equal(&expected));
        assert!(normed.equal(&norm.forward(&expected)));
    }
}

/// Dropout flags of the tests below, after [`support::tiny_training`]'s: 8 steps.
fn with_dropout(extra: &[&'static str]) -> Vec<&'static str> {
    let mut flags = support::tiny_training(support::TINY_MODEL);
    flags.extend([
        "--train-iters",
        "8",
        "--save-interval",
        "8",
        "--hidden-dropout",
        "0.1",
        "--attention-dropout",
        "0.1",
    ]);
    flags.extend(extra);
    flags
}

/// On the CPU a block's hidden dropout waits for the next add + norm (the fused kernel's place)
/// and then runs as libtorch's dropout: nothing draws random numbers in between (attention
/// dropout included), so training ends bit for bit as with `--no-bias-dropout-fusion`, which
/// drops out at once. One rank: thread ranks share the CPU generator, so their draws interleave.
#[test]
fn on_the_cpu_the_deferred_hidden_dropout_draws_as_the_immediate_one() {
    let _training = training();
    let flags = with_dropout(&[]);
    let fused = support::train::<GptPretrainArgs>(&flags, 1, 1, 1, &[]);
    let immediate =
        support::train::<GptPretrainArgs>(&flags, 1, 1, 1, &["--no-bias-dropout-fusion"]);
    assert_eq!(fused.lm_losses().len(), 8);
    support::assert_bitwise_identical(&fused, &immediate);
}

/// On a GPU, a small GPT with hidden dropout 0.1 inside the add + norm kernel learns as with
/// libtorch's dropout (`--no-bias-dropout-fusion`): other masks, so losses within 3% of each
/// other, both falling.
#[test]
fn on_a_gpu_dropout_inside_the_add_norm_trains_like_libtorch_dropout() {
    let Some(_) = cuda_or_skip() else {
        return;
    };
    let _training = training();
    let fused = support::gpu_lm_losses::<GptPretrainArgs>(&with_dropout(&["--bf16"]));
    let plain = support::gpu_lm_losses::<GptPretrainArgs>(&with_dropout(&[
        "--bf16",
        "--no-bias-dropout-fusion",
    ]));
    support::assert_tracks(&fused, &plain, 8, 3e-2, "dropout inside the add + norm");
    assert_ne!(fused, plain, "the fused run drew libtorch's masks");
}

/// Full recompute by blocks: the first two layers recomputed one by one, the last two handing
/// each other the pending residual stream; training equals training without recompute.
#[test]
fn block_recompute_hands_on_the_residual_stream_as_without_recompute() {
    let _training = training();
    let flags = support::tiny_training(support::TINY_MODEL);
    let extra = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
    ];
    support::check::<GptPretrainArgs>(&flags, 1, 1, 1, &extra, "recompute of 2 of 4 layers");
}

/// A 4-layer GPT (LayerNorm, then RMSNorm with gamma = 1 + w) trains on a GPU with the fused
/// add + norm as with `MEGATRON_RS_FUSED_ADD_NORM=0`: the losses of 8 steps agree within 2e-3
/// relative in bf16 (2e-5 in fp32; on the CPU bf16 and fp32 runs differ by about 1e-4) and fall.
#[test]
fn on_a_gpu_training_with_the_fusion_tracks_training_without() {
    let Some(_) = cuda_or_skip() else {
        return;
    };
    let mut base = support::tiny_training(support::TINY_MODEL);
    base.extend(["--train-iters", "8", "--save-interval", "8"]);
    for (extra, tolerance) in [
        (&["--bf16"][..], 2e-3),
        (
            &[
                "--bf16",
                "--normalization",
                "RMSNorm",
                "--apply-layernorm-1p",
            ][..],
            2e-3,
        ),
        (&[][..], 2e-5),
    ] {
        let flags: Vec<&str> = base.iter().chain(extra).copied().collect();
        // The CPU test of this file reads the variable too.
        let _environment = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
        let _training = training();
        let (fused, plain) =
            support::gpu_lm_losses_with_and_without::<GptPretrainArgs>(&flags, add_norm::VARIABLE);
        support::assert_tracks(&fused, &plain, 8, tolerance, &format!("{extra:?}"));
    }
}
