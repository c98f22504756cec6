//! The model families on the training engine, one file each: the family's pretraining flags, its
//! [`ModelFamily`] (chunks, batches, loss, datasets) and its pretraining entry point. What a
//! family's model is (config, layers, batch, its own flags) is in its folder of
//! `megatron-models`; lib/models/README.md says how to add a family.

mod bert;
mod family;
mod finetune;
mod gpt;
mod t5;

pub use bert::{pretrain_bert, BertFamily, BertPretrainArgs};
pub use family::{LossTotals, ModelFamily, ReducedLosses, StepOutput};
pub use finetune::FinetuneFamily;
pub use gpt::{pretrain_gpt, pretrain_gpt_with_hooks, GptFamily, GptPretrainArgs};
pub use t5::{pretrain_t5, t5_flags, t5_split_dataset, T5DataRequest, T5Family, T5PretrainArgs};
