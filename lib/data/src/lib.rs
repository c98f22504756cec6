//! The data side of megatron-rs. Nothing here links libtorch: data tools stay light to
//! install and can run on machines without a GPU stack.
pub mod blend;
pub mod cache;
pub mod flags;
pub mod gpt;
pub mod indexed;
pub mod masked;
pub mod openwebtext;
pub mod preprocess;
pub mod random;
pub mod sentence;
pub mod sft;
pub mod tasks;
pub mod tokenizer;
