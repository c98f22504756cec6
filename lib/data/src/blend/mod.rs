//! Blending several datasets by weight: `--data-path` parsing, per-member sample budgets,
//! blending indices, the blended dataset and the per-split builder.

mod budget;
mod builder;
mod data_path;
mod dataset;
mod flags;
mod indices;
mod trained_on;
mod weights;

pub use budget::samples_per_dataset;
pub use builder::{
    build_gpt_datasets, build_split_datasets, BuildMember, BuilderSettings, DataSources,
    OpenSource, SourceCache, SplitDataset,
};
pub use data_path::Blend;
pub use dataset::{BlendMember, BlendWeights, BlendedDataset};
pub use flags::{DataPathFlags, DEFAULT_SPLIT};
pub use indices::{build_blending_indices, build_exhaustive_blending_indices, BlendingIndices};
pub use trained_on::{SplitShare, TrainedOn, WeightedPrefix};
pub use weights::{normalize, numpy_sum};
