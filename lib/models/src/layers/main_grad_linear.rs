//! Gradient-accumulation fusion (Megatron's `--gradient-accumulation-fusion`): a linear whose
//! backward adds the weight's and bias's gradients straight into the optimizer's float32
//! buffer. The weight-gradient GEMM accumulates into float32 with `beta = 1` (cuBLAS with
//! bf16/fp16 inputs and a float32 output), so no low-precision gradient is written, added to
//! the buffer and zeroed afterwards; the bias gradient is a GEMV of the same kind.

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use crate::param::{MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::bias_grad;

/// `input · weightᵀ (+ bias)`; when the optimizer gave `weight` (and `bias`) a main-gradient
/// view, their gradients go there and their `grad` stays undefined. Otherwise a plain linear.
pub fn linear(input: &Tensor, weight: &Param, bias: Option<&Param>) -> Result<Tensor> {
    let Some(weight_grad) = weight.main_grad().get() else {
        return Ok(input.linear(&**weight, bias.map(|b| &**b)));
    };
    let bias_grad = match bias {
        Some(bias) => match bias.main_grad().get() {
            Some(view) => Some(view),
            // A bias without a view learns through autograd: keep the plain op.
            None => return Ok(input.linear(&**weight, Some(&**bias))),
        },
        None => None,
    };
    // The parameters get no autograd gradient, so they are inputs of the graph node only
    // when the activation alone would not put the node in the graph; otherwise every step
    // would run an AccumulateGrad node per parameter for nothing.
    let mut inputs = vec![input];
    if !input.requires_grad() {
        inputs.push(weight.tensor());
        inputs.extend(bias.map(|b| b.tensor()));
    }
    let function = MainGradLinear {
        weight: weight.tensor().shallow_clone(),
        bias: bias.map(|b| b.tensor().shallow_clone()),
        weight_grad,
        bias_grad,
        inputs: inputs.len(),
    };
    let mut outputs = autograd::apply(function, &inputs).context("fused-gradient linear")?;
    Ok(outputs.remove(0))
}

struct MainGradLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    weight_grad: MainGrad,
    bias_grad: Option<MainGrad>,
    /// How many tensors the graph node was given (the input, perhaps the parameters).
    inputs: usize,
}

impl CustomFunction for MainGradLinear {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let input = &inputs[0];
        saved.save(input);
        Ok(vec![input.linear(&self.weight, self.bias.as_ref())])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (grad, input) = (&grad_outputs[0], &saved[0]);
        let grad_input = grad.matmul(&self.weight);
        let out_features = grad.size().last().copied().unwrap_or(1);
        let in_features = input.size().last().copied().unwrap_or(1);
        accumulate_parameter_grads(
            &grad.reshape([-1, out_features]),
            &input.reshape([-1, in_features]),
            &self.weight_grad,
            self.bias_grad.as_ref(),
        )?;
        let mut grads = vec![Some(grad_input)];
        grads.resize_with(self.inputs, || None);
        Ok(grads)
    }
}

/// Adds a linear's weight gradient `gradᵀ · input` (and bias gradient, the sum of `grad`'s
/// rows: our column-sum kernel for narrow layers on a GPU, else a GEMV) for `[rows, out]` output
/// gradients and `[rows, in]` inputs into float32 main-gradient views, and says so to them.
pub(crate) fn accumulate_parameter_grads(
    grad: &Tensor,
    input: &Tensor,
    weight_grad: &MainGrad,
    bias_grad: Option<&MainGrad>,
) -> Result<()> {
    accumulate_product(weight_grad, &grad.tr(), input)?;
    weight_grad.accumulated();
    if let Some(bias_grad) = bias_grad {
        let (rows, out_features) = (grad.size()[0], grad.size()[1]);
        if bias_grad::sums_bias_of(grad.device(), grad.kind(), out_features) {
            bias_grad::add_bias_grad(grad, bias_grad)?;
        } else {
            let ones = ones_row(rows, grad.kind(), grad.device());
            accumulate_product(&bias_grad.view([1, out_features]), &ones, grad)?;
        }
        bias_grad.accumulated();
    }
    Ok(())
}

thread_local! {
    /// The longest row of ones asked for on this thread (backward runs on one autograd thread
    /// per device), so a bias gradient needs no allocation and fill per call.
    static ONES: std::cell::RefCell<Option<Tensor>> = const { std::cell::RefCell::new(None) };
}

/// A `[1, n]` row of ones: the bias gradient is `onesᵀ · grad`, a GEMV that accumulates into
/// float32 like the weight's GEMM.
pub(crate) fn ones_row(n: i64, kind: Kind, device: Device) -> Tensor {
    ONES.with(|cache| {
        let mut cache = cache.borrow_mut();
        let fits = cache
            .as_ref()
            .is_some_and(|t| t.size()[1] >= n && t.kind() == kind && t.device() == device);
        if !fits {
            *cache = Some(Tensor::ones([1, n], (kind, device)));
        }
        let ones = cache.as_ref().expect("filled above");
        ones.narrow(1, 0, n)
    })
}

/// `target += a · b` with `target` float32 and `a`, `b` of the activations' dtype, rounding
/// only once, in float32.
pub(crate) fn accumulate_product(target: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.kind() == target.kind() {
        let _ = target.shallow_clone().f_addmm_(a, b)?;
    } else if matches!(target.device(), Device::Cuda(_)) {
        let _ = target.f_addmm_dtype_out(target, a, b, Kind::Float)?;
    } else {
        // libtorch's CPU GEMMs have no mixed-precision output.
        let _ = target
            .shallow_clone()
            .f_add_(&a.matmul(b).to_kind(Kind::Float))?;
    }
    Ok(())
}

/// `a · b` in float32 for `a`, `b` of the activations' dtype, rounding only once, in float32.
pub(crate) fn product_in_float(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if a.kind() == Kind::Float {
        Ok(a.f_matmul(b)?)
    } else if matches!(a.device(), Device::Cuda(_)) {
        Ok(a.f_mm_dtype(b, Kind::Float)?)
    } else {
        // libtorch's CPU GEMMs have no mixed-precision output.
        Ok(a.f_matmul(b)?.to_kind(Kind::Float))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values without the global generator, which parallel tests share.
    fn param(shape: &[i64], seed: i64, kind: Kind) -> Param {
        let count: i64 = shape.iter().product();
        let values =
            (Tensor::arange(count, (Kind::Float, Device::Cpu)) * (0.7 + seed as f64)).sin();
        Param::new(values.view(shape).to_kind(kind))
    }

    /// Two backward passes through the fused linear leave in the main-gradient views what two
    /// passes through the plain op leave in `grad` (relative to its largest entry), and the
    /// same input gradients.
    fn check(kind: Kind, tolerance: f64) {
        let (weight, bias) = (param(&[5, 3], 1, kind), param(&[5], 2, kind));
        let inputs: Vec<Tensor> = (0..2)
            .map(|i| {
                param(&[4, 2, 3], 10 + i, kind)
                    .tensor()
                    .detach()
                    .set_requires_grad(true)
            })
            .collect();
        let mut plain_input_grads = Vec::new();
        for input in &inputs {
            let out = input.linear(&*weight, Some(&*bias));
            out.square().sum(Kind::Float).backward();
            plain_input_grads.push(input.grad().copy());
            let _ = input.grad().zero_();
        }
        let (plain_weight, plain_bias) = (
            weight.grad().to_kind(Kind::Float).copy(),
            bias.grad().to_kind(Kind::Float).copy(),
        );
        let _ = weight.grad().zero_();
        let _ = bias.grad().zero_();

        let (fused_weight, fused_bias) = (param(&[5, 3], 1, kind), param(&[5], 2, kind));
        fused_weight
            .main_grad()
            .set(Some(Tensor::zeros([5, 3], (Kind::Float, Device::Cpu))));
        fused_bias
            .main_grad()
            .set(Some(Tensor::zeros([5], (Kind::Float, Device::Cpu))));
        for (input, expected) in inputs.iter().zip(&plain_input_grads) {
            let out = linear(input, &fused_weight, Some(&fused_bias)).unwrap();
            out.square().sum(Kind::Float).backward();
            let scale = expected.abs().max().double_value(&[]);
            let diff = (input.grad() - expected).abs().max().double_value(&[]) / scale;
            assert!(
                diff <= tolerance,
                "input gradient differs by {diff} (relative)"
            );
        }
        assert!(!fused_weight.grad().defined() && !fused_bias.grad().defined());
        for (main, plain) in [
            (
                fused_weight.main_grad().get().unwrap().shallow_clone(),
                plain_weight,
            ),
            (
                fused_bias.main_grad().get().unwrap().shallow_clone(),
                plain_bias,
            ),
        ] {
            let scale = plain.abs().max().double_value(&[]);
            let diff = (main - plain).abs().max().double_value(&[]) / scale;
            assert!(
                diff <= tolerance,
                "main gradient differs by {diff} (relative)"
            );
        }
    }

    #[test]
    fn fused_gradients_equal_the_plain_linear_in_float32() {
        check(Kind::Float, 1e-5);
    }

    #[test]
    fn fused_gradients_accumulate_in_float32_for_bfloat16_weights() {
        // The plain path rounds each pass's gradient to bf16 before adding; the fused one
        // does not, so they agree to bf16 precision only.
        check(Kind::BFloat16, 1e-2);
    }

    #[test]
    fn an_input_without_gradient_still_accumulates_the_weight_gradient() {
        let weight = param(&[5, 3], 1, Kind::Float);
        weight
            .main_grad()
            .set(Some(Tensor::zeros([5, 3], (Kind::Float, Device::Cpu))));
        let input = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        linear(&input, &weight, None)
            .unwrap()
            .sum(Kind::Float)
            .backward();
        let expected = Tensor::full([5, 3], 2.0, (Kind::Float, Device::Cpu));
        assert!(weight
            .main_grad()
            .get()
            .unwrap()
            .shallow_clone()
            .equal(&expected));
        assert!(!weight.grad().defined());
    }

    #[test]
    fn without_a_main_gradient_view_the_weight_learns_through_autograd() {
        let (weight, bias) = (param(&[5, 3], 1, Kind::Float), param(&[5], 2, Kind::Float));
        let input = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        linear(&input, &weight, Some(&bias))
            .unwrap()
            .sum(Kind::Float)
            .backward();
        assert!(weight.grad().defined() && bias.grad().defined());
    }
}
