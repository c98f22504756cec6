//! From Megatron's flags to the BERT/T5 datasets of every split (blends and splits through the
//! shared builder; the split is over documents).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::blend::{
    build_split_datasets, BlendMember, BuilderSettings, DataSources, SourceCache, SplitDataset,
};
use crate::gpt::{Bookend, SentenceSource, Split, SplitMatrix};
use crate::indexed::IndexedDataset;
use crate::tokenizer::TokenizerArgs;

use super::bert::BertMaskedWordPieceDataset;
use super::config::{BertDatasetConfig, MaskedDatasetConfig, T5DatasetConfig};
use super::masking::MaskingOptions;
use super::t5::T5MaskedWordPieceDataset;
use super::tokenizer::MaskedTokenizer;

/// Opens a dataset prefix as sentence data.
pub type SentenceSourceOpener<'a> = dyn Fn(&str) -> Result<Arc<dyn SentenceSource>> + 'a;

/// Opens `PREFIX.bin/.idx` (the production opener).
pub fn open_indexed(prefix: &str) -> Result<Arc<dyn SentenceSource>> {
    Ok(Arc::new(IndexedDataset::open(prefix)?))
}

/// The data flags `pretrain_bert`/`pretrain_t5` (and `inspect_dataset`) share.
#[derive(Debug, Clone)]
pub struct MaskedDataFlags {
    /// `--seed`.
    pub seed: u32,
    /// `--seq-length` (BERT) or `--encoder-seq-length` (T5).
    pub seq_length: usize,
    /// `--mask-prob` (Megatron's default 0.15).
    pub mask_prob: f64,
    /// `--short-seq-prob` (Megatron's default 0.1).
    pub short_seq_prob: f64,
    /// The raw `--split` string, or `None` in per-split mode.
    pub split: Option<String>,
    /// `--data-cache-path`.
    pub data_cache_path: Option<PathBuf>,
    /// `--mid-level-dataset-surplus` (0.005).
    pub mid_level_dataset_surplus: f64,
    /// The tokenizer flags (its files' paths are recorded verbatim in cache descriptions).
    pub tokenizer: TokenizerArgs,
    /// `--vocab-extra-ids` (T5 sentinels; 0 for BERT).
    pub vocab_extra_ids: usize,
}

impl MaskedDataFlags {
    /// The shared config with the given masking.
    pub fn config(&self, masking: MaskingOptions) -> Result<MaskedDatasetConfig> {
        let tokenizer = MaskedTokenizer::from_flags(&self.tokenizer, self.vocab_extra_ids)?;
        let config = MaskedDatasetConfig {
            random_seed: self.seed,
            sequence_length: self.seq_length,
            split: self.split.clone(),
            split_matrix: self.split.as_deref().map(SplitMatrix::parse).transpose()?,
            path_to_cache: self.data_cache_path.clone(),
            tokenizer: MaskedTokenizer::identity(&self.tokenizer, self.vocab_extra_ids)?,
            vocab: tokenizer.vocab,
            masking,
            short_sequence_probability: self.short_seq_prob,
            mid_level_dataset_surplus: self.mid_level_dataset_surplus,
        };
        config.validate()?;
        Ok(config)
    }

    /// `pretrain_bert`'s dataset config; `binary_head` is `--bert-binary-head`.
    pub fn bert(&self, binary_head: bool) -> Result<BertDatasetConfig> {
        Ok(BertDatasetConfig {
            masked: self.config(BertDatasetConfig::bert_masking(self.mask_prob))?,
            classification_head: binary_head,
        })
    }

    /// `pretrain_t5`'s dataset config.
    pub fn t5(&self, decoder_seq_length: usize) -> Result<T5DatasetConfig> {
        Ok(T5DatasetConfig {
            masked: self.config(T5DatasetConfig::t5_masking(self.mask_prob))?,
            sequence_length_decoder: decoder_seq_length,
        })
    }
}

/// The BERT datasets of train/valid/test; `sizes[i] = None` means one pass of that split.
pub fn build_bert_datasets(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    config: Arc<BertDatasetConfig>,
    open: &SentenceSourceOpener,
) -> Result<[Option<SplitDataset<BertMaskedWordPieceDataset>>; 3]> {
    let masked = config.masked.clone();
    build_masked(
        sources,
        sizes,
        &masked,
        open,
        &mut |source, prefix, documents, n, split| {
            BertMaskedWordPieceDataset::new(source, prefix, documents, n, split, config.clone())
        },
    )
}

/// The T5 datasets of train/valid/test; `sizes[i] = None` means one pass of that split.
pub fn build_t5_datasets(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    config: Arc<T5DatasetConfig>,
    open: &SentenceSourceOpener,
) -> Result<[Option<SplitDataset<T5MaskedWordPieceDataset>>; 3]> {
    let masked = config.masked.clone();
    build_masked(
        sources,
        sizes,
        &masked,
        open,
        &mut |source, prefix, documents, n, split| {
            T5MaskedWordPieceDataset::new(source, prefix, documents, n, split, config.clone())
        },
    )
}

type NewMember<'a, D> = dyn FnMut(Arc<dyn SentenceSource>, &str, std::ops::Range<usize>, Option<u64>, Split) -> Result<D>
    + 'a;

fn build_masked<D: BlendMember>(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    config: &MaskedDatasetConfig,
    open: &SentenceSourceOpener,
    new_member: &mut NewMember<D>,
) -> Result<[Option<SplitDataset<D>>; 3]> {
    let mut opened = SourceCache::new(open);
    let settings = BuilderSettings {
        split_matrix: config.split_matrix.as_ref(),
        path_to_cache: config.path_to_cache.as_deref(),
        mid_level_dataset_surplus: config.mid_level_dataset_surplus,
    };
    let mut member = |prefix: &str, split: Split, bookend: Bookend, num_samples| {
        let source = opened.get(prefix)?;
        let num_documents = source.document_indices().len().saturating_sub(1);
        if num_documents == 0 {
            bail!("{prefix} holds no documents");
        }
        // BERT and T5 split by document, not by sequence as GPT does.
        let documents = bookend.range(num_documents);
        new_member(source, prefix, documents, num_samples, split)
            .with_context(|| format!("building the {} samples of {prefix}", split.name()))
    };
    build_split_datasets(sources, sizes, settings, &mut member)
}
