//! Column- and row-parallel linears (spec §2.1, §2.2). Weights are `[out, in]` like `nn.Linear`.

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::fp8_linear::{self, Fp8Linear};
use super::main_grad_linear;
use super::{NamedTensors, ParamAttributes, TensorParallel};
use crate::fp8::{check_gemm_shape, Fp8Recipe};
use crate::param::{Initializer, Param};
use megatron_parallel::{
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
    /// Set when the GEMMs run in fp8 (`--fp8-format`).
    fp8: Option<Arc<Fp8Linear>>,
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
            fp8: None,
        }
    }

    /// `x · Wᵀ + b` on this rank's output slice. With sequence parallelism the input arrives
    /// split along the sequence and is gathered first.
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.local(&self.parallel_input(input)?)
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

    /// `input · Wᵀ + b` for an input already through [`parallel_input`](Self::parallel_input).
    pub fn local(&self, input: &Tensor) -> Result<Tensor> {
        linear(input, &self.weight, self.bias.as_ref(), &self.fp8)
    }

    /// Whether the input reaches this rank whole, so that [`forward`](Self::forward) is the
    /// plain product (no sequence-parallel gather).
    pub fn takes_whole_input(&self) -> bool {
        !self.parallel.sequence_parallel
    }

    /// Runs this linear's GEMMs in fp8 from now on; `name` is for the error when the shard's
    /// shape does not suit fp8 GEMMs.
    pub fn enable_fp8(&mut self, name: &str, recipe: Fp8Recipe) -> Result<()> {
        self.fp8 = Some(fp8_for(name, &self.weight, recipe)?);
        Ok(())
    }

    /// The fp8 state, when the GEMMs run in fp8.
    pub fn fp8(&self) -> Option<&Arc<Fp8Linear>> {
        self.fp8.as_ref()
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
    /// Set when the GEMMs run in fp8 (`--fp8-format`).
    fp8: Option<Arc<Fp8Linear>>,
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
            fp8: None,
        }
    }

    /// Whether this rank holds the whole layer (no tensor parallelism), so that
    /// [`forward`](Self::forward) is the plain product plus bias.
    pub fn is_whole(&self) -> bool {
        self.parallel.group.size() == 1
    }

    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let group = &self.parallel.group;
        if group.size() == 1 {
            return linear(input, &self.weight, self.bias.as_ref(), &self.fp8);
        }
        let partial = linear(input, &self.weight, None, &self.fp8)?;
        let output = if self.parallel.sequence_parallel {
            reduce_scatter_to_sequence_parallel_region(&partial, group)?
        } else {
            reduce_from_tensor_parallel_region(&partial, group)?
        };
        Ok(match &self.bias {
            Some(bias) => output + &**bias,
            None => output,
        })
    }

    /// See [`ColumnParallelLinear::enable_fp8`].
    pub fn enable_fp8(&mut self, name: &str, recipe: Fp8Recipe) -> Result<()> {
        self.fp8 = Some(fp8_for(name, &self.weight, recipe)?);
        Ok(())
    }

    /// The fp8 state, when the GEMMs run in fp8.
    pub fn fp8(&self) -> Option<&Arc<Fp8Linear>> {
        self.fp8.as_ref()
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

/// The linear on this rank's shard: in fp8 when enabled, else in the parameters' dtype.
fn linear(
    input: &Tensor,
    weight: &Param,
    bias: Option<&Param>,
    fp8: &Option<Arc<Fp8Linear>>,
) -> Result<Tensor> {
    match fp8 {
        Some(fp8) => fp8_linear::linear(input, weight, bias, fp8),
        None => main_grad_linear::linear(input, weight, bias),
    }
}

fn fp8_for(name: &str, weight: &Param, recipe: Fp8Recipe) -> Result<Arc<Fp8Linear>> {
    let size = weight.size();
    check_gemm_shape(name, size[0], size[1])?;
    Ok(Arc::new(Fp8Linear::new(recipe)))
}
