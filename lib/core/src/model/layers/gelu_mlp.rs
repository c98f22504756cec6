//! The MLP's fc1 → bias + tanh-GeLU → fc2 on one rank as a single autograd node whose GEMMs
//! carry the bias and GeLU in cuBLASLt epilogues ([`crate::ops::gemm_epilogue`]), as
//! Transformer Engine's fused MLP does:
//! - forward: fc1's GEMM writes GeLU's output and keeps its argument for backward;
//! - backward: the GEMM through fc2's weight writes GeLU's gradient and fc1's bias gradient
//!   directly, so neither GeLU pass nor fc1's bias reduction runs as a kernel of its own.
//!
//! Weight and bias gradients go into the optimizer's float32 main-gradient views, as with
//! gradient-accumulation fusion, which is what makes a node spanning two linears simple: none of
//! its parameters needs an autograd gradient.

use anyhow::{Context, Result};
use tch::Tensor;

use super::main_grad_linear::accumulate_parameter_grads;
use crate::autograd::{self, CustomFunction, SavedTensors};
use crate::model::param::Param;
use crate::ops::gemm_epilogue;

/// fc1's and fc2's parameters on this rank; `fc2_bias` only where this rank adds it (one
/// tensor-parallel rank).
pub struct GeluMlpParams<'a> {
    pub fc1_weight: &'a Param,
    pub fc1_bias: &'a Param,
    pub fc2_weight: &'a Param,
    pub fc2_bias: Option<&'a Param>,
}

/// This rank's `fc2(gelu_tanh(fc1(input)))` (`[..., hidden]` → `[..., out]`) through the
/// epilogues, or `None` where they do not apply: no gradient wanted, not a CUDA bf16/fp16
/// model, widths the epilogues cannot take, or parameters without main-gradient views.
pub fn forward(input: &Tensor, params: &GeluMlpParams) -> Result<Option<Tensor>> {
    if !input.requires_grad() {
        return Ok(None);
    }
    let weight = &**params.fc1_weight;
    let widths = [
        weight.size()[1],
        weight.size()[0],
        params.fc2_weight.size()[0],
    ];
    if !gemm_epilogue::supports(input.kind(), &widths)
        || !gemm_epilogue::usable_on(input.device(), input.kind())
    {
        return Ok(None);
    }
    let main_grad = |p: &Param| p.main_grad().get();
    let (Some(fc1_weight_grad), Some(fc1_bias_grad), Some(fc2_weight_grad)) = (
        main_grad(params.fc1_weight),
        main_grad(params.fc1_bias),
        main_grad(params.fc2_weight),
    ) else {
        return Ok(None);
    };
    let fc2_bias_grad = match params.fc2_bias {
        Some(bias) => match main_grad(bias) {
            Some(view) => Some(view),
            None => return Ok(None),
        },
        None => None,
    };
    let function = GeluMlp {
        fc1_weight: params.fc1_weight.tensor().shallow_clone(),
        fc1_bias: params.fc1_bias.tensor().shallow_clone(),
        fc2_weight: params.fc2_weight.tensor().shallow_clone(),
        fc2_bias: params.fc2_bias.map(|b| b.tensor().shallow_clone()),
        fc1_weight_grad,
        fc1_bias_grad,
        fc2_weight_grad,
        fc2_bias_grad,
    };
    let mut outputs = autograd::apply(function, &[input]).context("fused bias + GeLU MLP")?;
    Ok(Some(outputs.remove(0)))
}

struct GeluMlp {
    fc1_weight: Tensor,
    fc1_bias: Tensor,
    fc2_weight: Tensor,
    fc2_bias: Option<Tensor>,
    fc1_weight_grad: Tensor,
    fc1_bias_grad: Tensor,
    fc2_weight_grad: Tensor,
    fc2_bias_grad: Option<Tensor>,
}

impl CustomFunction for GeluMlp {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let input = &inputs[0];
        let shape = input.size();
        let rows = input.reshape([-1, shape[shape.len() - 1]]);
        let (activated, preactivation) =
            gemm_epilogue::linear_gelu_with_preactivation(&rows, &self.fc1_weight, &self.fc1_bias)?;
        let output = activated.linear(&self.fc2_weight, self.fc2_bias.as_ref());
        saved.save(&rows);
        saved.save(&preactivation);
        saved.save(&activated);
        let mut out_shape = shape;
        *out_shape.last_mut().expect("an input has dimensions") = self.fc2_weight.size()[0];
        Ok(vec![output.view(out_shape.as_slice())])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let (rows, preactivation, activated) = (&saved[0], &saved[1], &saved[2]);
        let grad = &grad_outputs[0];
        let grad_rows = grad.reshape([-1, grad.size()[grad.dim() - 1]]);
        accumulate_parameter_grads(
            &grad_rows,
            activated,
            &self.fc2_weight_grad,
            self.fc2_bias_grad.as_ref(),
        )?;
        let (grad_preactivation, fc1_bias_grad) =
            gemm_epilogue::gelu_backward_through(&grad_rows, &self.fc2_weight, preactivation)?;
        accumulate_parameter_grads(&grad_preactivation, rows, &self.fc1_weight_grad, None)?;
        let _ = self.fc1_bias_grad.shallow_clone().f_add_(&fc1_bias_grad)?;
        let grad_input = grad_preactivation.matmul(&self.fc1_weight);
        let mut input_shape = grad.size();
        *input_shape.last_mut().expect("a gradient has dimensions") = rows.size()[1];
        Ok(vec![Some(grad_input.view(input_shape.as_slice()))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// Deterministic values without the global generator, which parallel tests share.
    fn values(shape: &[i64], seed: f64, scale: f64) -> Tensor {
        let count: i64 = shape.iter().product();
        ((Tensor::arange(count, (Kind::Float, Device::Cpu)) * seed).sin() * scale).view(shape)
    }

    fn relative_error(got: &Tensor, want: &Tensor) -> f64 {
        let want = want.to_kind(Kind::Float);
        let scale = want.abs().max().double_value(&[]).max(1e-12);
        (got.to_kind(Kind::Float) - want)
            .abs()
            .max()
            .double_value(&[])
            / scale
    }

    /// On a GPU, in bf16: two forward/backward passes through the fused node give the plain
    /// ops' outputs and input gradients, and leave the plain ops' parameter gradients (summed
    /// over both passes) in the main-gradient views, all within bf16 rounding.
    #[test]
    fn the_fused_mlp_equals_the_plain_ops_on_a_gpu() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let device = Device::Cuda(0);
        let kind = Kind::BFloat16;
        let (h, f) = (64, 256);
        let shapes: [&[i64]; 4] = [&[f, h], &[f], &[h, f], &[h]];
        let initial: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                values(s, 0.3 + 0.17 * i as f64, 0.2)
                    .to_kind(kind)
                    .to_device(device)
            })
            .collect();
        let params: Vec<Param> = initial.iter().map(|t| Param::new(t.copy())).collect();
        for p in &params {
            p.main_grad()
                .set(Some(Tensor::zeros(p.size(), (Kind::Float, device))));
        }
        let plain: Vec<Tensor> = initial
            .iter()
            .map(|t| t.to_kind(Kind::Float).set_requires_grad(true))
            .collect();
        let inputs: Vec<Tensor> = (0..2)
            .map(|i| {
                values(&[3, 40, h], 0.7 + i as f64, 1.0)
                    .to_kind(kind)
                    .to_device(device)
            })
            .collect();
        let weights = values(&[3, 40, h], 0.41, 1.0).to_device(device);
        let mlp = GeluMlpParams {
            fc1_weight: &params[0],
            fc1_bias: &params[1],
            fc2_weight: &params[2],
            fc2_bias: Some(&params[3]),
        };
        for input in &inputs {
            let fused_input = input.detach().set_requires_grad(true);
            let fused = forward(&fused_input, &mlp)
                .unwrap()
                .expect("the fused path applies");
            (fused.to_kind(Kind::Float) * &weights)
                .sum(Kind::Float)
                .backward();

            let plain_input = input.to_kind(Kind::Float).set_requires_grad(true);
            let expected = plain_input
                .linear(&plain[0], Some(&plain[1]))
                .gelu("tanh")
                .linear(&plain[2], Some(&plain[3]));
            (&expected * &weights).sum(Kind::Float).backward();
            let error = relative_error(&fused, &expected);
            assert!(error < 2e-2, "outputs differ by {error:.3e}");
            let error = relative_error(&fused_input.grad(), &plain_input.grad());
            assert!(error < 2e-2, "input gradients differ by {error:.3e}");
        }
        for (i, (param, reference)) in params.iter().zip(&plain).enumerate() {
            assert!(
                !param.grad().defined(),
                "parameter {i} got an autograd gradient"
            );
            let error = relative_error(&param.main_grad().get().unwrap(), &reference.grad());
            assert!(
                error < 2e-2,
                "parameter {i}'s gradients differ by {error:.3e}"
            );
        }
    }

    #[test]
    fn without_a_gradient_or_off_a_gpu_the_plain_ops_run() {
        let params: Vec<Param> = [[16i64, 8].as_slice(), &[16], &[8, 16], &[8]]
            .iter()
            .map(|s| Param::new(Tensor::zeros(*s, (Kind::BFloat16, Device::Cpu))))
            .collect();
        let mlp = GeluMlpParams {
            fc1_weight: &params[0],
            fc1_bias: &params[1],
            fc2_weight: &params[2],
            fc2_bias: Some(&params[3]),
        };
        let input = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        assert!(forward(&input, &mlp).unwrap().is_none());
        assert!(forward(&input.set_requires_grad(true), &mlp)
            .unwrap()
            .is_none());
    }
}
