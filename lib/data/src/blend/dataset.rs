//! `BlendedDataset`: several datasets of one split (GPT, BERT or T5) interleaved by weight.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::cache::{description_hash, CacheEntry, IndexArray, NpyArray, PyJson};
use crate::gpt::{GptDataset, GptSample, SampleText, Split};

use super::indices::{build_blending_indices, build_exhaustive_blending_indices, BlendingIndices};
use super::weights::normalize;

const CLASS: &str = "BlendedDataset";
const CACHE_FILES: [&str; 3] = [
    "description.txt",
    "dataset_index.npy",
    "dataset_sample_index.npy",
];

/// Member weights: floats for sized blends, member lengths for exhaustive ones.
#[derive(Debug, Clone, PartialEq)]
pub enum BlendWeights {
    Float(Vec<f64>),
    Count(Vec<u64>),
}

/// What a blend needs of its members (Megatron's mid-level datasets).
pub trait BlendMember {
    type Sample;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn split(&self) -> Split;
    /// The ordered identifier map; the blend's description embeds it.
    fn identifiers(&self) -> &PyJson;
    fn sample(&self, idx: usize) -> Self::Sample;
}

impl BlendMember for GptDataset {
    type Sample = GptSample;

    fn len(&self) -> usize {
        GptDataset::len(self)
    }

    fn split(&self) -> Split {
        GptDataset::split(self)
    }

    fn identifiers(&self) -> &PyJson {
        GptDataset::identifiers(self)
    }

    fn sample(&self, idx: usize) -> GptSample {
        self.get(Some(idx))
    }
}

pub struct BlendedDataset<D: BlendMember = GptDataset> {
    datasets: Vec<D>,
    description: String,
    indices: BlendingIndices,
}

impl<D: BlendMember> BlendedDataset<D> {
    /// `size = None` draws every member sample once (weights must be member lengths).
    pub fn new(
        datasets: Vec<D>,
        weights: BlendWeights,
        size: Option<usize>,
        cache_dir: Option<&Path>,
        surplus: f64,
    ) -> Result<BlendedDataset<D>> {
        if datasets.is_empty() || datasets.len() > 32766 {
            bail!("a blend needs 1 to 32766 datasets, got {}", datasets.len());
        }
        let split = datasets[0].split();
        let weights_json = match (&weights, size) {
            (BlendWeights::Float(w), Some(_)) => BlendWeights::Float(normalize(w)),
            (BlendWeights::Count(c), Some(_)) => {
                BlendWeights::Float(normalize(&c.iter().map(|&c| c as f64).collect::<Vec<_>>()))
            }
            (w, None) => w.clone(),
        };
        let identifiers = PyJson::Map(vec![
            ("class".into(), PyJson::str(CLASS)),
            (
                "datasets".into(),
                PyJson::List(datasets.iter().map(|d| d.identifiers().clone()).collect()),
            ),
            ("split".into(), PyJson::str(split.name())),
            (
                "weights".into(),
                match &weights_json {
                    BlendWeights::Float(w) => {
                        PyJson::List(w.iter().map(|&x| PyJson::Float(x)).collect())
                    }
                    BlendWeights::Count(c) => {
                        PyJson::List(c.iter().map(|&x| PyJson::Int(x as i64)).collect())
                    }
                },
            ),
            (
                "size".into(),
                size.map_or(PyJson::Null, |s| PyJson::Int(s as i64)),
            ),
        ]);
        let description = identifiers.dumps();
        let entry = cache_dir
            .map(|dir| CacheEntry::new(dir, &description_hash(&description), CLASS, split.name()));

        let indices = match &entry {
            Some(entry) if entry.is_complete(&CACHE_FILES) => {
                let dataset_index = entry.read_array("dataset_index.npy")?;
                let sample_index = entry.read_array("dataset_sample_index.npy")?;
                match (dataset_index.data, sample_index.data) {
                    (IndexArray::I16(d), IndexArray::I64(s)) if d.len() == s.len() => {
                        BlendingIndices {
                            dataset_index: d,
                            dataset_sample_index: s,
                        }
                    }
                    _ => bail!(
                        "cached blend indices {} have unexpected types or lengths",
                        entry.path("*").display()
                    ),
                }
            }
            _ => {
                let indices = match (&weights_json, size) {
                    (BlendWeights::Float(w), Some(size)) => build_blending_indices(w, size),
                    (BlendWeights::Count(c), None) => build_exhaustive_blending_indices(c),
                    _ => bail!("a blend with float weights needs a size"),
                };
                check_members_suffice(&datasets, &indices, surplus)?;
                if let Some(entry) = &entry {
                    let dataset_index =
                        NpyArray::vector(IndexArray::I16(indices.dataset_index.clone()));
                    let sample_index =
                        NpyArray::vector(IndexArray::I64(indices.dataset_sample_index.clone()));
                    entry
                        .write(
                            &description,
                            &[
                                ("dataset_index.npy", &dataset_index),
                                ("dataset_sample_index.npy", &sample_index),
                            ],
                        )
                        .with_context(|| format!("caching the {} blend indices", split.name()))?;
                }
                indices
            }
        };
        Ok(BlendedDataset {
            datasets,
            description,
            indices,
        })
    }

    pub fn len(&self) -> usize {
        self.indices.dataset_index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn datasets(&self) -> &[D] {
        &self.datasets
    }

    pub fn indices(&self) -> &BlendingIndices {
        &self.indices
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    /// `(member, member sample)` that blended sample `idx` reads.
    pub fn locate(&self, idx: usize) -> (usize, usize) {
        (
            self.indices.dataset_index[idx] as usize,
            self.indices.dataset_sample_index[idx] as usize,
        )
    }

    /// Blended sample `idx` and the member it came from.
    pub fn get(&self, idx: usize) -> (usize, D::Sample) {
        let (member, sample) = self.locate(idx);
        (member, self.datasets[member].sample(sample))
    }
}

impl BlendedDataset<GptDataset> {
    pub fn sample_text(&self, idx: usize) -> (usize, SampleText) {
        let (member, sample) = self.locate(idx);
        (member, self.datasets[member].sample_text(sample))
    }
}

fn check_members_suffice<D: BlendMember>(
    datasets: &[D],
    indices: &BlendingIndices,
    surplus: f64,
) -> Result<()> {
    for (i, (dataset, drawn)) in datasets
        .iter()
        .zip(indices.counts(datasets.len()))
        .enumerate()
    {
        if (dataset.len() as u64) < drawn {
            bail!(
                "the {} blend oversamples dataset number {i}: it requests {drawn} samples but the \
                 dataset has {}; raise --mid-level-dataset-surplus (now {surplus}), e.g. two- or \
                 ten-fold",
                dataset.split().name(),
                dataset.len()
            );
        }
    }
    Ok(())
}
