//! Megatron's tensor-parallel regions as autograd functions: what a column-parallel layer does
//! to its input and a row-parallel layer to its output, forward and backward.

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::communicator::{Communicator, ReduceOp};
use megatron_kernels::autograd::{apply, CustomFunction, SavedTensors};

fn single(outputs: Vec<Tensor>) -> Tensor {
    outputs.into_iter().next().expect("a region has one output")
}

/// Identity forward, all-reduce of the gradient backward (input of a column-parallel linear).
pub fn copy_to_tensor_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(CopyToRegion(group.clone()), &[input])?))
}

/// All-reduce forward, identity backward (output of a row-parallel linear).
pub fn reduce_from_tensor_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(ReduceFromRegion(group.clone()), &[input])?))
}

/// All-gather along the last dimension forward, keep this rank's slice backward (logits with
/// `parallel_output = false`).
pub fn gather_from_tensor_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(GatherFromRegion(group.clone()), &[input])?))
}

/// Sequence parallelism (spec §2.2): keep this rank's slice of the sequence (dimension 0)
/// forward, all-gather the gradient backward. After the embedding.
pub fn scatter_to_sequence_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(ScatterToSequence(group.clone()), &[input])?))
}

/// All-gather along the sequence forward; backward reduce-scatters the gradient when the
/// consumer is tensor-parallel (a column-parallel linear: every rank's gradient is partial) and
/// otherwise keeps this rank's slice.
pub fn gather_from_sequence_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
    tensor_parallel_output_grad: bool,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(
        GatherFromSequence {
            group: group.clone(),
            tensor_parallel_output_grad,
        },
        &[input],
    )?))
}

/// Reduce-scatter along the sequence forward (output of a row-parallel linear), all-gather of
/// the gradient backward.
pub fn reduce_scatter_to_sequence_parallel_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(
        ReduceScatterToSequence(group.clone()),
        &[input],
    )?))
}

/// This rank's slice of `tensor` along dimension 0.
fn sequence_slice(tensor: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    let length = tensor.size()[0];
    anyhow::ensure!(
        length % group.size() as i64 == 0,
        "sequence parallelism: sequence length {length} is not divisible by the tensor-parallel size {}",
        group.size()
    );
    let width = length / group.size() as i64;
    Ok(tensor
        .narrow(0, group.rank() as i64 * width, width)
        .contiguous())
}

struct ScatterToSequence(Arc<dyn Communicator>);

impl CustomFunction for ScatterToSequence {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![sequence_slice(&inputs[0], &self.0)?])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.0.all_gather(&grads[0].contiguous(), 0)?)])
    }
}

struct GatherFromSequence {
    group: Arc<dyn Communicator>,
    tensor_parallel_output_grad: bool,
}

impl CustomFunction for GatherFromSequence {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![self.group.all_gather(&inputs[0].contiguous(), 0)?])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let grad = grads[0].contiguous();
        Ok(vec![Some(if self.tensor_parallel_output_grad {
            self.group.reduce_scatter(&grad, 0)?
        } else {
            sequence_slice(&grad, &self.group)?
        })])
    }
}

struct ReduceScatterToSequence(Arc<dyn Communicator>);

impl CustomFunction for ReduceScatterToSequence {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![self.0.reduce_scatter(&inputs[0].contiguous(), 0)?])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.0.all_gather(&grads[0].contiguous(), 0)?)])
    }
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
        Ok(vec![Some(
            grad.narrow(last, self.0.rank() as i64 * width, width)
                .contiguous(),
        )])
    }
}

/// All-to-all with variable splits forward (see [`Communicator::all_to_all`]), the reverse
/// all-to-all of the gradient backward: how Mixture-of-Experts tokens reach the ranks holding
/// their experts and come back.
pub fn all_to_all_region(
    input: &Tensor,
    group: &Arc<dyn Communicator>,
    send_splits: &[i64],
    recv_splits: &[i64],
) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(input.shallow_clone());
    }
    Ok(single(apply(
        AllToAll {
            group: group.clone(),
            send_splits: send_splits.to_vec(),
            recv_splits: recv_splits.to_vec(),
        },
        &[input],
    )?))
}

struct AllToAll {
    group: Arc<dyn Communicator>,
    send_splits: Vec<i64>,
    recv_splits: Vec<i64>,
}

impl CustomFunction for AllToAll {
    fn forward(&mut self, inputs: &[Tensor], _saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![self.group.all_to_all(
            &inputs[0].contiguous(),
            &self.send_splits,
            &self.recv_splits,
        )?])
    }

    fn backward(&mut self, grads: &[Tensor], _saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(self.group.all_to_all(
            &grads[0].contiguous(),
            &self.recv_splits,
            &self.send_splits,
        )?)])
    }
}
