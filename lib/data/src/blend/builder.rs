//! Megatron's `BlendedMegatronDatasetBuilder` for GPT: from `--data-path`/`--split` (or
//! per-split paths) and requested sizes to one dataset per split.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::gpt::{
    GptDataset, GptDatasetConfig, GptSample, SampleText, Split, SplitMatrix, TokenSource,
};

use super::budget::samples_per_dataset;
use super::data_path::Blend;
use super::dataset::{BlendWeights, BlendedDataset};
use super::weights::normalize;

/// Where the data of each split comes from.
#[derive(Debug, Clone)]
pub enum DataSources {
    /// `--data-path` cut by the config's split matrix.
    Blend(Blend),
    /// `--train-data-path` / `--valid-data-path` / `--test-data-path`.
    PerSplit([Option<Blend>; 3]),
}

/// A split's dataset: a single GPT dataset or a blend of several.
pub enum SplitDataset {
    Single(GptDataset),
    Blended(BlendedDataset),
}

impl SplitDataset {
    pub fn len(&self) -> usize {
        match self {
            SplitDataset::Single(d) => d.len(),
            SplitDataset::Blended(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

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

    pub fn get(&self, idx: usize) -> (Option<usize>, GptSample) {
        match self {
            SplitDataset::Single(d) => (None, d.get(Some(idx))),
            SplitDataset::Blended(b) => {
                let (member, sample) = b.get(idx);
                (Some(member), sample)
            }
        }
    }
}

/// Opens a dataset prefix (an indexed dataset on disk, in production).
pub type OpenSource<'a> = dyn Fn(&str) -> Result<Arc<dyn TokenSource>> + 'a;

/// Builds the train/valid/test datasets. `sizes[i] = None` means one epoch of that split.
pub fn build_gpt_datasets(
    sources: &DataSources,
    sizes: [Option<u64>; 3],
    config: Arc<GptDatasetConfig>,
    open: &OpenSource,
) -> Result<[Option<SplitDataset>; 3]> {
    let mut opener = CachedOpener {
        open,
        opened: HashMap::new(),
    };
    let mut out: [Option<SplitDataset>; 3] = [None, None, None];
    match sources {
        DataSources::Blend(blend) => {
            let matrix = config
                .split_matrix
                .clone()
                .context("--data-path needs a --split")?;
            for split in Split::ALL {
                if matrix.get(split).is_some() {
                    out[split.index()] = Some(build_split(
                        blend,
                        split,
                        &matrix,
                        sizes,
                        false,
                        &config,
                        &mut opener,
                    )?);
                }
            }
        }
        DataSources::PerSplit(blends) => {
            for split in Split::ALL {
                if let Some(blend) = &blends[split.index()] {
                    let matrix = SplitMatrix::only(split);
                    out[split.index()] = Some(build_split(
                        blend,
                        split,
                        &matrix,
                        sizes,
                        true,
                        &config,
                        &mut opener,
                    )?);
                }
            }
        }
    }
    Ok(out)
}

struct CachedOpener<'a, 'b> {
    open: &'a OpenSource<'b>,
    opened: HashMap<String, Arc<dyn TokenSource>>,
}

impl CachedOpener<'_, '_> {
    fn get(&mut self, prefix: &str) -> Result<Arc<dyn TokenSource>> {
        if let Some(source) = self.opened.get(prefix) {
            return Ok(source.clone());
        }
        let source = (self.open)(prefix).with_context(|| format!("opening dataset {prefix}"))?;
        self.opened.insert(prefix.to_string(), source.clone());
        Ok(source)
    }
}

fn build_split(
    blend: &Blend,
    split: Split,
    matrix: &SplitMatrix,
    sizes: [Option<u64>; 3],
    per_split: bool,
    config: &Arc<GptDatasetConfig>,
    opener: &mut CachedOpener,
) -> Result<SplitDataset> {
    let size = sizes[split.index()];
    let bookend = matrix.get(split).expect("caller checked the split exists");
    let mut member = |prefix: &str, num_samples: Option<u64>| -> Result<GptDataset> {
        let source = opener.get(prefix)?;
        let documents = bookend.range(source.sequence_lengths().len());
        GptDataset::new(
            source,
            Some(prefix),
            documents,
            num_samples,
            split,
            config.clone(),
        )
        .with_context(|| format!("building the {} split of {prefix}", split.name()))
    };

    let single = blend.prefixes.len() == 1 && (per_split || blend.weights.is_none());
    if single {
        return Ok(SplitDataset::Single(member(&blend.prefixes[0], size)?));
    }

    let cache_dir = config.path_to_cache.as_deref();
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
            let budgets = samples_per_dataset(&weights, target, config.mid_level_dataset_surplus);
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
                config.mid_level_dataset_surplus,
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
                config.mid_level_dataset_surplus,
            )?
        }
    };
    Ok(SplitDataset::Blended(blended))
}
