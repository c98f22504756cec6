//! Megatron's tensor-parallel regions as autograd functions: what a column-parallel layer does
//! to its input and a row-parallel layer to its output, forward and backward.

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::communicator::{Communicator, ReduceOp};
use crate::autograd::{apply, CustomFunction, SavedTensors};

fn single(outputs: Vec<Tensor>) -> Tensor {
    outputs.into_iter().next().expect("a region has one output")
}

/// Identity forward, all-reduce of the gradient backward (input of a column-parallel linear).
pub fn copy_to_tensor_parallel_region(input: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(CopyToRegion(group.clone()), &[input])?))
}

/// All-reduce forward, identity backward (output of a row-parallel linear).
pub fn reduce_from_tensor_parallel_region(input: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(ReduceFromRegion(group.clone()), &[input])?))
}

/// All-gather along the last dimension forward, keep this rank's slice backward (logits with
/// `parallel_output = false`).
pub fn gather_from_tensor_parallel_region(input: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(GatherFromRegion(group.clone()), &[input])?))
}

struct CopyToRegion(Arc<dyn Communicator>);

impl CustomFunction for CopyToRegion {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![inputs[0].shallow_clone()])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let grad = grads[0].contiguous();
        self.0.all_reduce(&grad, ReduceOp::Sum)?;
        Ok(vec![Some(grad)])
    }
}

struct ReduceFromRegion(Arc<dyn Communicator>);

impl CustomFunction for ReduceFromRegion {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let output = inputs[0].contiguous().copy();
        self.0.all_reduce(&output, ReduceOp::Sum)?;
        Ok(vec![output])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(grads[0].shallow_clone())])
    }
}

struct GatherFromRegion(Arc<dyn Communicator>);

impl CustomFunction for GatherFromRegion {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let last = inputs[0].dim() as i64 - 1;
        Ok(vec![self.0.all_gather(&inputs[0].contiguous(), last)?])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let grad = &grads[0];
        let last = grad.dim() as i64 - 1;
        let width = grad.size()[last as usize] / self.0.size() as i64;
        Ok(vec![Some(grad.narrow(last, self.0.rank() as i64 * width, width).contiguous())])
    }
}
