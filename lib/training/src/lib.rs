//! Training: the arithmetic of Megatron's loop (LR schedules, batch ramp-up, loss scaling,
//! FLOPs, log lines), the pipeline schedules, the engine that runs any model family through
//! them, and the families themselves (`pretrain_gpt`, `pretrain_bert`) with their data glue.

pub mod args;
mod bert;
mod checkpointing;
mod cuda_graphs;
mod datasets;
mod device;
mod engine;
pub mod family;
mod finetune;
pub mod flops;
mod gpt;
mod job;
pub mod log_line;
pub mod loss_scale;
pub mod loss_spikes;
pub mod lr_schedule;
pub mod metrics;
pub mod microbatches;
mod profiling;
pub mod schedules;
mod stage;
mod t5;
pub mod tasks;

pub use bert::{pretrain_bert, BertFamily};
pub use checkpointing::{model_tensors, Progress};
pub use datasets::Masking;
pub use engine::{pretrain, train_with_hooks, NoHooks, Scorer, TrainingHooks, TrainingSummary};
pub use family::{LossTotals, ModelFamily, StepOutput};
pub use finetune::FinetuneFamily;
pub use gpt::{pretrain_gpt, GptFamily};
pub use job::{join_job, run_job};
pub use profiling::StepProfiler;
pub use t5::{pretrain_t5, t5_split_dataset, T5DataRequest, T5Family};
