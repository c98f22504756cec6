use std::path::{Path, PathBuf};

/// Whether sequences are whole documents or sentences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Document,
    Sentence,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Document => "document",
            Level::Sentence => "sentence",
        }
    }
}

/// Megatron's output naming: `{output_prefix}_{key}_{level}` (then `.bin` / `.idx`).
pub fn output_prefix(output_prefix: &Path, key: &str, level: Level) -> PathBuf {
    let mut s = output_prefix.as_os_str().to_owned();
    s.push(format!("_{key}_{}", level.name()));
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_like_megatron() {
        assert_eq!(
            output_prefix(Path::new("out/my-gpt2"), "text", Level::Document),
            Path::new("out/my-gpt2_text_document")
        );
        assert_eq!(
            output_prefix(Path::new("b"), "title", Level::Sentence),
            Path::new("b_title_sentence")
        );
    }
}
