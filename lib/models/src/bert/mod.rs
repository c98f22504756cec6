//! BERT: the bidirectional encoder with its masked-LM and sentence-order heads, or a finetuning
//! head (`eval_tasks`) in their place.

mod batch;
mod config;
mod flags;
pub mod hf;
mod model;
mod task_batch;

pub use batch::{BertBatch, MockBertSource};
pub use config::{BertConfig, TaskHead};
pub use flags::BertArgs;
pub use model::{BertChunkOutput, BertInput, BertModel, BertOutput};
pub use task_batch::{CycledExamples, EpochOrder, TaskBatch, TaskExample, TaskExamples};
