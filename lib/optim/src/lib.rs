//! Megatron's mixed-precision optimizer (spec §4.3–4.5): float32 main parameters and gradient
//! accumulators beside the model's (possibly half-precision) parameters, weight-decay groups,
//! global-norm clipping, and Adam/AdamW or SGD steps.

mod buffer;
mod grad_sync;
mod groups;
mod memory;
mod mixed_precision;
mod param_gather;

pub use buffer::{BufferLayout, ParamShape, ShardGroup, Slot};
pub use groups::{excluded_from_weight_decay, is_embedding_or_output, ParamGroup};
pub use memory::StateBytes;
pub use mixed_precision::{
    LearningRates, MixedPrecisionOptimizer, OptimizerKind, OptimizerSettings, StepOutcome,
    DEFAULT_BUCKET_SIZE,
};
