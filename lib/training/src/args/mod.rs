//! Megatron's command-line flags, shared by the binaries (same names, same
//! defaults as Megatron's `arguments.py`, core_v0.13). Each group is a clap `Args` struct the
//! binaries flatten into their parser. A family's own flags are in its folder of
//! `megatron-models` (`BertArgs`, `T5Args`), and the flags of its pretraining binary in its
//! training file (`families::bert::BertPretrainArgs`).

mod checkpoint_args;
mod checkpointing;
mod compatibility;
mod finetune;
mod fp8;
mod logging;
mod model;
mod moe;
mod parallel;
mod training;

pub use checkpoint_args::apply_checkpoint_args;
pub use checkpointing::CheckpointArgs;
pub use compatibility::CompatibilityArgs;
pub use finetune::{FinetuneArgs, FinetuneTaskArgs};
pub use fp8::Fp8Args;
pub use logging::LoggingArgs;
pub use megatron_data::flags::{DataArgs, TokenizerArgs};
pub use model::ModelArgs;
pub use moe::MoeArgs;
pub use parallel::ParallelArgs;
pub use training::{MixedPrecisionArgs, OptimizerArgs, RecomputeArgs, TrainingArgs};

/// The flags every pretraining binary shares: all of `pretrain_gpt`'s.
#[derive(Debug, Clone, clap::Args, serde::Serialize)]
pub struct PretrainArgs {
    #[command(flatten, next_help_heading = "Model")]
    pub model: ModelArgs,
    #[command(flatten, next_help_heading = "Training")]
    pub training: TrainingArgs,
    #[command(flatten, next_help_heading = "Parallelism")]
    pub parallel: ParallelArgs,
    #[command(flatten, next_help_heading = "Optimizer and schedule")]
    pub optimizer: OptimizerArgs,
    #[command(flatten, next_help_heading = "Mixed precision")]
    pub precision: MixedPrecisionArgs,
    #[command(flatten, next_help_heading = "Activation recomputation")]
    pub recompute: RecomputeArgs,
    #[command(flatten, next_help_heading = "Transformer Engine (FP8)")]
    pub fp8: Fp8Args,
    #[command(flatten, next_help_heading = "Checkpoints")]
    pub checkpoint: CheckpointArgs,
    #[command(flatten, next_help_heading = "Data")]
    pub data: DataArgs,
    #[command(flatten, next_help_heading = "Tokenizer")]
    pub tokenizer: TokenizerArgs,
    #[command(flatten, next_help_heading = "Logging")]
    pub logging: LoggingArgs,
    #[command(
        flatten,
        next_help_heading = "Accepted from Megatron's scripts, changing nothing here"
    )]
    pub compatibility: CompatibilityArgs,
}

impl PretrainArgs {
    /// With `--use-checkpoint-args` and a checkpoint under `--load`, these flags with the
    /// checkpoint's architecture flags in place of the command line's ([`apply_checkpoint_args`]);
    /// `announce` prints Megatron's line for each flag changed.
    pub fn with_checkpoint_args(&self, announce: bool) -> anyhow::Result<PretrainArgs> {
        let mut args = self.clone();
        if let (true, Some(load)) = (self.checkpoint.use_checkpoint_args, &self.checkpoint.load) {
            for line in apply_checkpoint_args(&mut args.model, load)? {
                if announce {
                    println!("{line}");
                }
            }
        }
        Ok(args)
    }
}
