//! Megatron's GPT dataset: split ranges, epoch plan, document/sample/shuffle indices (cached
//! under Megatron's file names) and sample assembly.

mod config;
mod dataset;
mod document_index;
mod epochs;
mod indices;
mod mock;
mod sample;
mod sample_index;
mod shuffle_index;
mod source;
mod split;
mod tokenizer_identity;

pub use config::{GptDatasetConfig, SampleOptions};
pub use dataset::{base_identifiers, BaseIdentifiers, GptDataset, IndexOrigin, SampleText};
pub use document_index::build_document_index;
pub use epochs::EpochPlan;
pub use indices::{GptIndices, IndexRequest};
pub use mock::MockTokenSource;
pub use sample::GptSample;
pub use sample_index::{build_sample_index, SampleIndexInput};
pub use shuffle_index::build_shuffle_index;
pub use source::{SentenceSource, TokenSource};
pub use split::{Bookend, Split, SplitMatrix};
pub use tokenizer_identity::{TokenizerGeneration, TokenizerIdentity};
