//! The MLP's fc1 with its bias and tanh-GeLU in the GEMM's cuBLASLt epilogue
//! ([`megatron_kernels::ops::gemm_epilogue`]): one GEMM writes GeLU's output and keeps its argument for
//! backward, so the forward GeLU is no kernel of its own (Megatron's `--bias-gelu-fusion`).
//! Backward is GeLU's gradient with fc1's bias gradient summed from it in one kernel
//! ([`megatron_kernels::ops::bias_grad`]; ATen's GeLU gradient and a GEMV where that kernel is off),
//! and the fused weight-gradient accumulation of [`super::main_grad_linear`]. (cuBLASLt's matching backward epilogue, GeLU gradient plus
//! bias gradient, runs as a separate slow kernel on Hopper: 0.3 ms a call for GPT-345M's fc1
//! against 0.09 ms for the two ops it replaces, so it is not used.)

use anyhow::{Context, Result};
use tch::Tensor;

use super::main_grad_linear::accumulate_parameter_grads;
use crate::param::{MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::{bias_grad, gemm_epilogue};

/// `gelu_tanh(input · weightᵀ + bias)` through the epilogue, or `None` where it does not apply:
/// no gradient wanted, not a CUDA bf16/fp16 model, widths the epilogue cannot take, or
/// parameters without main-gradient views (gradient-accumulation fusion off).
pub fn forward(input: &Tensor, weight: &Param, bias: &Param) -> Result<Option<Tensor>> {
    if !input.requires_grad() {
        return Ok(None);
    }
    let widths = [weight.size()[1], weight.size()[0]];
    if !gemm_epilogue::supports(input.kind(), &widths)
        || !gemm_epilogue::usable_on(input.device(), input.kind())
    {
        return Ok(None);
    }
    let (Some(weight_grad), Some(bias_grad)) = (weight.main_grad().get(), bias.main_grad().get())
    else {
        return Ok(None);
    };
    let function = LinearGelu {
        weight: weight.tensor().shallow_clone(),
        bias: bias.tensor().shallow_clone(),
        weight_grad,
        bias_grad,
    };
    let mut outputs = autograd::apply(function, &[input]).context("fc1 with bias + GeLU")?;
    Ok(Some(outputs.remove(0)))
}

struct LinearGelu {
    weight: Tensor,
    bias: Tensor,
    weight_grad: MainGrad,
    bias_grad: MainGrad,
}

impl CustomFunction for LinearGelu {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let input = &inputs[0];
        let shape = input.size();
        let rows = input.reshape([-1, shape[shape.len() - 1]]);
        let (activated, preactivation) =
            gemm_epilogue::linear_gelu_with_preactivation(&rows, &self.weight, &self.bias)?;
        saved.save(&rows);
        saved.save(&preactivation);
        let mut out_shape = shape;
        *out_shape.last_mut().expect("an input has dimensions") = self.weight.size()[0];
        Ok(vec![activated.view(out_shape.as_slice())])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (rows, preactivation) = (&saved[0], &saved[1]);
        let grad = &grad_outputs[0];
        let grad_rows = grad.reshape([-1, grad.size()[grad.dim() - 1]]);
        let columns = grad_rows.size()[1];
        let grad_preactivation =
            if bias_grad::usable_on(grad_rows.device(), grad_rows.kind(), columns) {
                // One pass: GeLU's gradient and, summed from it, the bias's.
                let grad_preactivation = bias_grad::gelu_backward_with_bias_grad(
                    &grad_rows,
                    preactivation,
                    &self.bias_grad,
                )?;
                self.bias_grad.accumulated();
                accumulate_parameter_grads(&grad_preactivation, rows, &self.weight_grad, None)?;
                grad_preactivation
            } else {
                let grad_preactivation = preactivation.gelu_backward(&grad_rows, "tanh");
                accumulate_parameter_grads(
                    &grad_preactivation,
                    rows,
                    &self.weight_grad,
                    Some(&self.bias_grad),
                )?;
                grad_preactivation
            };
        let grad_input = grad_preactivation.matmul(&self.weight);
        let mut input_shape = grad.size();
        *input_shape.last_mut().expect("a gradient has dimensions") = rows.size()[1];
        Ok(vec![Some(grad_input.view(input_shape.as_slice()))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::main_grad_linear::linear;
    use megatron_kernels::ops::relative_error;
    use tch::{Device, Kind};

    /// Deterministic values without the global generator, which parallel tests share.
    fn values(shape: &[i64], seed: f64, scale: f64) -> Tensor {
        let count: i64 = shape.iter().product();
        ((Tensor::arange(count, (Kind::Float, Device::Cpu)) * seed).sin() * scale).view(shape)
    }

    /// On a GPU, in bf16: two forward/backward passes through the fused fc1 give what the
    /// unfused layers (the linear with gradient-accumulation fusion, then ATen's GeLU) give:
    /// outputs and input gradients, and the parameter gradients summed over both passes in the
    /// main-gradient views, all within bf16 rounding.
    #[test]
    fn the_fused_fc1_equals_the_unfused_layers_on_a_gpu() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        let kind = Kind::BFloat16;
        let (h, f) = (64, 256);
        let initial = [values(&[f, h], 0.3, 0.2), values(&[f], 0.47, 0.2)]
            .map(|t| t.to_kind(kind).to_device(device));
        let with_main_grads = || {
            let params = initial.each_ref().map(|t| Param::new(t.copy()));
            for p in &params {
                p.main_grad()
                    .set(Some(Tensor::zeros(p.size(), (Kind::Float, device))));
            }
            params
        };
        let (fused_params, plain_params) = (with_main_grads(), with_main_grads());
        let weights = values(&[3, 40, f], 0.41, 1.0).to_device(device);
        for i in 0..2 {
            let input = values(&[3, 40, h], 0.7 + i as f64, 1.0)
                .to_kind(kind)
                .to_device(device);
            let fused_input = input.detach().set_requires_grad(true);
            let fused = forward(&fused_input, &fused_params[0], &fused_params[1])
                .unwrap()
                .expect("the fused path applies");
            (fused.to_kind(Kind::Float) * &weights)
                .sum(Kind::Float)
                .backward();

            let plain_input = input.detach().set_requires_grad(true);
            let expected = linear(&plain_input, &plain_params[0], Some(&plain_params[1]))
                .unwrap()
                .gelu("tanh");
            (expected.to_kind(Kind::Float) * &weights)
                .sum(Kind::Float)
                .backward();
            let error = relative_error(&fused, &expected);
            assert!(error < 1e-2, "outputs differ by {error:.3e}");
            let error = relative_error(&fused_input.grad(), &plain_input.grad());
            assert!(error < 1e-2, "input gradients differ by {error:.3e}");
        }
        for (i, (fused, plain)) in fused_params.iter().zip(&plain_params).enumerate() {
            assert!(
                !fused.grad().defined(),
                "parameter {i} got an autograd gradient"
            );
            let (got, want) = (
                fused.main_grad().get().unwrap(),
                plain.main_grad().get().unwrap(),
            );
            let error = relative_error(&got, &want);
            assert!(
                error < 1e-2,
                "parameter {i}'s gradients differ by {error:.3e}"
            );
        }
    }

    #[test]
    fn without_a_gradient_or_off_a_gpu_the_plain_ops_run() {
        let weight = Param::new(Tensor::zeros([16, 8], (Kind::BFloat16, Device::Cpu)));
        let bias = Param::new(Tensor::zeros([16], (Kind::BFloat16, Device::Cpu)));
        let input = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        assert!(forward(&input, &weight, &bias).unwrap().is_none());
        let input = input.set_requires_grad(true);
        assert!(forward(&input, &weight, &bias).unwrap().is_none());
    }
}
