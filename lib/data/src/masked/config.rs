//! Megatron's `MaskedWordPieceDatasetConfig` and its BERT/T5 subclasses, with the defaults
//! `pretrain_bert.py` and `pretrain_t5.py` pass.

use std::path::PathBuf;

use anyhow::{bail, Result};

use crate::cache::PyJson;
use crate::gpt::{SplitMatrix, TokenizerIdentity};

use super::masking::MaskingOptions;
use super::vocab::MaskedLmVocab;

/// Settings shared by the BERT and T5 datasets.
#[derive(Debug, Clone)]
pub struct MaskedDatasetConfig {
    /// `--seed`; Megatron's C++ helpers require 1..=2^31−1.
    pub random_seed: u32,
    /// `--seq-length` (BERT) or `--encoder-seq-length` (T5).
    pub sequence_length: usize,
    /// The raw `--split` string (hashed verbatim); `None` for per-split blends.
    pub split: Option<String>,
    pub split_matrix: Option<SplitMatrix>,
    /// `--data-cache-path`; without it indices go to `PREFIX/cache/<Class>_indices`.
    pub path_to_cache: Option<PathBuf>,
    /// The tokenizer's entry in cache descriptions.
    pub tokenizer: TokenizerIdentity,
    pub vocab: MaskedLmVocab,
    pub masking: MaskingOptions,
    /// `--short-seq-prob`.
    pub short_sequence_probability: f64,
    /// `--mid-level-dataset-surplus`.
    pub mid_level_dataset_surplus: f64,
}

impl MaskedDatasetConfig {
    /// Megatron's config assertions, as errors naming the flag.
    pub fn validate(&self) -> Result<()> {
        let p = self.masking.probability;
        if !(p > 0.0 && p < 1.0) {
            bail!("--mask-prob must be in (0, 1), got {p}");
        }
        let s = self.short_sequence_probability;
        if !(0.0..=1.0).contains(&s) {
            bail!("--short-seq-prob must be in [0, 1], got {s}");
        }
        if self.masking.max_ngram == 0 {
            bail!("the maximum masked n-gram must be at least 1");
        }
        if self.random_seed == 0 || self.random_seed > i32::MAX as u32 {
            bail!(
                "--seed must be in 1..={} for BERT/T5 data (Megatron's sample mapping takes a \
                 positive int32 seed), got {}",
                i32::MAX,
                self.random_seed
            );
        }
        Ok(())
    }

    /// The masking entries of the cache description, in Megatron's order.
    pub(super) fn masking_identifiers(&self) -> Vec<(String, PyJson)> {
        let m = &self.masking;
        vec![
            ("masking_probability".into(), PyJson::Float(m.probability)),
            (
                "short_sequence_probability".into(),
                PyJson::Float(self.short_sequence_probability),
            ),
            ("masking_max_ngram".into(), PyJson::Int(m.max_ngram as i64)),
            ("masking_do_full_word".into(), PyJson::Bool(m.do_full_word)),
            // Megatron's permutation draws from numpy's global RNG (not reproducible); neither
            // pretraining script enables it, so it is always off here.
            ("masking_do_permutation".into(), PyJson::Bool(false)),
            (
                "masking_use_longer_ngrams".into(),
                PyJson::Bool(m.use_longer_ngrams),
            ),
            (
                "masking_use_geometric_distribution".into(),
                PyJson::Bool(m.use_geometric_distribution),
            ),
        ]
    }
}

/// `BERTMaskedWordPieceDatasetConfig`.
#[derive(Debug, Clone)]
pub struct BertDatasetConfig {
    pub masked: MaskedDatasetConfig,
    /// `--bert-binary-head` (default on; `--bert-no-binary-head` turns it off): samples hold
    /// two segments, possibly swapped, for the sentence-order task.
    pub classification_head: bool,
}

impl BertDatasetConfig {
    /// `pretrain_bert.py`'s masking: n-grams up to 3 with probabilities ∝ 1/n, whole words.
    pub fn bert_masking(mask_prob: f64) -> MaskingOptions {
        MaskingOptions {
            probability: mask_prob,
            max_ngram: 3,
            do_full_word: true,
            use_longer_ngrams: false,
            use_geometric_distribution: false,
        }
    }
}

/// `T5MaskedWordPieceDatasetConfig`.
#[derive(Debug, Clone)]
pub struct T5DatasetConfig {
    /// `sequence_length` is the encoder length.
    pub masked: MaskedDatasetConfig,
    /// `--decoder-seq-length`.
    pub sequence_length_decoder: usize,
}

impl T5DatasetConfig {
    /// `pretrain_t5.py`'s masking: geometric (p = 0.2) spans of up to 10 whole words.
    pub fn t5_masking(mask_prob: f64) -> MaskingOptions {
        MaskingOptions {
            probability: mask_prob,
            max_ngram: 10,
            do_full_word: true,
            use_longer_ngrams: false,
            use_geometric_distribution: true,
        }
    }
}
