//! Column- and row-parallel linears (spec §2.1, §2.2). Weights are `[out, in]` like `nn.Linear`.

use anyhow::Result;
use tch::Tensor;

use super::main_grad_linear::linear;
use super::{NamedTensors, ParamAttributes, TensorParallel};
use crate::model::param::{Initializer, Param};
use crate::parallel::{
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region, reduce_scatter_to_sequence_parallel_region,
};

const SHARDED: ParamAttributes = ParamAttributes {
    tensor_parallel: true,
    ..ParamAttributes::REPLICATED
};

/// Splits the output dimension: rank r holds rows `[r·out/t, (r+1)·out/t)` and their bias.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    pub weight: Param,
    pub bias: Option<Param>,
    parallel: TensorParallel,
}

impl ColumnParallelLinear {
    /// `stride` 2 partitions a `[gate; up]` weight so each rank holds `[gate_r; up_r]`.
    pub fn new(
        init: &Initializer,
        input: i64,
        output: i64,
        bias: bool,
        std: f64,
        stride: i64,
        parallel: TensorParallel,
    ) -> Self {
        let weight = init.normal_partitioned_strided("weight", &[output, input], std, 0, stride);
        let bias = bias.then(|| init.constant_partitioned(&[output], 0.0));
        ColumnParallelLinear {
            weight,
            bias,
            parallel,
        }
    }

    /// `x · Wᵀ + b` on this rank's output slice. With sequence parallelism the input arrives
    /// split along the sequence and is gathered first.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        linear(
            &self.parallel_input(input)?,
            &self.weight,
            self.bias.as_ref(),
        )
    }

    /// The input this rank multiplies: gathered along the sequence with sequence parallelism,
    /// else the input itself (whose gradient is summed over the group).
    pub fn parallel_input(&self, input: &Tensor) -> Result<Tensor> {
        if self.parallel.sequence_parallel {
            gather_from_sequence_parallel_region(input, &self.parallel.group, true)
        } else {
            copy_to_tensor_parallel_region(input, &self.parallel.group)
        }
    }

    /// Whether the input reaches this rank whole, so that [`forward`](Self::forward) is the
    /// plain product (no sequence-parallel gather).
    pub fn takes_whole_input(&self) -> bool {
        !self.parallel.sequence_parallel
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        out.push_fusable("weight", &self.weight, SHARDED);
        if let Some(bias) = &self.bias {
            out.push_fusable("bias", bias, SHARDED);
        }
    }
}

/// Splits the input dimension: rank r holds columns `[r·in/t, (r+1)·in/t)`; the partial
/// products are summed across the group (reduce-scattered along the sequence with sequence
/// parallelism) and the replicated bias is added after the sum.
#[derive(Clone)]
pub struct RowParallelLinear {
    pub weight: Param,
    pub bias: Option<Param>,
    parallel: TensorParallel,
}

impl RowParallelLinear {
    pub fn new(
        init: &Initializer,
        input: i64,
        output: i64,
        bias: bool,
        std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let weight = init.normal_partitioned("weight", &[output, input], std, 1);
        let bias = bias.then(|| init.constant(&[output], 0.0));
        RowParallelLinear {
            weight,
            bias,
            parallel,
        }
    }

    /// Whether this rank holds the whole layer (no tensor parallelism), so that
    /// [`forward`](Self::forward) is the plain product plus bias.
    pub fn is_whole(&self) -> bool {
        self.parallel.group.size() == 1
    }

    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let local_bias = self.local_bias();
        let partial = linear(input, &self.weight, local_bias)?;
        self.reduce_output(&partial, local_bias.is_some())
    }

    /// The bias when this rank adds it to its own product: with one rank, where no sum follows.
    pub fn local_bias(&self) -> Option<&Param> {
        self.bias
            .as_ref()
            .filter(|_| self.parallel.group.size() == 1)
    }

    /// The layer's output from this rank's product: summed over the group (reduce-scattered
    /// along the sequence with sequence parallelism), plus the bias unless `bias_added`.
    pub fn reduce_output(&self, partial: &Tensor, bias_added: bool) -> Result<Tensor> {
        let group = &self.parallel.group;
        let output = if group.size() == 1 {
            partial.shallow_clone()
        } else if self.parallel.sequence_parallel {
            reduce_scatter_to_sequence_parallel_region(partial, group)?
        } else {
            reduce_from_tensor_parallel_region(partial, group)?
        };
        Ok(match &self.bias {
            Some(bias) if !bias_added => output + &**bias,
            _ => output,
        })
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        out.push_fusable("weight", &self.weight, SHARDED);
        if let Some(bias) = &self.bias {
            let attributes = ParamAttributes {
                sequence_parallel: self.parallel.sequence_parallel,
                ..Default::default()
            };
            out.push_fusable("bias", bias, attributes);
        }
    }
}
