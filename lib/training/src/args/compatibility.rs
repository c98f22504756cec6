//! Flags of Megatron's scripts that change nothing here, taken so that those scripts run
//! unchanged. Each one given gets a one-line note at start-up saying why it changes nothing.

use clap::Args;

#[derive(Debug, Clone, Default, Args, serde::Serialize)]
pub struct CompatibilityArgs {
    /// Changes nothing here: Megatron runs Python's garbage collector by hand; there is none.
    #[arg(long)]
    pub manual_gc: bool,
    /// Changes nothing here (see --manual-gc).
    #[arg(long)]
    pub manual_gc_interval: Option<u64>,
    /// Changes nothing here (see --manual-gc).
    #[arg(long)]
    pub no_manual_gc_eval: bool,
    /// Changes nothing here: libtorch's caching allocator keeps its freed blocks for the next
    /// iteration, which allocates the same sizes.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub empty_unused_memory_level: Option<u8>,
    /// Changes nothing here: no attention mask is built for causal attention (the attention
    /// kernel masks); one is built only for --reset-attention-mask.
    #[arg(long)]
    pub no_create_attention_mask_in_dataloader: bool,
    /// Changes nothing here: `.bin` files are always memory-mapped and read through the page
    /// cache.
    #[arg(long)]
    pub no_mmap_bin_files: bool,
    /// Changes nothing here: tensor-parallel communication is not overlapped with the GEMMs
    /// (Transformer Engine's userbuffers are not used).
    #[arg(long)]
    pub tp_comm_overlap: bool,
    /// Changes nothing here: gradients are accumulated and reduced across data-parallel ranks
    /// in float32.
    #[arg(long)]
    pub grad_reduce_in_bf16: bool,
    /// Changes nothing here: TensorBoard events are written as they are made.
    #[arg(long)]
    pub tensorboard_queue_size: Option<u64>,
    /// Changes nothing here: `iteration-time` is always written; the time is not broken down
    /// into timers.
    #[arg(long)]
    pub log_timers_to_tensorboard: bool,
    /// Changes nothing here: the validation perplexity (`<loss> validation ppl`) is always
    /// written.
    #[arg(long)]
    pub log_validation_ppl_to_tensorboard: bool,
    /// Changes nothing here: `world-size` is always written.
    #[arg(long)]
    pub log_world_size_to_tensorboard: bool,
    /// Weights & Biases logging is off here (it needs its service): TensorBoard
    /// (--tensorboard-dir) and metrics.jsonl carry the same scalars.
    #[arg(long)]
    pub wandb_project: Option<String>,
    /// See --wandb-project.
    #[arg(long)]
    pub wandb_exp_name: Option<String>,
    /// See --wandb-project.
    #[arg(long)]
    pub wandb_save_dir: Option<String>,
}

impl CompatibilityArgs {
    /// One line per flag given: the flag and why it changes nothing here.
    pub fn notes(&self) -> Vec<String> {
        let given = [
            (
                self.manual_gc,
                "--manual-gc",
                "there is no Python garbage collector",
            ),
            (
                self.manual_gc_interval.is_some(),
                "--manual-gc-interval",
                "there is no Python garbage collector",
            ),
            (
                self.no_manual_gc_eval,
                "--no-manual-gc-eval",
                "there is no Python garbage collector",
            ),
            (
                self.empty_unused_memory_level
                    .is_some_and(|level| level > 0),
                "--empty-unused-memory-level",
                "the caching allocator keeps its freed blocks for the next iteration",
            ),
            (
                self.no_create_attention_mask_in_dataloader,
                "--no-create-attention-mask-in-dataloader",
                "causal attention builds no mask (only --reset-attention-mask does)",
            ),
            (
                self.no_mmap_bin_files,
                "--no-mmap-bin-files",
                ".bin files are always memory-mapped",
            ),
            (
                self.tp_comm_overlap,
                "--tp-comm-overlap",
                "tensor-parallel communication is not overlapped with the GEMMs",
            ),
            (
                self.grad_reduce_in_bf16,
                "--grad-reduce-in-bf16",
                "gradients are reduced in float32",
            ),
            (
                self.tensorboard_queue_size.is_some(),
                "--tensorboard-queue-size",
                "events are written as they are made",
            ),
            (
                self.log_timers_to_tensorboard,
                "--log-timers-to-tensorboard",
                "iteration-time is always written, not broken down into timers",
            ),
            (
                self.log_validation_ppl_to_tensorboard,
                "--log-validation-ppl-to-tensorboard",
                "the validation perplexity is always written",
            ),
            (
                self.log_world_size_to_tensorboard,
                "--log-world-size-to-tensorboard",
                "world-size is always written",
            ),
            (
                self.wandb_project.is_some()
                    || self.wandb_exp_name.is_some()
                    || self.wandb_save_dir.is_some(),
                "--wandb-project",
                "Weights & Biases logging is off here; --tensorboard-dir and metrics.jsonl carry \
                 the same scalars",
            ),
        ];
        given
            .into_iter()
            .filter(|(set, _, _)| *set)
            .map(|(_, flag, why)| format!("note: {flag} changes nothing here: {why}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        compatibility: CompatibilityArgs,
    }

    #[test]
    fn each_flag_given_gets_one_note_naming_it() {
        let flags = Flags::try_parse_from([
            "test",
            "--manual-gc",
            "--manual-gc-interval",
            "100",
            "--tp-comm-overlap",
            "--wandb-project",
            "p",
            "--wandb-exp-name",
            "e",
        ])
        .unwrap();
        let notes = flags.compatibility.notes();
        assert_eq!(notes.len(), 4, "{notes:?}");
        for flag in [
            "--manual-gc ",
            "--manual-gc-interval",
            "--tp-comm-overlap",
            "--wandb-project",
        ] {
            assert_eq!(
                notes.iter().filter(|n| n.contains(flag)).count(),
                1,
                "{flag}: {notes:?}"
            );
        }
        let none = Flags::try_parse_from(["test", "--empty-unused-memory-level", "0"]).unwrap();
        assert!(none.compatibility.notes().is_empty());
        assert!(Flags::try_parse_from(["test", "--empty-unused-memory-level", "3"]).is_err());
    }
}
