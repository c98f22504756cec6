//! Megatron's `BlendedMegatronDatasetBuilder`: from `--data-path`/`--split` (or per-split
//! paths) and requested sizes to one dataset per split, for any mid-level dataset type.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::gpt::{
    Bookend, GptDataset, GptDatasetConfig, SampleText, Split, SplitMatrix, TokenSource,
};

use super::budget::samples_per_dataset;
use super::data_path::Blend;
use super::dataset::{BlendMember, BlendWeights, BlendedDataset};
use super::weights::normalize;

/// Where the data of each split comes from.
#[derive(Debug, Clone)]
pub enum DataSources {
    /// `--data-path` cut by the config's split matrix.
    Blend(Blend),
    /// `--train-data-path` / `--valid-data-path` / `--test-data-path`.
    PerSplit([Option<Blend>; 3]),
}

/// A split's dataset: a single mid-level dataset or a blend of several.
pub enum SplitDataset<D: BlendMember = GptDataset> {
    Single(D),
    Blended(BlendedDataset<D>),
}

impl<D: BlendMember> SplitDataset<D> {
    pub fn len(&self) -> usize {
        match self {
            SplitDataset::Single(d) => d.len(),
            SplitDataset::Blended(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `idx`, with the blend member it came from when blended.
    pub fn get(&self, idx: usize) -> (Option<usize>, D::Sample) {
        match self {
            SplitDataset::Single(d) => (None, d.sample(idx)),
            SplitDataset::Blended(b) => {
                let (member, sample) = b.get(idx);
                (Some(member), sample)
            }
        }
    }
}

impl SplitDataset<GptDataset> {
    /// Raw tokens of sample `idx`, with the blend member it came from when blended.
    pub fn sample_text(&self, idx: usize) -> (Option<usize>, SampleText) {
        match self {
            SplitDataset::Single(d) => (None, d.sample_text(idx)),
            SplitDataset::Blended(b) => {
                let (member, text) = b.sample_text(idx);
                (Some(member), text)
            }
        }
    }
}

/// Opens a dataset prefix (an indexed dataset on disk, in production).
pub type OpenSource<'a> = dyn Fn(&str) -> Result<Arc<dyn TokenSource>> + 'a;

/// Opens each prefix once, however many splits and blends name it.
pub struct SourceCache<'a, T: ?Sized> {
    open: &'a (dyn Fn(&str) -> Result<Arc<T>> + 'a),
    opened: HashMap<String, Arc<T>>,
}

impl<'a, T: ?Sized> SourceCache<'a, T> {
    pub fn new(open: &'a (dyn Fn(&str) -> Result<Arc<T>> + 'a)) -> Self {
        SourceCache {
            open,
            opened: HashMap::new(),
        }
    }

    pub fn get(&mut self, prefix: &str) -> Result<Arc<T>> {
        if let Some(source) = self.opened.get(prefix) {
            return Ok(source.clone());
        }
        let source = (self.open)(prefix).with_context(|| format!("opening dataset {prefix}"))?;
        self.opened.insert(prefix.to_string(), source.clone());
        Ok(source)
    }
}

/// The config fields the builder itself reads.
#[derive(Debug, Clone, Copy)]
pub struct BuilderSettings<'a> {
    /// The parsed `--split` (required with `DataSources::Blend`).
    pub split_matrix: Option<&'a SplitMatrix>,
    /// `--data-cache-path`: blends are cached only there.
    pub path_to_cache: Option<&'a Path>,
    pub mid_level_dataset_surplus: f64,
}

/// Builds one member: `(prefix, split, bookend of its low-level dataset, requested samples)`.
pub type BuildMember<'a, D> = dyn FnMut(&str, Split, Bookend, Option<u64>) -> Result<D> + 'a;

/// Builds the train/valid/test datasets. `sizes[i] = None` means one epoch of that split.
pub fn build_split_datasets<D: BlendMember>(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    settings: BuilderSettings,
    build_member: &mut BuildMember<D>,
) -> Result<[Option<SplitDataset<D>>; 3]> {
    let mut out: [Option<SplitDataset<D>>; 3] = [None, None, None];
    match sources {
        DataSources::Blend(blend) => {
            let matrix = settings
                .split_matrix
                .context("--data-path needs a --split")?;
            for split in Split::ALL {
                if let Some(bookend) = matrix.get(split) {
                    out[split.index()] = Some(build_split(
                        blend,
                        split,
                        bookend,
                        sizes,
                        false,
                        settings,
                        build_member,
                    )?);
                }
            }
        }
        DataSources::PerSplit(blends) => {
            for split in Split::ALL {
                if let Some(blend) = &blends[split.index()] {
                    out[split.index()] = Some(build_split(
                        blend,
                        split,
                        Bookend::whole(),
                        sizes,
                        true,
                        settings,
                        build_member,
                    )?);
                }
            }
        }
    }
    Ok(out)
}

/// [`build_split_datasets`] for GPT: members split by sequence.
pub fn build_gpt_datasets(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    config: Arc<GptDatasetConfig>,
    open: &OpenSource,
) -> Result<[Option<SplitDataset>; 3]> {
    let mut opened = SourceCache::new(open);
    let settings = BuilderSettings {
        split_matrix: config.split_matrix.as_ref(),
        path_to_cache: config.path_to_cache.as_deref(),
        mid_level_dataset_surplus: config.mid_level_dataset_surplus,
    };
    let mut member = |prefix: &str, split: Split, bookend: Bookend, num_samples| {
        let source = opened.get(prefix)?;
        let documents = bookend.range(source.sequence_lengths().len());
        GptDataset::new(
            source,
            Some(prefix),
            documents,
            num_samples,
            split,
            config.clone(),
        )
    };
    build_split_datasets(sources, sizes, settings, &mut member)
}

fn build_split<D: BlendMember>(
    blend: &Blend,
    split: Split,
    bookend: Bookend,
    sizes: [Option<u64>; 3],
    per_split: bool,
    settings: BuilderSettings,
    build_member: &mut BuildMember<D>,
) -> Result<SplitDataset<D>> {
    let size = sizes[split.index()];
    let mut member = |prefix: &str, num_samples: Option<u64>| -> Result<D> {
        build_member(prefix, split, bookend, num_samples)
            .with_context(|| format!("building the {} split of {prefix}", split.name()))
    };

    let single = blend.prefixes.len() == 1 && (per_split || blend.weights.is_none());
    if single {
        return Ok(SplitDataset::Single(member(&blend.prefixes[0], size)?));
    }

    let cache_dir = settings.path_to_cache;
    let surplus = settings.mid_level_dataset_surplus;
    let blended = match &blend.weights {
        Some(weights) => {
            let Some(target) = size else {
                bail!(
                    "the {} split has weighted data paths but no requested sample count",
                    split.name()
                );
            };
            let weights = normalize(weights);
            let targets = samples_per_dataset(&weights, target, 0.0);
            let budgets = samples_per_dataset(&weights, target, surplus);
            let members = blend
                .prefixes
                .iter()
                .zip(&budgets)
                .map(|(prefix, &budget)| member(prefix, Some(budget)))
                .collect::<Result<Vec<_>>>()?;
            let blend_size = targets.iter().sum::<u64>() as usize;
            BlendedDataset::new(
                members,
                BlendWeights::Float(weights),
                Some(blend_size),
                cache_dir,
                surplus,
            )?
        }
        None => {
            let members = blend
                .prefixes
                .iter()
                .map(|prefix| member(prefix, None))
                .collect::<Result<Vec<_>>>()?;
            let lengths: Vec<u64> = members.iter().map(|m| m.len() as u64).collect();
            let blend_size = size.map(|s| s.min(lengths.iter().sum()) as usize);
            BlendedDataset::new(
                members,
                BlendWeights::Count(lengths),
                blend_size,
                cache_dir,
                surplus,
            )?
        }
    };
    Ok(SplitDataset::Blended(blended))
}
