//! Custom autograd functions whose forward and backward are Rust code.
//!
//! The C++ side is a `torch::autograd::Function`: libtorch records it in the graph like any
//! built-in op, runs `forward` with gradient recording off, and calls `backward` from the
//! autograd engine (on any thread, one call at a time per node). This is what model-parallel
//! regions, recompute and pipeline stage boundaries are made of.

use super::ffi::{self, FunctionVtable, Sink, TensorHandle};
use crate::TorchError;
use std::any::Any;
use std::ffi::CString;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::Tensor;

/// A differentiable operation implemented in Rust.
///
/// State the backward pass needs can live in `self` (it is dropped when the graph node is
/// freed), but forward outputs must be kept through [`SavedTensors`] instead: holding an output
/// in `self` would make a reference cycle between the output and its own graph node.
pub trait CustomFunction: Send + 'static {
    /// Computes the outputs; runs with gradient recording disabled.
    fn forward(
        &mut self,
        inputs: &[Tensor],
        saved: &mut SavedTensors,
    ) -> anyhow::Result<Vec<Tensor>>;

    /// Given the gradients of the loss with respect to each output, returns one gradient per
    /// forward input (`None` where an input gets no gradient). `saved` holds what forward saved.
    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> anyhow::Result<Vec<Option<Tensor>>>;
}

/// Tensors a [`CustomFunction::forward`] keeps for its backward (`ctx->save_for_backward`).
pub struct SavedTensors {
    sink: *mut Sink,
}

impl SavedTensors {
    pub fn save(&mut self, tensor: &Tensor) {
        // SAFETY: the sink outlives the forward call that received this value.
        unsafe { ffi::mrs_sink_push(self.sink, ffi::SINK_SAVED, ffi::handle(tensor)) }
    }
}

/// Applies `function` to `inputs`, recording it in the autograd graph when gradients are enabled
/// and an input requires grad.
pub fn apply<F: CustomFunction>(
    function: F,
    inputs: &[&Tensor],
) -> Result<Vec<Tensor>, TorchError> {
    let state = Box::into_raw(Box::new(function)).cast::<c_void>();
    let handles: Vec<TensorHandle> = inputs.iter().map(|t| ffi::handle(t)).collect();
    let mut outputs: *mut TensorHandle = std::ptr::null_mut();
    let mut n_outputs = 0usize;
    // SAFETY: the vtable matches `state`'s type; the shim takes ownership of `state`.
    crate::error::check(unsafe {
        ffi::mrs_function_apply(
            Trampolines::<F>::VTABLE_REF,
            state,
            handles.as_ptr(),
            handles.len(),
            &mut outputs,
            &mut n_outputs,
        )
    })?;
    // SAFETY: on success the shim returned `n_outputs` fresh handles in a malloc'd array.
    let tensors = unsafe { ffi::take_handles(outputs, n_outputs) };
    unsafe { ffi::mrs_free_array(outputs.cast()) };
    Ok(tensors)
}

struct Trampolines<F>(PhantomData<F>);

impl<F: CustomFunction> Trampolines<F> {
    const VTABLE: FunctionVtable = FunctionVtable {
        forward: Self::forward,
        backward: Self::backward,
        drop: Self::drop,
    };
    const VTABLE_REF: &'static FunctionVtable = &Self::VTABLE;

    unsafe extern "C" fn forward(
        state: *mut c_void,
        inputs: *const TensorHandle,
        n: usize,
        sink: *mut Sink,
    ) -> c_int {
        let inputs = unsafe { ffi::take_handles(inputs, n) };
        let function = unsafe { &mut *state.cast::<F>() };
        let mut saved = SavedTensors { sink };
        report(
            sink,
            catch_unwind(AssertUnwindSafe(|| function.forward(&inputs, &mut saved))),
            |outputs| outputs.iter().map(|t| ffi::handle(t)).collect(),
        )
    }

    unsafe extern "C" fn backward(
        state: *mut c_void,
        grad_outputs: *const TensorHandle,
        n_grads: usize,
        saved: *const TensorHandle,
        n_saved: usize,
        sink: *mut Sink,
    ) -> c_int {
        let grad_outputs = unsafe { ffi::take_handles(grad_outputs, n_grads) };
        let saved = unsafe { ffi::take_handles(saved, n_saved) };
        let function = unsafe { &mut *state.cast::<F>() };
        report(
            sink,
            catch_unwind(AssertUnwindSafe(|| {
                function.backward(&grad_outputs, &saved)
            })),
            |grads| {
                grads
                    .iter()
                    .map(|g| g.as_ref().map_or(std::ptr::null_mut(), ffi::handle))
                    .collect()
            },
        )
    }

    unsafe extern "C" fn drop(state: *mut c_void) {
        // A panicking destructor must not unwind into C++; there is nobody to report it to.
        let _ = catch_unwind(|| unsafe { std::mem::drop(Box::from_raw(state.cast::<F>())) });
    }
}

/// Pushes a callback's results into the sink, or its error (or panic) message.
fn report<T>(
    sink: *mut Sink,
    result: std::thread::Result<anyhow::Result<Vec<T>>>,
    handles: impl Fn(&[T]) -> Vec<TensorHandle>,
) -> c_int {
    let message = match result {
        Ok(Ok(values)) => {
            for handle in handles(&values) {
                // SAFETY: the sink is alive for the callback; handles borrow `values`, which the
                // shim copies by reference count before they drop.
                unsafe { ffi::mrs_sink_push(sink, ffi::SINK_OUTPUT, handle) };
            }
            return 0;
        }
        Ok(Err(error)) => format!("{error:#}"),
        Err(panic) => format!("Rust callback panicked: {}", panic_message(&*panic)),
    };
    let message = CString::new(message.replace('\0', " ")).expect("NULs were replaced");
    unsafe { ffi::mrs_sink_set_error(sink, message.as_ptr()) };
    1
}

fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("non-string panic payload")
}
