//! From a model family's datasets to device batches: Megatron's pretraining sampler order
//! (consecutive global batches from the consumed-sample count, each data-parallel rank taking its
//! slice) and a background thread so the device never waits for data. Each family's batch (its
//! collation into tensors) lives in the family's folder.

mod background;
mod split_mix;

pub use background::{BatchLoader, DeviceBatch, SampleSource, SamplerPosition, Splits};
pub(crate) use split_mix::SplitMix;
