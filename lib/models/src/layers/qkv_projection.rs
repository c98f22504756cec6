//! Self-attention's QKV projection with gradient-accumulation fusion, returning its query, key
//! and value parts as views of the output. Attention's backward returns the three parts'
//! gradients as separate tensors; libtorch would concatenate them into the packed layout the
//! projection's backward multiplies, and a GEMV would read that again for the bias gradient.
//! On GPUs one kernel ([`megatron_kernels::ops::bias_grad::pack_qkv_grad`]) writes the packed gradient and
//! sums the bias gradient into its float32 main gradient in the same pass (GPT-1.3B on an H100:
//! a 70 µs concatenation and a 43 µs GEMV a layer and micro-batch). Where the kernel does not
//! run (CPUs, fp32, `MEGATRON_RS_FUSED_BIAS_GRAD=0`) the backward concatenates and sums as the
//! plain linear does, the same values, so the CPU suites run this function too.

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::main_grad_linear::accumulate_parameter_grads;
use crate::param::{MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::bias_grad;

/// Widths of the packed output per query group: the group's queries (`heads per group ×
/// head_dim`), then its key and its value (`head_dim` each), Megatron's layout.
#[derive(Clone, Copy, Debug)]
pub struct QkvLayout {
    pub groups: i64,
    pub query_width: i64,
    pub head_dim: i64,
}

impl QkvLayout {
    fn group_width(&self) -> i64 {
        self.query_width + 2 * self.head_dim
    }

    /// The widths of the query, key and value parts of a group.
    fn widths(&self) -> [i64; 3] {
        [self.query_width, self.head_dim, self.head_dim]
    }
}

/// The fused projection for `weight` and `bias` with `layout`, for activations of `kind` on
/// `device`, or `None` where its backward does not apply: no bias, or parameters without
/// main-gradient views (gradient-accumulation fusion off).
pub fn fused(
    weight: &Param,
    bias: Option<&Param>,
    layout: QkvLayout,
    kind: Kind,
    device: Device,
) -> Option<QkvProjection> {
    let bias = bias?;
    let columns = layout.groups * layout.group_width();
    if weight.size()[0] != columns {
        return None;
    }
    let kernel = bias_grad::supports(kind, layout.query_width)
        && bias_grad::supports(kind, layout.head_dim)
        && bias_grad::usable_on(device, kind, columns);
    Some(QkvProjection {
        weight: weight.tensor().shallow_clone(),
        bias: bias.tensor().shallow_clone(),
        weight_grad: weight.main_grad().get()?,
        bias_grad: bias.main_grad().get()?,
        layout,
        kernel,
    })
}

impl QkvProjection {
    /// `input · weightᵀ + bias` for `input` `[s, b, h]` (which requires a gradient) split into
    /// the query `[s, b, groups, query_width]`, key and value `[s, b, groups, head_dim]` parts.
    pub fn apply(self, input: &Tensor) -> Result<[Tensor; 3]> {
        let outputs = autograd::apply(self, &[input]).context("QKV projection")?;
        outputs
            .try_into()
            .map_err(|_| anyhow::anyhow!("the QKV projection returns three parts"))
    }
}

pub struct QkvProjection {
    weight: Tensor,
    bias: Tensor,
    weight_grad: MainGrad,
    bias_grad: MainGrad,
    layout: QkvLayout,
    /// Whether backward packs the gradient with [`bias_grad::pack_qkv_grad`].
    kernel: bool,
}

impl CustomFunction for QkvProjection {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let input = &inputs[0];
        let (s, b, _) = input.size3()?;
        saved.save(input);
        let packed = input.linear(&self.weight, Some(&self.bias)).view([
            s,
            b,
            self.layout.groups,
            self.layout.group_width(),
        ]);
        Ok(packed.split_with_sizes(self.layout.widths(), -1))
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let input = &saved[0];
        let (s, b, h) = input.size3()?;
        // A part no loss depends on has no gradient: its share of the packed one is zero.
        let groups = self.layout.groups;
        let parts: Vec<Tensor> = grad_outputs
            .iter()
            .zip(self.layout.widths())
            .map(|(grad, width)| {
                if grad.defined() {
                    grad.shallow_clone()
                } else {
                    Tensor::zeros([s, b, groups, width], (input.kind(), input.device()))
                }
            })
            .collect();
        // The kernel sums the bias gradient as it packs; without it the plain linear's sums do.
        let (packed, bias_grad) = if self.kernel {
            let packed =
                bias_grad::pack_qkv_grad(&parts[0], &parts[1], &parts[2], &self.bias_grad)?;
            self.bias_grad.accumulated();
            (packed, None)
        } else {
            (
                Tensor::cat(&parts, -1).view([s * b, -1]),
                Some(&self.bias_grad),
            )
        };
        accumulate_parameter_grads(
            &packed,
            &input.reshape([s * b, h]),
            &self.weight_grad,
            bias_grad,
        )?;
        Ok(vec![Some(packed.matmul(&self.weight).view([s, b, h]))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::main_grad_linear;

    /// Made-up parameters of `shape` in bf16 on `device` with float32 main-gradient views.
    fn param(shape: &[i64], step: f64, device: Device) -> Param {
        let count: i64 = shape.iter().product();
        let values = (Tensor::arange(count, (Kind::Float, device)) * step).sin() * 0.05;
        let param = Param::new(values.view(shape).to_kind(Kind::BFloat16));
        param
            .main_grad()
            .set(Some(Tensor::zeros(shape, (Kind::Float, device))));
        param
    }

    /// The fused projection gives the same outputs as the linear then split, and after two
    /// backward passes (parts' gradients in attention's `[b, heads, s, d]` memory order, one
    /// part without a gradient in the second) the same input gradients and main gradients:
    /// the weight's bit for bit (the same GEMMs on the same packed gradient), the bias's within
    /// float32 rounding of a different summation order (on a GPU, where the kernel sums it).
    fn check_equals_linear_then_split(device: Device) {
        let layout = QkvLayout {
            groups: 4,
            query_width: 2 * 64,
            head_dim: 64,
        };
        let (h, columns) = (256, 4 * 256);
        let pairs = [(0.37, 0.11), (0.37, 0.11)].map(|(w, b)| {
            (
                param(&[columns, h], w, device),
                param(&[columns], b, device),
            )
        });
        let [(fused_weight, fused_bias), (plain_weight, plain_bias)] = &pairs;
        let (s, b) = (48, 3);
        let input = ((Tensor::arange(s * b * h, (Kind::Float, device)) * 0.013).cos())
            .view([s, b, h])
            .to_kind(Kind::BFloat16);
        let loss_weights: Vec<Tensor> = [layout.query_width, layout.head_dim, layout.head_dim]
            .iter()
            .enumerate()
            .map(|(i, &width)| {
                (Tensor::arange(s * b * 4 * width, (Kind::Float, device)) * (0.05 + i as f64))
                    .sin()
                    .view([s, b, 4, width])
                    .to_kind(Kind::BFloat16)
            })
            .collect();
        let run = |through_fused: bool, pass: usize| -> (Vec<Tensor>, Tensor) {
            let x = input.detach().set_requires_grad(true);
            let parts: Vec<Tensor> = if through_fused {
                fused(
                    fused_weight,
                    Some(fused_bias),
                    layout,
                    Kind::BFloat16,
                    device,
                )
                .expect("the fused projection applies")
                .apply(&x)
                .unwrap()
                .into()
            } else {
                main_grad_linear::linear(&x, plain_weight, Some(plain_bias))
                    .unwrap()
                    .view([s, b, 4, -1])
                    .split_with_sizes([128, 64, 64], -1)
            };
            // Through a [b, heads, s, d] copy, as attention's backward leaves gradients.
            let used = if pass == 0 { 3 } else { 2 };
            let loss = parts
                .iter()
                .zip(&loss_weights)
                .take(used)
                .map(|(p, w)| {
                    (p.permute([1, 2, 0, 3]).contiguous() * w.permute([1, 2, 0, 3]))
                        .to_kind(Kind::Float)
                        .sum(Kind::Float)
                })
                .fold(Tensor::zeros([], (Kind::Float, device)), |a, l| a + l);
            loss.backward();
            (parts.iter().map(|p| p.detach()).collect(), x.grad())
        };
        for pass in 0..2 {
            let (fused_parts, fused_input_grad) = run(true, pass);
            let (plain_parts, plain_input_grad) = run(false, pass);
            for (f, p) in fused_parts.iter().zip(&plain_parts) {
                assert!(f.equal(p), "outputs differ");
            }
            assert!(
                fused_input_grad.equal(&plain_input_grad),
                "input gradients differ"
            );
        }
        let weight_grads =
            [fused_weight, plain_weight].map(|w| w.main_grad().get().unwrap().shallow_clone());
        assert!(
            weight_grads[0].equal(&weight_grads[1]),
            "weight gradients differ"
        );
        let bias_grads =
            [fused_bias, plain_bias].map(|b| b.main_grad().get().unwrap().shallow_clone());
        let difference = (&bias_grads[0] - &bias_grads[1])
            .abs()
            .max()
            .double_value(&[]);
        let scale = bias_grads[1].abs().max().double_value(&[]);
        assert!(
            scale > 0.0 && difference <= 1e-5 * scale,
            "bias gradients differ by {difference}"
        );
    }

    #[test]
    fn on_the_cpu_the_fused_qkv_projection_equals_linear_then_split() {
        check_equals_linear_then_split(Device::Cpu);
    }

    #[test]
    fn on_a_gpu_the_fused_qkv_projection_equals_linear_then_split() {
        if tch::Cuda::is_available() {
            check_equals_linear_then_split(Device::Cuda(0));
        }
    }
}
