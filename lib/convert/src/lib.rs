//! `checkpoint_convert`'s loaders and savers over one [`ModelState`]: Megatron's torch and
//! torch_dist checkpoints and HuggingFace models in and out, ours in and out in any TP/PP layout
//! (optimizer state included); our T5 checkpoints reshaped to another TP size (`t5`). Our
//! checkpoints are read lazily ([`LazyTensor`]) and every saver writes tensor by tensor, so a
//! conversion between them holds about one tensor at a time. File formats are read by the
//! libtorch-free `megatron-checkpoint` crate; the tensor reshaping uses CPU tensors.

mod dist_tensors;
mod distrib_optim;
mod distrib_optim_save;
pub mod hf;
pub mod hf_tokenizer;
pub mod lazy;
pub mod load;
pub mod megatron_args;
mod megatron_moe_args;
mod megatron_rng;
pub mod megatron_save;
pub mod megatron_torch;
pub mod megatron_torch_dist;
pub mod megatron_torch_dist_save;
pub mod ours;
pub mod progress;
pub mod resume;
pub mod run_export;
pub mod sizes;
pub mod state;
pub mod t5;
pub mod tensors;
mod torch_dist_optimizer;
pub mod verify;

pub use hf::{load_hf, save_hf};
pub use hf_tokenizer::{tokenizer_export, TokenizerExport, TokenizerFiles};
pub use lazy::{use_one_torch_thread, LazyTensor};
pub use load::load_checkpoint;
pub use megatron_args::vocab_file_size;
pub use megatron_save::{save_megatron_torch, save_megatron_torch_experts};
pub use megatron_torch::{load_megatron_torch, LoadOptions};
pub use megatron_torch_dist::load_torch_dist;
pub use megatron_torch_dist_save::save_megatron_torch_dist;
pub use ours::{
    load_megatron_rs, save_megatron_rs, save_megatron_rs_sharded, OptimizerShards, TargetLayout,
};
pub use progress::{reporting_progress, ConversionProgress};
pub use resume::{import_for_job, NodeCheckpoint};
pub use run_export::{export_saved_checkpoint, MegatronFormat};
pub use state::{in_memory, ModelState, OptimizerState, RunState, Tensors};
pub use t5::{reshape_t5, t5_max_logit_difference, T5Reshape};
