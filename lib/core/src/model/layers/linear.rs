//! Column- and row-parallel linears (spec §2.1). Weights are `[out, in]` like `nn.Linear`.

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::NamedTensors;
use crate::model::param::{Initializer, Param};
use crate::parallel::{copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region, Communicator};

/// Splits the output dimension: rank r holds rows `[r·out/t, (r+1)·out/t)` and their bias.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    pub weight: Param,
    pub bias: Option<Param>,
    group: Arc<dyn Communicator>,
}

impl ColumnParallelLinear {
    pub fn new(init: &Initializer, input: i64, output: i64, bias: bool, std: f64, group: Arc<dyn Communicator>) -> Self {
        let weight = init.normal_partitioned(&[output, input], std, 0);
        let bias = bias.then(|| init.constant_partitioned(&[output], 0.0));
        ColumnParallelLinear { weight, bias, group }
    }

    /// `x · Wᵀ + b` on this rank's output slice.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let input = copy_to_tensor_parallel_region(input, &self.group)?;
        Ok(input.linear(&*self.weight, self.bias.as_deref()))
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        out.push("weight", &self.weight);
        if let Some(bias) = &self.bias {
            out.push("bias", bias);
        }
    }
}

/// Splits the input dimension: rank r holds columns `[r·in/t, (r+1)·in/t)`; the partial
/// products are summed across the group and the (replicated) bias is added after the sum.
#[derive(Clone)]
pub struct RowParallelLinear {
    pub weight: Param,
    pub bias: Option<Param>,
    group: Arc<dyn Communicator>,
}

impl RowParallelLinear {
    pub fn new(init: &Initializer, input: i64, output: i64, bias: bool, std: f64, group: Arc<dyn Communicator>) -> Self {
        let weight = init.normal_partitioned(&[output, input], std, 1);
        let bias = bias.then(|| init.constant(&[output], 0.0));
        RowParallelLinear { weight, bias, group }
    }

    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        if self.group.size() == 1 {
            return Ok(input.linear(&*self.weight, self.bias.as_deref()));
        }
        let partial = input.linear::<&Tensor>(&self.weight, None);
        let output = reduce_from_tensor_parallel_region(&partial, &self.group)?;
        Ok(match &self.bias {
            Some(bias) => output + &**bias,
            None => output,
        })
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        out.push("weight", &self.weight);
        if let Some(bias) = &self.bias {
            out.push("bias", bias);
        }
    }
}
