use std::path::PathBuf;

/// Why an indexed dataset could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a Megatron index file: {reason}")]
    Foreign { path: PathBuf, reason: String },
    #[error("{path}: unsupported index version {version} (only version 1 exists)")]
    Version { path: PathBuf, version: u64 },
    #[error("{path}: corrupt index: {reason}")]
    Corrupt { path: PathBuf, reason: String },
    #[error("{path}: size mismatch: {reason}")]
    Size { path: PathBuf, reason: String },
    #[error("token id {value} does not fit the dataset dtype {dtype}")]
    TokenOutOfRange { value: i64, dtype: super::DType },
    #[error("{path}: {found} is not below the tokenizer's vocabulary of {vocab_size}: the data was tokenized with another tokenizer, or the file is corrupt")]
    OutOfVocabulary {
        path: PathBuf,
        vocab_size: usize,
        found: String,
    },
    #[error("cannot append {other}: its dtype {found} differs from {expected}")]
    DTypeMismatch {
        other: PathBuf,
        expected: super::DType,
        found: super::DType,
    },
    #[error("{0}")]
    Usage(String),
}

impl IndexError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        IndexError::Io {
            path: path.into(),
            source,
        }
    }
}
