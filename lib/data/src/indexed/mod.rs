//! Megatron's indexed dataset: a `.bin` file of raw token ids and a `.idx` file ("MMIDIDX",
//! version 1) describing how the tokens split into sequences and documents.
//!
//! The reader maps both files and never copies token data; the writer streams tokens to disk
//! and writes the index on `finalize`, under temporary names until both files are complete.

mod dtype;
mod error;
mod header;
mod merge;
mod reader;
mod token_range;
mod writer;

pub use dtype::{DType, UnknownDType};
pub use error::IndexError;
pub use header::{IndexHeader, HEADER_LEN, MAGIC};
pub use merge::{merge_datasets, prefixes_in_directory};
pub use reader::IndexedDataset;
pub use token_range::{OutOfVocabulary, TokenRange};
pub use writer::{IndexedDatasetBuilder, TokenId};

use std::path::{Path, PathBuf};

/// `prefix + ".idx"`; the prefix is a path without extension, as Megatron's `--data-path` names it.
pub fn idx_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".idx")
}

/// `prefix + ".bin"`.
pub fn bin_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".bin")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

#[cfg(test)]
mod tests;
