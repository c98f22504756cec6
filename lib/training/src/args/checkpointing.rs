//! Checkpoint flags (spec §4.8, §5).

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct CheckpointArgs {
    /// Directory to save checkpoints to.
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Directory to resume from (the iteration its tracker file names).
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Save every N iterations.
    #[arg(long)]
    pub save_interval: Option<u64>,
    /// Write checkpoints in the background while training continues: at a save each rank
    /// copies its state into host memory (pinned on a GPU) and a thread writes it; the tracker
    /// moves once every rank's files are complete, checked each iteration. A save waits for
    /// the one before it (one copy in host memory at most), and the run finishes the last one
    /// before it exits. Megatron allows it with --ckpt-format torch_dist only; here it works
    /// with every --ckpt-format (Megatron's formats are exported by rank 0 in the background).
    #[arg(long)]
    pub async_save: bool,
    /// The format of the checkpoints --save writes: safetensors (this project's: safetensors
    /// shards in Megatron's directory layout, with checksums and the model's architecture;
    /// every tool here reads it), or Megatron's torch_dist or torch, written by rank 0 from a
    /// save in ours (pretrain_gpt only). --load reads all three, whatever this says. Megatron's
    /// zarr, torch_dcp and fsdp_dtensor are refused [default: safetensors; Megatron's:
    /// torch_dist].
    #[arg(long, value_parser = ["safetensors", "torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"])]
    pub ckpt_format: Option<String>,
    /// Do not save optimizer state.
    #[arg(long)]
    pub no_save_optim: bool,
    /// Do not save random generator states.
    #[arg(long)]
    pub no_save_rng: bool,
    /// Do not load optimizer state.
    #[arg(long)]
    pub no_load_optim: bool,
    /// Do not load random generator states.
    #[arg(long)]
    pub no_load_rng: bool,
    /// Load model weights only and start at iteration 0.
    #[arg(long)]
    pub finetune: bool,
    /// Weights to start from (as --finetune) when --load has no checkpoint.
    #[arg(long)]
    pub pretrained_checkpoint: Option<PathBuf>,
    /// Fail instead of starting from scratch when --load has no checkpoint.
    #[arg(long)]
    pub exit_on_missing_checkpoint: bool,
    /// Take the architecture flags (attention groups, position embeddings, biases, activation,
    /// norms, dropouts; and FFN size, KV channels and maximum positions where not given) from
    /// the arguments recorded in the checkpoint under --load, overriding the command line.
    #[arg(long)]
    pub use_checkpoint_args: bool,
    /// Neither record per-file checksums in metadata.json at save nor verify them at load
    /// (a CRC-32C read of every file, which catches corrupted bytes on disk).
    #[arg(long)]
    pub no_checkpoint_checksums: bool,
}
