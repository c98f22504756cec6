//! `GptDataset`: one split of one indexed dataset, its cached indices and sample assembly.
//! Training and `inspect_dataset` both read samples through this type.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};

use crate::cache::{description_hash, CacheEntry, PyJson};

use super::config::GptDatasetConfig;
use super::epochs::EpochPlan;
use super::indices::{GptIndices, IndexRequest};
use super::sample::GptSample;
use super::source::TokenSource;
use super::split::{Split, SplitMatrix};
use super::tokenizer_identity::TokenizerIdentity;

const CLASS: &str = "GPTDataset";
const CACHE_FILES: [&str; 4] = [
    "description.txt",
    "document_index.npy",
    "sample_index.npy",
    "shuffle_index.npy",
];

/// Where a dataset's indices came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexOrigin {
    /// Built now and written to this cache directory.
    BuiltAndCached(PathBuf),
    /// Loaded from this cache directory.
    Loaded(PathBuf),
    /// Built now and kept in memory only (mock data without `--data-cache-path`).
    BuiltUncached,
}

/// The raw tokens of one sample and the documents they came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleText {
    pub tokens: Vec<i64>,
    pub document_ids: Vec<i64>,
}

/// The fields every Megatron dataset description starts with (`MegatronDataset`'s
/// `unique_identifiers`); subclasses append their own.
pub struct BaseIdentifiers<'a> {
    pub class: &'a str,
    /// The prefix exactly as the user wrote it (`None` for mock data).
    pub dataset_path: Option<&'a str>,
    pub num_samples: Option<u64>,
    pub split: Split,
    pub random_seed: u32,
    pub sequence_length: usize,
    /// The raw `--split` string (`None` in per-split mode).
    pub split_string: Option<&'a str>,
    pub split_matrix: Option<&'a SplitMatrix>,
    pub tokenizer: &'a TokenizerIdentity,
}

/// The ordered identifier entries of `ids`.
pub fn base_identifiers(ids: &BaseIdentifiers) -> Vec<(String, PyJson)> {
    let entries = vec![
        ("class", PyJson::str(ids.class)),
        (
            "dataset_path",
            ids.dataset_path.map_or(PyJson::Null, PyJson::str),
        ),
        (
            "num_samples",
            ids.num_samples
                .map_or(PyJson::Null, |n| PyJson::Int(n as i64)),
        ),
        ("index_split", PyJson::str(ids.split.name())),
        ("random_seed", PyJson::Int(i64::from(ids.random_seed))),
        ("sequence_length", PyJson::Int(ids.sequence_length as i64)),
        ("split", ids.split_string.map_or(PyJson::Null, PyJson::str)),
        (
            "split_matrix",
            ids.split_matrix.map_or(PyJson::Null, SplitMatrix::to_json),
        ),
        ("tokenizer", ids.tokenizer.0.clone()),
    ];
    entries
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
}

pub struct GptDataset {
    source: Arc<dyn TokenSource>,
    split: Split,
    documents: Range<usize>,
    config: Arc<GptDatasetConfig>,
    identifiers: PyJson,
    description: String,
    indices: GptIndices,
    origin: IndexOrigin,
}

impl GptDataset {
    /// Builds (or loads from cache) the indices of `split`, covering `documents` of `source`.
    /// `dataset_path` is the prefix exactly as the user wrote it (`None` for mock data); it
    /// names the default cache directory and enters the description hash.
    pub fn new(
        source: Arc<dyn TokenSource>,
        dataset_path: Option<&str>,
        documents: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: Arc<GptDatasetConfig>,
    ) -> Result<GptDataset> {
        let identifiers = Self::identifiers_for(dataset_path, num_samples, split, &config);
        let description = identifiers.dumps();
        let cache_dir = config.path_to_cache.clone().or_else(|| {
            dataset_path.map(|p| Path::new(p).join("cache").join(format!("{CLASS}_indices")))
        });
        let (indices, origin) = match cache_dir {
            Some(dir) => {
                let entry =
                    CacheEntry::new(&dir, &description_hash(&description), CLASS, split.name());
                if entry.is_complete(&CACHE_FILES) {
                    let indices = GptIndices::from_npy(
                        entry.read_array("document_index.npy")?,
                        entry.read_array("sample_index.npy")?,
                        entry.read_array("shuffle_index.npy")?,
                    )
                    .map_err(|e| anyhow!("cache {}: {e}", entry.path("").display()))?;
                    (indices, IndexOrigin::Loaded(dir))
                } else {
                    let indices =
                        Self::build_indices(&*source, &documents, num_samples, split, &config)?;
                    let arrays = indices.to_npy();
                    let named: Vec<_> = arrays
                        .iter()
                        .map(|(affix, array)| (*affix, array))
                        .collect();
                    entry
                        .write(&description, &named)
                        .with_context(|| format!("caching the {} indices", split.name()))?;
                    (indices, IndexOrigin::BuiltAndCached(dir))
                }
            }
            None => (
                Self::build_indices(&*source, &documents, num_samples, split, &config)?,
                IndexOrigin::BuiltUncached,
            ),
        };
        Ok(GptDataset {
            source,
            split,
            documents,
            config,
            identifiers,
            description,
            indices,
            origin,
        })
    }

    fn identifiers_for(
        dataset_path: Option<&str>,
        num_samples: Option<u64>,
        split: Split,
        config: &GptDatasetConfig,
    ) -> PyJson {
        PyJson::Map(base_identifiers(&BaseIdentifiers {
            class: CLASS,
            dataset_path,
            num_samples,
            split,
            random_seed: config.random_seed,
            sequence_length: config.sequence_length,
            split_string: config.split.as_deref(),
            split_matrix: config.split_matrix.as_ref(),
            tokenizer: &config.tokenizer,
        }))
    }

    fn build_indices(
        source: &dyn TokenSource,
        documents: &Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: &GptDatasetConfig,
    ) -> Result<GptIndices> {
        let lengths = source.sequence_lengths();
        let tokens_per_epoch: u64 = lengths[documents.clone()].iter().map(|&l| l as u64).sum();
        let extra = config.extra_tokens() as u64;
        let plan = EpochPlan::new(
            tokens_per_epoch,
            config.sequence_length as u64,
            num_samples,
            extra,
        )
        .map_err(|e| {
            anyhow!(
                "{} split (sequences {}..{}): {e}",
                split.name(),
                documents.start,
                documents.end
            )
        })?;
        let drop_last = split != Split::Valid || config.drop_last_partial_validation_sequence;
        Ok(GptIndices::build(&IndexRequest {
            sequence_lengths: lengths,
            documents: documents.clone(),
            plan,
            sequence_length: config.sequence_length as u64,
            seed: config.random_seed,
            drop_last_partial_sequence: drop_last,
            add_extra_token: config.add_extra_token_to_sequence,
        }))
    }

    pub fn len(&self) -> usize {
        self.indices.num_samples()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn split(&self) -> Split {
        self.split
    }

    /// The sequence range of the low-level dataset this split covers.
    pub fn documents(&self) -> Range<usize> {
        self.documents.clone()
    }

    pub fn indices(&self) -> &GptIndices {
        &self.indices
    }

    pub fn origin(&self) -> &IndexOrigin {
        &self.origin
    }

    /// The ordered identifier map (blends embed it in their own description).
    pub fn identifiers(&self) -> &PyJson {
        &self.identifiers
    }

    /// The cache description text; its MD5 prefixes the cache file names.
    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn description_hash(&self) -> String {
        description_hash(&self.description)
    }

    /// The `sequence_length + extra` raw tokens of sample `idx` and the documents they span.
    pub fn sample_text(&self, idx: usize) -> SampleText {
        assert!(
            idx < self.len(),
            "sample {idx} out of range ({} samples)",
            self.len()
        );
        let extra = self.config.extra_tokens();
        let row = self.indices.shuffle_index.get(idx) as usize;
        let (first, first_offset) = self.indices.sample_row(row);
        let (last, last_offset) = self.indices.sample_row(row + 1);
        let document_at = |position: usize| self.indices.document_index.get(position);

        let window = self.config.sequence_length + extra;
        let mut tokens = Vec::with_capacity(window);
        let mut document_ids = Vec::with_capacity(last - first + 1);
        for position in first..=last {
            let document = document_at(position);
            let offset = if position == first { first_offset } else { 0 };
            let length = (position == last).then(|| last_offset + extra - offset);
            document_ids.push(document);
            self.source
                .read_into(document as usize, offset, length, &mut tokens);
        }
        tokens.resize(window.max(tokens.len()), self.config.sample.pad_token);
        SampleText {
            tokens,
            document_ids,
        }
    }

    /// The training sample at `idx`; `None` gives batch padding (sample 0, no loss).
    pub fn get(&self, idx: Option<usize>) -> GptSample {
        let text = self.sample_text(idx.unwrap_or(0));
        let sample = GptSample::from_text(
            &text.tokens,
            self.config.add_extra_token_to_sequence,
            &self.config.sample,
        );
        if idx.is_none() {
            sample.into_padding()
        } else {
            sample
        }
    }
}
