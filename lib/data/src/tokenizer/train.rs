//! Training a byte-level BPE tokenizer (GPT-2's kind) on loose JSON with the `tokenizers`
//! crate, saved as GPT-2's `vocab.json` + `merges.txt` so that `GPT2BPETokenizer` loads it.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Model, NormalizerWrapper, PostProcessorWrapper, TokenizerBuilder};

use crate::preprocess::{open_input, parse_line, FieldText, InputSource};

/// GPT-2's end-of-document token, which Megatron's GPT-2 tokenizer requires.
pub const END_OF_TEXT: &str = "<|endoftext|>";

#[derive(Debug, Clone)]
pub struct BpeTrainingOptions {
    /// Final vocabulary size: the 256 byte symbols, `<|endoftext|>` and the learned merges.
    pub vocab_size: usize,
    /// Pairs seen fewer times than this are never merged.
    pub min_frequency: u64,
}

/// What training produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainedBpe {
    pub vocab_file: PathBuf,
    pub merge_file: PathBuf,
    pub vocab_size: usize,
    pub documents: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("{source_name}:{line}: {reason}")]
    Input {
        source_name: String,
        line: usize,
        reason: String,
    },
    #[error("{0}")]
    Io(String),
    #[error("training failed: {0}")]
    Training(String),
}

/// Reads the `json_keys` texts of every line of `inputs` (blank lines skipped).
pub fn read_texts(inputs: &[InputSource], json_keys: &[String]) -> Result<Vec<String>, TrainError> {
    let mut texts = Vec::new();
    for source in inputs {
        let reader = open_input(source).map_err(|e| TrainError::Io(e.to_string()))?;
        for (index, line) in reader.lines().enumerate() {
            let at = |reason: String| TrainError::Input {
                source_name: source.name(),
                line: index + 1,
                reason,
            };
            let line = line.map_err(|e| at(e.to_string()))?;
            if line.trim().is_empty() {
                continue;
            }
            for field in parse_line(&line, json_keys).map_err(at)? {
                match field {
                    FieldText::Text(text) => texts.push(text),
                    FieldText::Sentences(sentences) => texts.push(sentences.concat()),
                }
            }
        }
    }
    Ok(texts)
}

/// Trains on `texts` and writes `{prefix}-vocab.json` and `{prefix}-merges.txt`, each under a
/// temporary name first, so an interrupted run leaves no half-written tokenizer.
pub fn train_byte_level_bpe(
    texts: &[String],
    options: &BpeTrainingOptions,
    prefix: &Path,
) -> Result<TrainedBpe, TrainError> {
    let alphabet = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(options.vocab_size)
        .min_frequency(options.min_frequency)
        .initial_alphabet(alphabet)
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build();
    // No prefix space: GPT-2 encodes a text's first word without one.
    let byte_level = ByteLevel::default().add_prefix_space(false);
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        ByteLevel,
        PostProcessorWrapper,
        ByteLevel,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(byte_level))
    .with_decoder(Some(byte_level))
    .build()
    .map_err(|e| TrainError::Training(e.to_string()))?;
    tokenizer
        .train(&mut trainer, texts.iter())
        .map_err(|e| TrainError::Training(e.to_string()))?;

    let directory = prefix
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = prefix
        .file_name()
        .ok_or_else(|| {
            TrainError::Io(format!(
                "--output-prefix {}: no file name",
                prefix.display()
            ))
        })?
        .to_string_lossy()
        .into_owned();
    std::fs::create_dir_all(directory)
        .map_err(|e| TrainError::Io(format!("creating {}: {e}", directory.display())))?;
    let staging = tempfile::tempdir_in(directory)
        .map_err(|e| TrainError::Io(format!("{}: {e}", directory.display())))?;
    let model = tokenizer.get_model();
    model
        .save(staging.path(), Some(&name))
        .map_err(|e| TrainError::Io(format!("saving the tokenizer: {e}")))?;
    let mut finished = Vec::new();
    for suffix in ["vocab.json", "merges.txt"] {
        let file = format!("{name}-{suffix}");
        let target = directory.join(&file);
        std::fs::rename(staging.path().join(&file), &target)
            .map_err(|e| TrainError::Io(format!("renaming into {}: {e}", target.display())))?;
        finished.push(target);
    }
    let merge_file = finished.pop().expect("two files were written");
    let vocab_file = finished.pop().expect("two files were written");
    Ok(TrainedBpe {
        vocab_file,
        merge_file,
        vocab_size: model.get_vocab_size(),
        documents: texts.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{Gpt2Bpe, Tokenizer};

    fn corpus() -> Vec<String> {
        let words = [
            "tensor",
            "parallel",
            "pipeline",
            "checkpoint",
            "gradient",
            "the",
            "of",
            "a",
            "rank",
        ];
        (0..300)
            .map(|i| {
                let mut text = String::new();
                for j in 0..40 {
                    text.push_str(words[(i * 7 + j * 3) % words.len()]);
                    text.push(if j % 11 == 10 { '\n' } else { ' ' });
                }
                text.push_str(&format!("step {i}: loss 3.{i:03} é"));
                text
            })
            .collect()
    }

    #[test]
    fn trained_vocabulary_loads_as_gpt2_and_matches_the_tokenizers_crate() {
        let dir = tempfile::tempdir().unwrap();
        let texts = corpus();
        let options = BpeTrainingOptions {
            vocab_size: 300,
            min_frequency: 2,
        };
        let trained = train_byte_level_bpe(&texts, &options, &dir.path().join("tiny")).unwrap();
        assert_eq!(trained.vocab_size, 300);
        assert_eq!(trained.vocab_file, dir.path().join("tiny-vocab.json"));

        let ours = Gpt2Bpe::from_files(&trained.vocab_file, &trained.merge_file).unwrap();
        assert_eq!(ours.vocab_size(), 300);
        assert_eq!(ours.eod(), Some(0));
        let bpe = BPE::from_file(
            &trained.vocab_file.to_string_lossy(),
            &trained.merge_file.to_string_lossy(),
        )
        .build()
        .unwrap();
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let reference = TokenizerBuilder::<
            BPE,
            NormalizerWrapper,
            ByteLevel,
            PostProcessorWrapper,
            ByteLevel,
        >::new()
        .with_model(bpe)
        .with_pre_tokenizer(Some(byte_level))
        .with_decoder(Some(byte_level))
        .build()
        .unwrap();
        for text in texts
            .iter()
            .take(20)
            .chain(std::iter::once(&"unseen wörds  and\n\n spaces".to_string()))
        {
            let ids = ours.tokenize(text).unwrap();
            assert_eq!(
                ids,
                reference.encode(text.as_str(), false).unwrap().get_ids(),
                "{text:?}"
            );
            assert_eq!(&ours.detokenize(&ids).unwrap(), text);
        }
        // Learned merges compress the training text well below one token per byte.
        let bytes: usize = texts.iter().map(String::len).sum();
        let tokens: usize = texts.iter().map(|t| ours.tokenize(t).unwrap().len()).sum();
        assert!(tokens * 3 < bytes, "{tokens} tokens for {bytes} bytes");
    }

    #[test]
    fn training_is_deterministic() {
        let texts = corpus();
        let options = BpeTrainingOptions {
            vocab_size: 280,
            min_frequency: 2,
        };
        let read = |dir: &Path| {
            let trained = train_byte_level_bpe(&texts, &options, &dir.join("t")).unwrap();
            (
                std::fs::read(trained.vocab_file).unwrap(),
                std::fs::read(trained.merge_file).unwrap(),
            )
        };
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        assert_eq!(read(a.path()), read(b.path()));
    }

    #[test]
    fn bad_lines_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.jsonl");
        std::fs::write(&path, "{\"text\": \"ok\"}\n\n{\"body\": \"no text\"}\n").unwrap();
        let error = read_texts(&[InputSource::File(path.clone())], &["text".into()])
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with(&format!("{}:3:", path.display())),
            "{error}"
        );
        assert!(error.contains("\"text\""), "{error}");
    }
}
