//! What a run trains on, as resolved from the data flags, for its checkpoints' `metadata.json`:
//! each source's prefixes with their normalised weights, and the `--split` with each split's
//! share of the documents.

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::builder::DataSources;
use super::data_path::Blend;
use super::weights::normalize;
use crate::gpt::{Split, SplitMatrix};

/// One dataset prefix and its share of the blend: Megatron's normalised weight, 1 alone, none
/// in an unweighted list (blended in proportion to the datasets' sizes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WeightedPrefix {
    pub prefix: String,
    pub weight: Option<f64>,
}

/// A split's `[begin, end)` as fractions of each dataset's documents.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SplitShare {
    pub split: String,
    pub begin: f64,
    pub end: f64,
}

/// The data a run trains and evaluates on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum TrainedOn {
    /// `--mock-data`: synthetic samples.
    Mock,
    /// `--data-path` (or `--data-args-path`) cut by `--split`.
    Blend {
        data_path: Vec<WeightedPrefix>,
        split: String,
        splits: Vec<SplitShare>,
    },
    /// `--train-data-path`, `--valid-data-path`, `--test-data-path` (or their JSON file).
    PerSplit {
        train_data_path: Option<Vec<WeightedPrefix>>,
        valid_data_path: Option<Vec<WeightedPrefix>>,
        test_data_path: Option<Vec<WeightedPrefix>>,
    },
}

impl TrainedOn {
    /// From the resolved sources and split string, as `DataPathFlags::sources` gives them.
    pub fn of(sources: &DataSources, split: Option<&str>) -> anyhow::Result<TrainedOn> {
        Ok(match sources {
            DataSources::Blend(blend) => {
                let split = split.context("--data-path needs a --split")?;
                let matrix = SplitMatrix::parse(split)?;
                TrainedOn::Blend {
                    data_path: weighted(blend),
                    split: split.to_string(),
                    splits: Split::ALL
                        .into_iter()
                        .filter_map(|s| {
                            matrix.get(s).map(|bookend| SplitShare {
                                split: s.name().to_string(),
                                begin: bookend.begin,
                                end: bookend.end,
                            })
                        })
                        .collect(),
                }
            }
            DataSources::PerSplit([train, valid, test]) => TrainedOn::PerSplit {
                train_data_path: train.as_ref().map(weighted),
                valid_data_path: valid.as_ref().map(weighted),
                test_data_path: test.as_ref().map(weighted),
            },
        })
    }
}

fn weighted(blend: &Blend) -> Vec<WeightedPrefix> {
    let weights: Vec<Option<f64>> = match &blend.weights {
        Some(weights) => normalize(weights).into_iter().map(Some).collect(),
        None if blend.prefixes.len() == 1 => vec![Some(1.0)],
        None => vec![None; blend.prefixes.len()],
    };
    blend
        .prefixes
        .iter()
        .zip(weights)
        .map(|(prefix, weight)| WeightedPrefix {
            prefix: prefix.clone(),
            weight,
        })
        .collect()
}
