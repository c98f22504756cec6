//! Megatron's masked-language-model datasets over sentence-level data: the shared
//! `MaskedWordPieceDataset` base (sample mapping, cache, whole-word n-gram masking) and the
//! BERT and T5 samples built on it.

mod bert;
mod build;
mod config;
mod dataset;
mod mapping;
mod masking;
mod t5;
mod tokenizer;
mod vocab;

pub use bert::{BertMaskedWordPieceDataset, BertSample};
pub use build::{
    build_bert_datasets, build_t5_datasets, open_indexed, MaskedDataFlags, SentenceSourceOpener,
};
pub use config::{BertDatasetConfig, MaskedDatasetConfig, T5DatasetConfig};
pub use dataset::{MaskedWordPieceDataset, SampleSentences};
pub use mapping::{MappingRequest, SampleMapping};
pub use masking::{mask_tokens, MaskedSpan, MaskedTokens, MaskingOptions};
pub use t5::{T5MaskedWordPieceDataset, T5Sample};
pub use tokenizer::MaskedTokenizer;
pub use vocab::MaskedLmVocab;
