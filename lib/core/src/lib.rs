//! megatron-rs core: the libtorch runtime (through tch-rs) and the C++ autograd shim that
//! model-parallel regions, activation recompute and pipeline stages are built on.

pub mod autograd;
pub mod error;
pub mod rng;
pub mod runtime;

pub use error::TorchError;
