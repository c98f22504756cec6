//! Training: the arithmetic of Megatron's loop (LR schedules, batch ramp-up, loss scaling,
//! FLOPs, log lines), the pipeline schedules, and `pretrain_gpt` itself with its data,
//! checkpoint and device glue.

mod checkpointing;
mod datasets;
mod device;
pub mod flops;
pub mod log_line;
pub mod loss_scale;
pub mod loss_spikes;
pub mod lr_schedule;
pub mod microbatches;
mod pretrain_gpt;
pub mod python_format;
mod runtime;
pub mod schedules;
mod stage;

pub use checkpointing::{model_tensors, Progress};
pub use device::resolve_device;
pub use pretrain_gpt::{pretrain_gpt, TrainingSummary};
pub use runtime::{join_job, Runtime};
