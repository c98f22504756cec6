//! T5: the encoder-decoder, one pipeline stage, with cached decoding for generation.

mod batch;
mod config;
mod flags;
mod model;

pub use batch::{MockT5Source, T5Batch};
pub use config::T5Config;
pub use flags::T5Args;
pub use model::{T5DecoderState, T5Input, T5Model};
