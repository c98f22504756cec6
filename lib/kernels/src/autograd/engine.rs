//! Entry points into libtorch's autograd engine that take explicit output gradients.

use super::ffi::{self, TensorHandle};
use crate::TorchError;
use tch::Tensor;

/// Backpropagates from `tensors` with the given output gradients (`torch.autograd.backward`),
/// accumulating into the `.grad` of the leaves. A pipeline stage uses this to continue the
/// backward pass from the gradient its successor sent.
pub fn backward(
    tensors: &[&Tensor],
    grad_tensors: &[&Tensor],
    retain_graph: bool,
) -> Result<(), TorchError> {
    assert_eq!(tensors.len(), grad_tensors.len(), "one gradient per tensor");
    let tensors: Vec<TensorHandle> = tensors.iter().map(|t| ffi::handle(t)).collect();
    let grads: Vec<TensorHandle> = grad_tensors.iter().map(|t| ffi::handle(t)).collect();
    // SAFETY: both arrays hold `len` live handles for the duration of the call.
    crate::error::check(unsafe {
        ffi::mrs_backward(
            tensors.as_ptr(),
            grads.as_ptr(),
            tensors.len(),
            retain_graph.into(),
            0,
        )
    })
}

/// Gradients of `outputs` (weighted by `grad_outputs`) with respect to `inputs`
/// (`torch.autograd.grad`), without touching any `.grad`. `None` for an input the outputs do not
/// depend on.
pub fn grad(
    outputs: &[&Tensor],
    grad_outputs: &[&Tensor],
    inputs: &[&Tensor],
    retain_graph: bool,
    create_graph: bool,
) -> Result<Vec<Option<Tensor>>, TorchError> {
    assert_eq!(outputs.len(), grad_outputs.len(), "one gradient per output");
    let outs: Vec<TensorHandle> = outputs.iter().map(|t| ffi::handle(t)).collect();
    let grads: Vec<TensorHandle> = grad_outputs.iter().map(|t| ffi::handle(t)).collect();
    let ins: Vec<TensorHandle> = inputs.iter().map(|t| ffi::handle(t)).collect();
    let mut results: Vec<TensorHandle> = vec![std::ptr::null_mut(); ins.len()];
    // SAFETY: arrays are live for the call; `results` has room for one handle per input.
    crate::error::check(unsafe {
        ffi::mrs_grad(
            outs.as_ptr(),
            grads.as_ptr(),
            outs.len(),
            ins.as_ptr(),
            ins.len(),
            retain_graph.into(),
            create_graph.into(),
            1,
            results.as_mut_ptr(),
        )
    })?;
    Ok(results
        .into_iter()
        // SAFETY: non-null results are fresh handles owned by us.
        .map(|h| (!h.is_null()).then(|| unsafe { Tensor::from_ptr(h) }))
        .collect())
}
