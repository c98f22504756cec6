//! `MaskedWordPieceDataset`: one split of one sentence-level indexed dataset, its cached sample
//! mapping and the sentences of each sample. BERT and T5 build their samples on top of it.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};

use crate::cache::{description_hash, CacheEntry, PyJson};
use crate::gpt::{base_identifiers, BaseIdentifiers, IndexOrigin, SentenceSource, Split};
use crate::random::RandomState;

use super::config::MaskedDatasetConfig;
use super::mapping::{MappingRequest, SampleMapping};

const CACHE_FILES: [&str; 2] = ["description.txt", "sample_index.npy"];

/// What a subclass adds to the shared base.
pub(super) struct MaskedKind {
    /// Megatron's class name: cache file names and the description's `class`.
    pub class: &'static str,
    /// Entries after the masking ones (`classification_head`, `sequence_length_decoder`).
    pub extra_identifiers: Vec<(String, PyJson)>,
    /// Token budget of a sample (BERT: sequence length − 3, T5: − 2).
    pub max_seq_length: usize,
    /// 2 with BERT's binary head, else 1.
    pub min_sentences: u32,
}

/// The sentences and randomness of one sample, before BERT/T5 assembly.
pub struct SampleSentences {
    pub sentences: Vec<Vec<i64>>,
    /// The mapping's target length for this sample.
    pub target_length: usize,
    /// `RandomState((seed + idx) mod 2^32)`: every draw of the sample comes from it.
    pub rng: RandomState,
}

pub struct MaskedWordPieceDataset {
    source: Arc<dyn SentenceSource>,
    split: Split,
    documents: Range<usize>,
    random_seed: u32,
    identifiers: PyJson,
    description: String,
    mapping: SampleMapping,
    origin: IndexOrigin,
}

impl MaskedWordPieceDataset {
    /// Builds (or loads from cache) the sample mapping of `documents` (a document range) of
    /// `source`. `dataset_path` is the prefix as the user wrote it.
    pub(super) fn new(
        kind: MaskedKind,
        source: Arc<dyn SentenceSource>,
        dataset_path: &str,
        documents: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: &MaskedDatasetConfig,
    ) -> Result<MaskedWordPieceDataset> {
        config.validate()?;
        let document_indices = source.document_indices();
        let num_documents = document_indices.len().saturating_sub(1);
        if documents.end > num_documents {
            bail!(
                "{dataset_path}: documents {}..{} requested, the dataset has {num_documents}",
                documents.start,
                documents.end
            );
        }
        if kind.min_sentences >= 2 && is_document_level(document_indices) {
            bail!(
                "{dataset_path} holds one sequence per document (was it preprocessed without \
                 --split-sentences?), and BERT's binary (sentence-order) head needs samples of at \
                 least two sentences, so Megatron would loop forever here. Preprocess the corpus \
                 again with `preprocess_data ... --split-sentences` (or train without the head: \
                 --bert-no-binary-head)"
            );
        }

        let mut entries = base_identifiers(&BaseIdentifiers {
            class: kind.class,
            dataset_path: Some(dataset_path),
            num_samples,
            split,
            random_seed: config.random_seed,
            sequence_length: config.sequence_length,
            split_string: config.split.as_deref(),
            split_matrix: config.split_matrix.as_ref(),
            tokenizer: &config.tokenizer,
        });
        entries.extend(config.masking_identifiers());
        entries.extend(kind.extra_identifiers);
        let identifiers = PyJson::Map(entries);
        let max_seq_length = kind.max_seq_length as u64;
        let description = identifiers.dumps();

        let cache_dir = config.path_to_cache.clone().unwrap_or_else(|| {
            Path::new(dataset_path)
                .join("cache")
                .join(format!("{}_indices", kind.class))
        });
        let entry =
            CacheEntry::without_split(&cache_dir, &description_hash(&description), kind.class);
        let (mapping, origin) = if entry.is_complete(&CACHE_FILES) {
            let array = entry.read_array("sample_index.npy")?;
            let mapping = SampleMapping::from_npy(array).ok_or_else(|| {
                anyhow!(
                    "cached sample index {} is not a [N, 3] uint32/uint64 array",
                    entry.path("sample_index.npy").display()
                )
            })?;
            (mapping, IndexOrigin::Loaded(cache_dir))
        } else {
            // Megatron passes the split's document boundaries plus the next one.
            let mapping = SampleMapping::build(&MappingRequest {
                document_bounds: &document_indices[documents.start..documents.end + 1],
                sentence_lengths: source.sequence_lengths(),
                num_samples,
                max_seq_length: kind.max_seq_length as i32,
                short_seq_prob: config.short_sequence_probability,
                seed: config.random_seed,
                min_num_sent: kind.min_sentences,
            });
            entry
                .write(&description, &[("sample_index.npy", &mapping.to_npy())])
                .with_context(|| format!("caching the {} sample index", split.name()))?;
            (mapping, IndexOrigin::BuiltAndCached(cache_dir))
        };
        let sentence_count = source.sequence_lengths().len() as u64;
        for i in 0..mapping.len() {
            let [first, end, target] = mapping.row(i);
            if first >= end || end > sentence_count || target > max_seq_length {
                bail!(
                    "sample index row {i} ({first}, {end}, {target}) does not fit {dataset_path} \
                     ({sentence_count} sentences, at most {max_seq_length} tokens per sample); \
                     delete the stale cache {}",
                    entry.path("*").display()
                );
            }
        }
        Ok(MaskedWordPieceDataset {
            source,
            split,
            documents,
            random_seed: config.random_seed,
            identifiers,
            description,
            mapping,
            origin,
        })
    }

    pub fn len(&self) -> usize {
        self.mapping.len()
    }

    pub fn is_empty(&self) -> bool {
        self.mapping.is_empty()
    }

    pub fn split(&self) -> Split {
        self.split
    }

    /// The document range of the low-level dataset this split covers.
    pub fn documents(&self) -> Range<usize> {
        self.documents.clone()
    }

    pub fn mapping(&self) -> &SampleMapping {
        &self.mapping
    }

    pub fn origin(&self) -> &IndexOrigin {
        &self.origin
    }

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

    /// The sentences, target length and random state of sample `idx`.
    pub fn sample_sentences(&self, idx: usize) -> SampleSentences {
        assert!(
            idx < self.len(),
            "sample {idx} out of range ({} samples)",
            self.len()
        );
        let [first, end, target] = self.mapping.row(idx);
        let sentences = (first..end)
            .map(|s| {
                let mut tokens = Vec::new();
                self.source.read_into(s as usize, 0, None, &mut tokens);
                tokens
            })
            .collect();
        SampleSentences {
            sentences,
            target_length: target as usize,
            rng: RandomState::new(self.random_seed.wrapping_add(idx as u32)),
        }
    }
}

/// Every document is exactly one sequence: the data was preprocessed without
/// `--split-sentences`.
fn is_document_level(document_indices: &[i64]) -> bool {
    document_indices.len() > 1
        && document_indices
            .iter()
            .enumerate()
            .all(|(i, &start)| start == i as i64)
}
