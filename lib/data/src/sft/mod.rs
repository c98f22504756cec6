//! Supervised fine-tuning data as Megatron's `--sft` reads it (`SFTDataset`, `SFTTokenizer`):
//! conversations in JSONL, rendered turn by turn in the prompt format of
//! `--sft-tokenizer-prompt-format`, with the loss only on the assistant's turns, one
//! conversation per sequence of `--seq-length` (truncated, then ended and padded).

mod conversation;
mod dataset;
mod prompt_format;
mod splits;

pub use conversation::{read_conversations, Message, Role};
pub use dataset::{SftDataset, SftSplit};
pub use prompt_format::PromptFormat;
pub use splits::{build_sft_splits, SftRequest};
