//! Post-accumulate-grad hooks (torch's `register_post_accumulate_grad_hook`): a Rust closure run
//! each time backward has accumulated a parameter's gradient, which is what lets gradient
//! reduction start while the rest of backward still runs.

use std::os::raw::c_void;

use super::ffi;
use crate::error::check;
use crate::TorchError;

type Hook = Box<dyn Fn(&tch::Tensor) + Send + Sync>;

unsafe extern "C" fn call(state: *mut c_void, parameter: ffi::TensorHandle) {
    // SAFETY: `state` is the boxed hook installed below; the handle is new and ours to own.
    let hook = unsafe { &*(state as *const Hook) };
    let parameter = unsafe { tch::Tensor::from_ptr(parameter) };
    // A panic must not unwind into libtorch's engine; the hook reports failures itself.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(&parameter)));
}

unsafe extern "C" fn drop_hook(state: *mut c_void) {
    // SAFETY: called exactly once by the shim for the box leaked below.
    drop(unsafe { Box::from_raw(state as *mut Hook) });
}

static VTABLE: ffi::HookVtable = ffi::HookVtable {
    call,
    drop: drop_hook,
};

/// Runs `hook` with the parameter after every backward pass accumulated its gradient, on the
/// autograd engine's thread. Replaces an earlier hook of the same parameter.
pub fn set_post_accumulate_grad_hook(
    parameter: &tch::Tensor,
    hook: impl Fn(&tch::Tensor) + Send + Sync + 'static,
) -> Result<(), TorchError> {
    let state = Box::into_raw(Box::new(Box::new(hook) as Hook)) as *mut c_void;
    // SAFETY: the shim takes ownership of `state` and drops it through the vtable.
    check(unsafe { ffi::mrs_set_post_accumulate_grad_hook(ffi::handle(parameter), &VTABLE, state) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tch::{Kind, Tensor};

    #[test]
    fn the_hook_sees_each_accumulated_gradient() {
        let weight = Tensor::ones([3], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        set_post_accumulate_grad_hook(&weight, move |p| {
            record.lock().unwrap().push(p.grad().double_value(&[0]))
        })
        .unwrap();
        for _ in 0..2 {
            (&weight * 2.0).sum(Kind::Float).backward();
        }
        // The gradient is accumulated before the hook runs: 2, then 4.
        assert_eq!(*seen.lock().unwrap(), vec![2.0, 4.0]);
    }
}
