//! The encoding pipeline behind `preprocess_data`: loose JSON lines in, one indexed dataset
//! per JSON key out, byte-identical to Megatron's `tools/preprocess_data.py`.
//!
//! Input is read on one thread in bounded batches, each batch is encoded in parallel and
//! written in input order, so memory stays flat however large the input is.

mod document;
mod encode;
mod error;
mod input;
mod output;
mod pipeline;

pub use document::{parse_line, FieldText};
pub use encode::{EncodedField, Encoder};
pub use error::PreprocessError;
use input::open_counted_input;
pub use input::{expand_inputs, input_size, open_input, InputSource};
pub use output::{output_prefix, Level};
pub use pipeline::{preprocess, PreprocessOptions, Progress, Summary};
