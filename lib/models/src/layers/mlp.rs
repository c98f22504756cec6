//! The transformer MLP: fc1 (column-parallel), activation, fc2 (row-parallel).

use anyhow::Result;
use tch::Tensor;

use super::linear::{ColumnParallelLinear, RowParallelLinear};
use super::linear_gelu;
use super::{NamedTensors, TensorParallel};
use crate::config::{Activation, TransformerConfig};
use crate::param::Initializer;
use megatron_kernels::ops::decode_gemv::Gelu;

#[derive(Clone)]
pub struct Mlp {
    pub linear_fc1: ColumnParallelLinear,
    pub linear_fc2: RowParallelLinear,
    activation: Activation,
}

impl Mlp {
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        output_std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let h = config.hidden_size;
        let bias = config.add_bias_linear;
        // SwiGLU's fc1 is [gate; up]; stride 2 gives each rank [gate_r; up_r] (spec §2.1).
        let stride = if config.activation == Activation::Swiglu {
            2
        } else {
            1
        };
        Mlp {
            linear_fc1: ColumnParallelLinear::new(
                &init.scope("linear_fc1"),
                h,
                config.fc1_width(),
                bias,
                config.init_method_std,
                stride,
                parallel.clone(),
            ),
            linear_fc2: RowParallelLinear::new(
                &init.scope("linear_fc2"),
                config.ffn_hidden_size,
                h,
                bias,
                output_std,
                parallel,
            ),
            activation: config.activation,
        }
    }

    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let input = self.linear_fc1.parallel_input(hidden)?;
        let fc1 = &self.linear_fc1;
        let fused = match (self.activation, &fc1.bias, fc1.fp8()) {
            (Activation::GeluTanh, Some(bias), None) => {
                linear_gelu::forward(&input, &fc1.weight, bias)?
            }
            _ => None,
        };
        let activated = match fused {
            Some(activated) => activated,
            None => self.activate(&fc1.local(&input)?),
        };
        self.linear_fc2.forward(&activated)
    }

    /// fc1, the activation, each row scaled by `row_scale` `[rows]`, fc2: a routed expert,
    /// whose router probability Megatron applies before fc2.
    pub fn forward_scaled(&self, hidden: &Tensor, row_scale: &Tensor) -> Result<Tensor> {
        let input = self.linear_fc1.parallel_input(hidden)?;
        let activated = self.activate(&self.linear_fc1.local(&input)?);
        let scaled = (&activated * row_scale.unsqueeze(-1)).to_kind(activated.kind());
        self.linear_fc2.forward(&scaled)
    }

    /// The activation of fc1's output.
    pub fn activate(&self, intermediate: &Tensor) -> Tensor {
        match self.activation {
            Activation::GeluTanh => intermediate.gelu("tanh"),
            Activation::GeluErf => intermediate.gelu("none"),
            Activation::Swiglu => {
                let halves = intermediate.chunk(2, -1);
                halves[0].silu() * &halves[1]
            }
            Activation::SquaredRelu => intermediate.relu().square(),
        }
    }

    /// The GeLU the fused decode kernels apply for this MLP's activation, if they have it.
    pub fn gelu(&self) -> Option<Gelu> {
        match self.activation {
            Activation::GeluTanh => Some(Gelu::Tanh),
            Activation::GeluErf => Some(Gelu::Erf),
            Activation::Swiglu | Activation::SquaredRelu => None,
        }
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.linear_fc1.named_tensors(&mut out.scope("linear_fc1"));
        self.linear_fc2.named_tensors(&mut out.scope("linear_fc2"));
    }
}
