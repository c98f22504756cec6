//! megatron-rs kernels and runtime, the floor every libtorch crate stands on: the C++ autograd
//! shim (`csrc/`, [`autograd`]), CUDA streams, events, graphs and NVRTC ([`runtime`]), our own
//! kernels ([`ops`]) and the random-number state activation recompute replays ([`rng`]).

pub mod autograd;
pub mod error;
pub mod fnv;
pub mod ops;
pub mod rng;
pub mod runtime;

pub use error::TorchError;
