use crate::indexed::IndexError;
use crate::tokenizer::TokenizerError;

/// Why preprocessing stopped.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    #[error("{source_name}:{line}: {reason}")]
    BadLine {
        source_name: String,
        line: u64,
        reason: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}
