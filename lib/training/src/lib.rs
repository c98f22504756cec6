//! Training: the arithmetic of Megatron's loop (LR schedules, batch ramp-up, loss scaling,
//! FLOPs, log lines), the pipeline schedules, the engine that runs any model family through
//! them, and the families themselves (`families`: `pretrain_gpt`, `pretrain_bert`,
//! `pretrain_t5`, finetuning) with their data glue.

pub mod args;
mod async_save;
mod checkpointing;
mod cuda_graphs;
mod datasets;
mod device;
mod engine;
mod expert_bias;
mod export;
pub mod families;
pub mod flops;
mod job;
pub mod log_line;
pub mod loss_scale;
pub mod loss_spikes;
pub mod lr_schedule;
pub mod memory_report;
pub mod metrics;
pub mod microbatches;
mod moe_losses;
mod profiling;
pub mod schedules;
mod stage;
pub mod tasks;

pub use checkpointing::{model_tensors, Progress};
pub use datasets::Masking;
pub use engine::{
    pretrain, train_with_hooks, ExportingHooks, NoHooks, Scorer, TrainingHooks, TrainingSummary,
};
pub use export::CheckpointExport;
pub use families::{
    pretrain_bert, pretrain_gpt, pretrain_gpt_with_hooks, pretrain_t5, t5_flags, t5_split_dataset,
    BertFamily, BertPretrainArgs, FinetuneFamily, GptFamily, GptPretrainArgs, LossTotals,
    ModelFamily, StepOutput, T5DataRequest, T5Family, T5PretrainArgs,
};
pub use job::{join_job, run_job};
pub use profiling::StepProfiler;
