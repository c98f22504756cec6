//! Checkpoints in Megatron's directory layout with safetensors shards and JSON metadata:
//!
//! ```text
//! <save>/latest_checkpointed_iteration.txt
//! <save>/iter_0000100/metadata.json              run-wide state (flags, model, layout, counters, scheduler)
//! <save>/iter_0000100/mp_rank_00/model.safetensors       Megatron-core tensor names (mp_rank_TT_PPP with PP)
//! <save>/iter_0000100/mp_rank_00/optimizer.safetensors   fp32 main params and moments
//!                                 optimizer_dp003.safetensors   (one per data-parallel rank, distributed optimizer)
//! <save>/iter_0000100/mp_rank_00/rng.safetensors         generator states
//! ```
//! A save is written under a temporary name and renamed when complete, and the tracker is
//! updated last, so a run killed at any moment leaves the previous checkpoint loadable.

mod checksum;
mod layout;
mod load;
mod lock;
mod merge;
mod metadata;
mod store;
mod tensor_file;

pub use checksum::{checksums_enabled, file_checksum, set_checksums_enabled, FileChecksums};
pub use layout::{
    iteration_directory, rank_directory_name, read_tracker, saved_iterations, write_tracker,
    TrackedCheckpoint, TRACKER_FILE,
};
pub use load::{checkpoint_config, load_for_inference};
pub use lock::{lock_save_directory, LOCK_FILE};
pub use merge::{
    has_vocab_rows, join_shards, merge_model_parallel_ranks, split_for_tensor_parallel, take_shard,
    tensor_split, TensorSplit,
};
pub use metadata::{CheckpointMetadata, CHECKPOINT_FORMAT};
pub use store::{
    abandon_save, begin_save, commit_iteration, find_checkpoint, finish_save, optimizer_file,
    staging_directory, write_rank_file, write_rank_file_streamed, CheckpointDirectory,
    EXPERT_BIAS_FILE, METADATA_FILE, MODEL_FILE, RNG_FILE,
};
pub use tensor_file::cpu_bytes;
pub use tensor_file::{read_tensors, write_tensors, write_tensors_streamed, TensorEntry};
