//! Autograd beyond what tch-rs exposes: custom functions with Rust forward/backward callbacks,
//! backward with explicit output gradients, activation recompute, and a numerical gradient check.

mod engine;
pub(crate) mod ffi;
mod function;
pub mod gradcheck;
mod hooks;
mod recompute;

pub use engine::{backward, grad};
pub use function::{apply, CustomFunction, SavedTensors};
pub use hooks::set_post_accumulate_grad_hook;
pub use recompute::recompute;
