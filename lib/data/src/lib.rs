//! The data side of megatron-rs. Nothing here links libtorch: data tools stay light to
//! install and can run on machines without a GPU stack.
pub mod cache;
pub mod random;
pub mod indexed;
pub mod blend;
pub mod gpt;
pub mod openwebtext;
pub mod tokenizer;
pub mod sentence;
pub mod preprocess;
