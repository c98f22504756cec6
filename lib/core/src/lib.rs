//! megatron-rs core: the libtorch runtime (through tch-rs) and the C++ autograd shim that
//! model-parallel regions, activation recompute and pipeline stages are built on.

pub mod autograd;
pub mod error;
pub mod fnv;
pub mod rng;
pub mod runtime;
pub mod signals;
pub mod tasks;

pub use error::TorchError;
pub mod args;
pub mod checkpoint;
pub mod convert;
pub mod inference;
pub mod loader;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod optim;
pub mod parallel;
pub mod training;
