//! Inference: loading a trained GPT from its checkpoint alone, and sampling continuations.

mod load;
mod sampling;

pub use load::load_gpt_for_inference;
pub use sampling::{generate, Sampling};
