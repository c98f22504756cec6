//! Checkpoints in Megatron's directory layout with safetensors shards and JSON metadata:
//!
//! ```text
//! <save>/latest_checkpointed_iteration.txt
//! <save>/iter_0000100/metadata.json              run-wide state (flags, model, counters, scheduler)
//! <save>/iter_0000100/mp_rank_00/model.safetensors       Megatron-core tensor names
//! <save>/iter_0000100/mp_rank_00/optimizer.safetensors   fp32 main params and moments
//! <save>/iter_0000100/mp_rank_00/rng.safetensors         generator states
//! ```
//! A save is written under a temporary name and renamed when complete, and the tracker is
//! updated last, so a run killed at any moment leaves the previous checkpoint loadable.

mod layout;
mod metadata;
mod store;
mod tensor_file;

pub use layout::{iteration_directory, rank_directory_name, read_tracker, write_tracker, TrackedCheckpoint, TRACKER_FILE};
pub use metadata::{CheckpointMetadata, CHECKPOINT_FORMAT};
pub use store::{load_checkpoint, save_checkpoint, CheckpointParts, LoadOptions, LoadedCheckpoint};
pub use tensor_file::{read_tensors, write_tensors};
