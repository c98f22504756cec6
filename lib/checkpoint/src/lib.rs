//! Checkpoint formats without libtorch: a restricted PyTorch unpickler that never runs code
//! ([`pickle`]), `torch.save` archives read in place ([`torch_file`]) and written
//! ([`torch_writer`]), Megatron's `torch_dist` checkpoints read ([`torch_dist`]) and written
//! ([`torch_dist_writer`]), and a summary of
//! any supported checkpoint directory ([`inspect`]); where the distributed optimizer keeps
//! each parameter's state ([`distrib_optim`]).

pub mod direct_file;
pub mod distrib_optim;
pub mod dtype;
pub mod inspect;
pub mod layout;
pub mod pickle;
pub mod safetensors_file;
pub mod torch_dist;
pub mod torch_dist_writer;
pub mod torch_file;
pub mod torch_writer;

pub use dtype::DType;
pub use pickle::{NumpyArray, StorageRef, TensorRef, Value};
pub use torch_dist::DistCheckpoint;
pub use torch_file::TorchFile;
