//! Autograd beyond what tch-rs exposes: custom functions with Rust forward/backward callbacks,
//! backward with explicit output gradients, activation recompute, and a numerical gradient check.

mod checkpoint;
mod engine;
pub(crate) mod ffi;
mod function;
pub mod gradcheck;
mod hooks;

pub use checkpoint::checkpoint;
pub use engine::{backward, grad};
pub use function::{apply, CustomFunction, SavedTensors};
pub use hooks::set_post_accumulate_grad_hook;
