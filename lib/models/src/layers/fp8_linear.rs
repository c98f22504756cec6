//! The linear of a transformer layer under `--fp8-format`: its three GEMMs run through
//! `torch._scaled_mm` on fp8 operands with per-tensor scales (Transformer Engine's `Linear`;
//! [`scaled_mm`] says how a CPU runs them).
//!
//! Forward `y = x · Wᵀ + b`: `x` and `W` in e4m3, bf16 output, the bias added by the GEMM.
//! Backward: the input gradient `dx = dy · W` with `dy` in e5m2 (hybrid) or e4m3; the weight
//! gradient `dW = dyᵀ · x` in fp8 as well by default (as Transformer Engine and Megatron do;
//! `--no-fp8-wgrad` computes it from the bf16 tensors instead). Weight gradients go into the
//! optimizer's float32 `main_grad` when it gave one (gradient-accumulation fusion), else to
//! autograd.
//!
//! cuBLASLt's fp8 GEMMs on Hopper take only a row-major first and a column-major second
//! operand whose dimensions are multiples of 16. `_scaled_mm(a, b)` with `a` `[m, k]`
//! contiguous and `b = c.t()` for a contiguous `c` `[n, k]` fits: the forward passes `x` and
//! `W` as they are, the input gradient needs `W` transposed (`Wᵀ` contiguous, passed as
//! `(Wᵀ).t()`), the weight gradient both `dy` and `x` transposed (the token count is then the
//! inner dimension: when it is not a multiple of 16 that GEMM runs in bf16).

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::main_grad_linear::{accumulate_product, ones_row};
use crate::fp8::{scaled_mm, Fp8Recipe, Fp8Tensor, TensorScaling};
use crate::param::{MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};

/// The scaling state of one fp8 linear: its input, weight and output gradient each keep their
/// own scale (and, with delayed scaling, amax history), as Transformer Engine's `fp8_meta`.
pub struct Fp8Linear {
    recipe: Fp8Recipe,
    input: TensorScaling,
    weight: TensorScaling,
    grad_output: TensorScaling,
}

impl Fp8Linear {
    pub fn new(recipe: Fp8Recipe) -> Self {
        Fp8Linear {
            recipe,
            input: TensorScaling::new(recipe.forward_kind(), recipe.scaling),
            weight: TensorScaling::new(recipe.forward_kind(), recipe.scaling),
            grad_output: TensorScaling::new(recipe.backward_kind(), recipe.scaling),
        }
    }

    /// The scaling state of this linear (`<name>.input.scale`, ...) for a checkpoint.
    pub fn state_tensors(&self, name: &str, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        for (role, scaling) in self.roles() {
            scaling.state_tensors(&format!("{name}.{role}"), out)?;
        }
        Ok(())
    }

    /// Restores what [`state_tensors`](Self::state_tensors) saved under `name`; how many of
    /// its three scaling states start afresh instead (see [`TensorScaling::load_state`]).
    pub fn load_state(
        &self,
        name: &str,
        tensors: &HashMap<String, Tensor>,
        device: Device,
    ) -> Result<usize> {
        let mut afresh = 0;
        for (role, scaling) in self.roles() {
            if !scaling.load_state(&format!("{name}.{role}"), tensors, device)? {
                afresh += 1;
            }
        }
        Ok(afresh)
    }

    fn roles(&self) -> [(&'static str, &TensorScaling); 3] {
        [
            ("input", &self.input),
            ("weight", &self.weight),
            ("grad_output", &self.grad_output),
        ]
    }
}

/// `input · weightᵀ (+ bias)` with fp8 GEMMs; `input` is `[..., in]`.
pub fn linear(
    input: &Tensor,
    weight: &Param,
    bias: Option<&Param>,
    fp8: &Arc<Fp8Linear>,
) -> Result<Tensor> {
    // Gradient-accumulation fusion needs a main-gradient view for every parameter; otherwise
    // both learn through autograd.
    let main_grads = match (weight.main_grad().get(), bias.map(|b| b.main_grad().get())) {
        (Some(weight), None) => Some((weight, None)),
        (Some(weight), Some(Some(bias))) => Some((weight, Some(bias))),
        _ => None,
    };
    let mut inputs = vec![input];
    // With fused gradients the parameters are inputs only when the activation alone would not
    // put the node in the graph (see `main_grad_linear`).
    let params_are_inputs = main_grads.is_none() || !input.requires_grad();
    if params_are_inputs {
        inputs.push(weight.tensor());
        inputs.extend(bias.map(|b| b.tensor()));
    }
    let function = Fp8LinearFunction {
        state: fp8.clone(),
        weight: weight.tensor().shallow_clone(),
        bias: bias.map(|b| b.tensor().shallow_clone()),
        main_grads,
        params_are_inputs,
        inputs: inputs.len(),
        weight_t: None,
        input_t: None,
        input_shape: Vec::new(),
    };
    let mut outputs = autograd::apply(function, &inputs).context("fp8 linear")?;
    Ok(outputs.remove(0))
}

/// An fp8 matrix kept transposed (`[k, m]` contiguous for an `[m, k]` operand) and its inverse
/// scale: what the backward GEMMs take.
struct Transposed {
    data: Tensor,
    scale_inv: Tensor,
}

impl Transposed {
    fn of(tensor: Fp8Tensor) -> Result<Self> {
        Ok(Transposed {
            data: tensor
                .data_t
                .context("fp8 linear: quantized without its transpose")?,
            scale_inv: tensor.scale_inv,
        })
    }
}

struct Fp8LinearFunction {
    state: Arc<Fp8Linear>,
    weight: Tensor,
    bias: Option<Tensor>,
    /// The float32 views the weight's and bias's gradients accumulate into.
    main_grads: Option<(MainGrad, Option<MainGrad>)>,
    /// The graph node was given the parameters after the input.
    params_are_inputs: bool,
    inputs: usize,
    /// Kept from the forward for the backward's GEMMs (not outputs, so no reference cycle):
    /// the fp8 weight, transposed, and its inverse scale.
    weight_t: Option<Transposed>,
    /// The fp8 input, transposed, when the weight gradient runs in fp8; otherwise the bf16
    /// input is saved instead.
    input_t: Option<Transposed>,
    input_shape: Vec<i64>,
}

impl CustomFunction for Fp8LinearFunction {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let input = &inputs[0];
        let [out_features, in_features] = self.weight.size()[..] else {
            anyhow::bail!("fp8 linear: weight of shape {:?}", self.weight.size());
        };
        self.input_shape = input.size();
        let x = input.reshape([-1, in_features]);
        let tokens = x.size()[0];
        let kind = input.kind();
        // The weight-gradient GEMM takes the tokens as its inner dimension, which fp8 GEMMs
        // need to be a multiple of 16.
        let fp8_wgrad = self.state.recipe.wgrad && tokens % 16 == 0;
        let x_fp8 = self.state.input.quantize(&x, fp8_wgrad)?;
        let w_fp8 = self.state.weight.quantize(&self.weight, true)?;
        // cuBLASLt adds a bias of the output's dtype in its epilogue; anything else (float32
        // tests) is added after.
        let epilogue_bias = self
            .bias
            .as_ref()
            .filter(|b| b.kind() == kind && matches!(kind, Kind::BFloat16 | Kind::Half));
        // Fast accumulation in the forward GEMM only, as Transformer Engine does.
        let mut y = scaled_mm(
            &x_fp8.data,
            &w_fp8.data.tr(),
            &x_fp8.scale_inv,
            &w_fp8.scale_inv,
            epilogue_bias,
            kind,
            true,
        )?;
        if let (Some(bias), None) = (&self.bias, epilogue_bias) {
            y += bias.to_kind(kind);
        }
        if fp8_wgrad {
            self.input_t = Some(Transposed::of(x_fp8)?);
        } else {
            saved.save(input);
        }
        self.weight_t = Some(Transposed::of(w_fp8)?);
        let mut shape = self.input_shape.clone();
        *shape.last_mut().context("fp8 linear: a 0-d input")? = out_features;
        Ok(vec![y.reshape(shape)])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let [out_features, in_features] = self.weight.size()[..] else {
            unreachable!("checked in forward");
        };
        let kind = grad_outputs[0].kind();
        let dy = grad_outputs[0].reshape([-1, out_features]);
        let input_t = self.input_t.take();
        let dy_fp8 = self.state.grad_output.quantize(&dy, input_t.is_some())?;
        let w_t = self
            .weight_t
            .take()
            .context("fp8 linear: backward ran twice")?;
        let dx = scaled_mm(
            &dy_fp8.data,
            &w_t.data.tr(),
            &dy_fp8.scale_inv,
            &w_t.scale_inv,
            None,
            kind,
            false,
        )?;
        let grad_input = dx.reshape(self.input_shape.as_slice());

        // The weight gradient, in float32 when it comes from the fp8 GEMM.
        let weight_grad = match (&input_t, &self.main_grads) {
            (Some(x_t), main) => {
                let dy_t = dy_fp8
                    .data_t
                    .as_ref()
                    .context("fp8 linear: no transposed dy")?;
                let dw = scaled_mm(
                    dy_t,
                    &x_t.data.tr(),
                    &dy_fp8.scale_inv,
                    &x_t.scale_inv,
                    None,
                    Kind::Float,
                    false,
                )?;
                match main {
                    Some((target, _)) => {
                        let _ = target.shallow_clone().f_add_(&dw)?;
                        target.accumulated();
                        None
                    }
                    None => Some(dw.to_kind(self.weight.kind())),
                }
            }
            (None, main) => {
                let x = saved[0].reshape([-1, in_features]);
                match main {
                    Some((target, _)) => {
                        accumulate_product(target, &dy.tr(), &x)?;
                        target.accumulated();
                        None
                    }
                    None => Some(dy.tr().mm(&x).to_kind(self.weight.kind())),
                }
            }
        };
        let bias_grad = match (&self.bias, &self.main_grads) {
            (None, _) => None,
            (Some(_), Some((_, Some(target)))) => {
                let ones = ones_row(dy.size()[0], kind, dy.device());
                accumulate_product(&target.view([1, out_features]), &ones, &dy)?;
                target.accumulated();
                None
            }
            (Some(bias), _) => Some(dy.sum_dim_intlist([0i64].as_slice(), false, bias.kind())),
        };
        let mut grads = vec![Some(grad_input)];
        if self.params_are_inputs {
            grads.push(weight_grad);
            if self.bias.is_some() {
                grads.push(bias_grad);
            }
        }
        grads.resize_with(self.inputs, || None);
        Ok(grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{fp8_max, AmaxAlgorithm, Fp8Format, Fp8Scaling};

    const TOKENS: i64 = 32;
    const IN: i64 = 32;
    const OUT: i64 = 48;

    /// Deterministic values in `±(1 + seed)` that look random (a sine hash), without the
    /// global generator, which parallel tests share. Smooth values would cancel in the dot
    /// products and inflate fp8's relative error.
    fn values(shape: &[i64], seed: f64, kind: Kind) -> Tensor {
        let count: i64 = shape.iter().product();
        let t = ((Tensor::arange(count, (Kind::Float, Device::Cpu)) * 12.9898 + seed * 78.233)
            .sin()
            * 43758.5453)
            .frac();
        ((t - 0.5) * (2.0 + 2.0 * seed)).view(shape).to_kind(kind)
    }

    fn recipe(format: Fp8Format, wgrad: bool) -> Fp8Recipe {
        Fp8Recipe {
            format,
            scaling: Fp8Scaling::Tensorwise,
            wgrad,
        }
    }

    /// What an fp8 type makes of `x` under current scaling, written out independently of
    /// `TensorScaling`: scale the amax to the largest value, round, scale back.
    fn fake_quantize(x: &Tensor, kind: Kind) -> Tensor {
        let x = x.to_kind(Kind::Float);
        let scale = fp8_max(kind) / x.abs().max().double_value(&[]);
        (&x * scale).to_kind(kind).to_kind(Kind::Float) / scale
    }

    fn relative_difference(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[])
    }

    struct Run {
        output: Tensor,
        input_grad: Tensor,
        weight_grad: Tensor,
        bias_grad: Tensor,
    }

    /// One forward and backward of `[2, TOKENS/2, IN]` inputs through the fp8 linear, the loss
    /// weighting every output differently; with `main_grad` the gradients of the parameters
    /// come from their float32 main-gradient views.
    fn run(kind: Kind, recipe: Fp8Recipe, main_grad: bool) -> Run {
        run_on(Device::Cpu, kind, recipe, main_grad)
    }

    fn run_on(device: Device, kind: Kind, recipe: Fp8Recipe, main_grad: bool) -> Run {
        let input = values(&[2, TOKENS / 2, IN], 0.0, kind)
            .to_device(device)
            .set_requires_grad(true);
        let weight = Param::new(values(&[OUT, IN], 1.0, kind).to_device(device));
        let bias = Param::new(values(&[OUT], 2.0, kind).to_device(device));
        if main_grad {
            weight
                .main_grad()
                .set(Some(Tensor::zeros([OUT, IN], (Kind::Float, device))));
            bias.main_grad()
                .set(Some(Tensor::zeros([OUT], (Kind::Float, device))));
        }
        let fp8 = Arc::new(Fp8Linear::new(recipe));
        let output = linear(&input, &weight, Some(&bias), &fp8).unwrap();
        let loss_weights = values(&[2, TOKENS / 2, OUT], 3.0, Kind::Float).to_device(device);
        (output.to_kind(Kind::Float) * &loss_weights)
            .sum(Kind::Float)
            .backward();
        let (weight_grad, bias_grad) = if main_grad {
            assert!(!weight.grad().defined() && !bias.grad().defined());
            (
                weight.main_grad().get().unwrap().shallow_clone(),
                bias.main_grad().get().unwrap().shallow_clone(),
            )
        } else {
            (weight.grad(), bias.grad())
        };
        let cpu = |t: Tensor| t.to_device(Device::Cpu);
        Run {
            output: cpu(output.detach()),
            input_grad: cpu(input.grad()),
            weight_grad: cpu(weight_grad),
            bias_grad: cpu(bias_grad),
        }
    }

    /// The same linear with every GEMM operand quantized and dequantized explicitly in float32.
    fn reference(format: Fp8Format, fp8_wgrad: bool) -> Run {
        reference_from(Kind::Float, format, fp8_wgrad)
    }

    /// [`reference`] for inputs rounded to `kind` first.
    fn reference_from(kind: Kind, format: Fp8Format, fp8_wgrad: bool) -> Run {
        let grad_kind = recipe(format, true).backward_kind();
        let value = |shape: &[i64], seed| values(shape, seed, kind).to_kind(Kind::Float);
        let x = value(&[TOKENS, IN], 0.0);
        let w = value(&[OUT, IN], 1.0);
        let b = value(&[OUT], 2.0);
        // The loss weights, as the gradient reaching an output of dtype `kind`.
        let dy = value(&[TOKENS, OUT], 3.0);
        let (xq, wq, dyq) = (
            fake_quantize(&x, Kind::Float8e4m3fn),
            fake_quantize(&w, Kind::Float8e4m3fn),
            fake_quantize(&dy, grad_kind),
        );
        let weight_grad = if fp8_wgrad {
            dyq.tr().mm(&xq)
        } else {
            dy.tr().mm(&x)
        };
        Run {
            output: xq.mm(&wq.tr()) + &b,
            input_grad: dyq.mm(&wq),
            weight_grad,
            bias_grad: dy.sum_dim_intlist([0i64].as_slice(), false, Kind::Float),
        }
    }

    fn assert_close(run: &Run, expected: &Run, tolerance: f64) {
        for (name, got, want) in [
            ("output", &run.output, &expected.output),
            ("input gradient", &run.input_grad, &expected.input_grad),
            ("weight gradient", &run.weight_grad, &expected.weight_grad),
            ("bias gradient", &run.bias_grad, &expected.bias_grad),
        ] {
            let got = got.reshape(want.size().as_slice());
            let difference = relative_difference(&got, want);
            assert!(
                difference <= tolerance,
                "{name} differs by {difference} (relative to its largest entry)"
            );
        }
    }

    #[test]
    fn hybrid_gemms_equal_explicit_quantization_in_float32() {
        let run = run(Kind::Float, recipe(Fp8Format::Hybrid, true), false);
        assert_close(&run, &reference(Fp8Format::Hybrid, true), 1e-5);
    }

    #[test]
    fn e4m3_gemms_equal_explicit_quantization_in_float32() {
        let run = run(Kind::Float, recipe(Fp8Format::E4m3, true), false);
        assert_close(&run, &reference(Fp8Format::E4m3, true), 1e-5);
    }

    #[test]
    fn without_fp8_wgrad_the_weight_gradient_is_the_unquantized_one() {
        let run = run(Kind::Float, recipe(Fp8Format::Hybrid, false), false);
        assert_close(&run, &reference(Fp8Format::Hybrid, false), 1e-5);
    }

    #[test]
    fn main_gradients_get_what_autograd_would() {
        for wgrad in [true, false] {
            let recipe = recipe(Fp8Format::Hybrid, wgrad);
            let fused = run(Kind::Float, recipe, true);
            assert_close(&fused, &run(Kind::Float, recipe, false), 1e-5);
        }
    }

    #[test]
    fn bf16_fp8_linear_stays_near_the_bf16_linear() {
        let input = values(&[2, TOKENS / 2, IN], 0.0, Kind::BFloat16).set_requires_grad(true);
        let weight = Param::new(values(&[OUT, IN], 1.0, Kind::BFloat16));
        let bias = Param::new(values(&[OUT], 2.0, Kind::BFloat16));
        let output = input.linear(&weight, Some(&*bias));
        let loss_weights = values(&[2, TOKENS / 2, OUT], 3.0, Kind::Float);
        (output.to_kind(Kind::Float) * &loss_weights)
            .sum(Kind::Float)
            .backward();
        let plain = Run {
            output: output.detach(),
            input_grad: input.grad(),
            weight_grad: weight.grad(),
            bias_grad: bias.grad(),
        };
        for format in [Fp8Format::Hybrid, Fp8Format::E4m3] {
            let fp8 = run(Kind::BFloat16, recipe(format, true), true);
            assert_eq!(fp8.output.kind(), Kind::BFloat16);
            assert_eq!(fp8.input_grad.kind(), Kind::BFloat16);
            // e4m3 keeps 3 mantissa bits, e5m2 2: a few percent of the largest entry (3.5% to
            // 7.8% for these values in float32).
            assert_close(&fp8, &plain, 0.1);
        }
    }

    #[test]
    fn delayed_scaling_trains_through_the_linear() {
        let recipe = Fp8Recipe {
            format: Fp8Format::Hybrid,
            scaling: Fp8Scaling::Delayed {
                history_len: 4,
                algorithm: AmaxAlgorithm::Max,
                margin: 0,
            },
            wgrad: true,
        };
        // The same input twice: the second use's scales come from the first use's amaxes,
        // which are this input's, so both uses equal current scaling.
        let fp8 = Arc::new(Fp8Linear::new(recipe));
        let weight = Param::new(values(&[OUT, IN], 1.0, Kind::Float));
        let input = values(&[TOKENS, IN], 0.0, Kind::Float);
        let expected = reference(Fp8Format::Hybrid, true).output;
        for _ in 0..2 {
            let output = linear(&input, &weight, None, &fp8).unwrap();
            let bias = values(&[OUT], 2.0, Kind::Float);
            assert!(relative_difference(&(output + bias), &expected) <= 1e-5);
        }
    }

    /// bf16 operands give the explicit float32 quantization's results to bf16 precision, for
    /// both formats, both weight-gradient precisions, with main gradients and without.
    fn check_bf16_against_explicit_quantization(device: Device) {
        for format in [Fp8Format::Hybrid, Fp8Format::E4m3] {
            for wgrad in [true, false] {
                let expected = reference_from(Kind::BFloat16, format, wgrad);
                for main_grad in [true, false] {
                    let run = run_on(device, Kind::BFloat16, recipe(format, wgrad), main_grad);
                    assert_eq!(run.output.kind(), Kind::BFloat16);
                    assert_close(&run, &expected, 1e-2);
                }
            }
        }
    }

    #[test]
    fn bf16_gemms_equal_explicit_quantization() {
        check_bf16_against_explicit_quantization(Device::Cpu);
    }

    /// The same on a GPU, through cuBLASLt's fp8 GEMMs and their layout rules.
    #[test]
    fn on_a_gpu_fp8_gemms_equal_explicit_quantization() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        check_bf16_against_explicit_quantization(Device::Cuda(0));
    }
}
