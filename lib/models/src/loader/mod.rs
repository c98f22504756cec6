//! From a model family's datasets to device batches: Megatron's pretraining sampler order
//! (consecutive global batches from the consumed-sample count, each data-parallel rank taking its
//! slice), collation into tensors, and a background thread so the device never waits for data.

mod background;
mod bert_batch;
mod gpt_batch;
mod t5_batch;
mod task_batch;

pub use background::{BatchLoader, DeviceBatch, SampleSource, SamplerPosition, Splits};
pub use bert_batch::{BertBatch, MockBertSource};
pub use gpt_batch::GptBatch;
pub use t5_batch::{MockT5Source, T5Batch};
pub use task_batch::{CycledExamples, EpochOrder, TaskBatch, TaskExample, TaskExamples};
