//! GPT dataset settings (Megatron's `GPTDatasetConfig`).

use std::path::PathBuf;

use super::split::SplitMatrix;
use super::tokenizer_identity::TokenizerIdentity;

/// How tokens become training inputs (§4.11); none of this enters the cache hash.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOptions {
    pub eod_token: i64,
    /// `-1` unless the tokenizer has a distinct pad id.
    pub pad_token: i64,
    pub reset_position_ids: bool,
    pub reset_attention_mask: bool,
    pub eod_mask_loss: bool,
    pub create_attention_mask: bool,
}

#[derive(Debug, Clone)]
pub struct GptDatasetConfig {
    pub random_seed: u32,
    pub sequence_length: usize,
    /// The raw `--split` string (it is hashed verbatim, spaces included); `None` for per-split
    /// blends.
    pub split: Option<String>,
    pub split_matrix: Option<SplitMatrix>,
    /// `--data-cache-path`; without it indices are cached beside each dataset prefix.
    pub path_to_cache: Option<PathBuf>,
    pub tokenizer: TokenizerIdentity,
    pub add_extra_token_to_sequence: bool,
    pub drop_last_partial_validation_sequence: bool,
    pub mid_level_dataset_surplus: f64,
    pub sample: SampleOptions,
}

impl GptDatasetConfig {
    pub fn extra_tokens(&self) -> usize {
        usize::from(self.add_extra_token_to_sequence)
    }
}
