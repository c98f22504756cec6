//! Data and tokenizer flags (spec megatron-data §4).

use std::path::PathBuf;

use crate::blend::{DataPathFlags, TrainedOn};
pub use crate::tokenizer::TokenizerArgs;
use clap::Args;

#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct DataArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub paths: DataPathFlags,
    /// Synthetic data (Megatron's mock GPT dataset) instead of --data-path.
    #[arg(long)]
    pub mock_data: bool,
    /// Where to cache the sample indices [default: beside each dataset].
    #[arg(long)]
    pub data_cache_path: Option<PathBuf>,
    /// Restart position ids after every end-of-document token.
    #[arg(long)]
    pub reset_position_ids: bool,
    /// Do not attend across end-of-document tokens: each document of a sequence attends only
    /// within itself (packed sequences, computed per document without an [s, s] mask).
    #[arg(long)]
    pub reset_attention_mask: bool,
    /// No loss on the token after an end-of-document token.
    #[arg(long)]
    pub eod_mask_loss: bool,
    /// Batches prepared ahead by the background loader.
    #[arg(long, default_value_t = 2)]
    pub num_workers: usize,
    /// Supervised fine-tuning (Megatron's SFT; pretrain_gpt only): --data-path is a JSONL file
    /// of conversations, {"messages": [{"role": "system"|"user"|"assistant", "content": ...},
    /// ...]} a line, one conversation per sequence, the loss only on the assistant's turns.
    #[arg(long)]
    pub sft: bool,
    /// How --sft renders conversations: nemotron-h-aligned (Megatron's only one).
    #[arg(long, default_value = "nemotron-h-aligned")]
    pub sft_tokenizer_prompt_format: String,
    /// Accepted for compatibility: single (the only sampler).
    #[arg(long, default_value = "single")]
    pub dataloader_type: String,
}

impl DataArgs {
    /// What a run with these flags trains on; `None` without data flags (a run that trains
    /// on data of its own, such as finetuning).
    pub fn trained_on(&self) -> anyhow::Result<Option<TrainedOn>> {
        if self.mock_data {
            Ok(Some(TrainedOn::Mock))
        } else if self.paths.any() {
            self.paths.trained_on().map(Some)
        } else {
            Ok(None)
        }
    }
}
