//! `checkpoint_convert`'s loaders and savers over one in-memory [`ModelState`]: Megatron's
//! torch and torch_dist checkpoints in, ours in and out in any TP/PP layout (optimizer state
//! included); our T5 checkpoints reshaped to another TP size (`t5`). File formats are read by
//! the libtorch-free `megatron-checkpoint` crate; the tensor reshaping uses CPU tensors.

pub mod hf;
pub mod load;
pub mod megatron_args;
pub mod megatron_save;
pub mod megatron_torch;
pub mod names;
pub mod ours;
pub mod state;
pub mod t5;
pub mod verify;

pub use hf::{load_hf, save_hf};
pub use load::load_checkpoint;
pub use megatron_args::vocab_file_size;
pub use megatron_save::save_megatron_torch;
pub use megatron_torch::{load_megatron_torch, load_torch_dist, LoadOptions};
pub use ours::{load_megatron_rs, save_megatron_rs, TargetLayout};
pub use state::{ModelState, OptimizerState, RunState};
pub use t5::{reshape_t5, t5_max_logit_difference, T5Reshape};
