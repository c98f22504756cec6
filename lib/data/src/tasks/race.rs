//! RACE (`tasks/race/data.py`): every `*.txt` of a directory such as `RACE/train/middle` holds
//! JSON lines `{"article", "questions", "options", "answers"}`; each question becomes one
//! sample of four `[CLS] question+option [SEP] article [SEP]` inputs.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::tokenizer::Tokenizer;

use super::pair::{PairInput, PairSpecials};
use super::text::clean_text;

pub const NUM_CHOICES: usize = 4;
/// Question+option tokens kept at most.
pub const MAX_QA_LENGTH: usize = 128;

/// One question: an input per option, the index of the right one, and its number within the
/// directory (Megatron's `uid`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaceSample {
    pub choices: Vec<PairInput>,
    pub label: usize,
    pub uid: u64,
}

#[derive(Deserialize)]
struct RaceDocument {
    article: String,
    questions: Vec<String>,
    options: Vec<Vec<String>>,
    answers: Vec<String>,
}

/// The samples of one RACE directory, files in name order (Megatron takes `glob`'s order).
pub fn read_race_dir(
    dir: &Path,
    tokenizer: &dyn Tokenizer,
    specials: PairSpecials,
    max_seq_length: usize,
) -> Result<Vec<RaceSample>> {
    let pattern = dir.join("*.txt");
    let mut files: Vec<PathBuf> = glob::glob(&pattern.to_string_lossy())
        .with_context(|| format!("listing {}", pattern.display()))?
        .collect::<std::result::Result<_, _>>()
        .with_context(|| format!("listing {}", pattern.display()))?;
    files.sort();
    if files.is_empty() {
        bail!(
            "{}: no *.txt files (expected a RACE directory such as RACE/train/middle)",
            dir.display()
        );
    }
    let tokenize = |text: &str| -> Result<Vec<i64>> {
        Ok(tokenizer
            .tokenize(text)?
            .into_iter()
            .map(i64::from)
            .collect())
    };
    let mut samples = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        for (line_number, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let at = || format!("{}:{}", file.display(), line_number + 1);
            let document: RaceDocument = serde_json::from_str(line).with_context(at)?;
            let questions = document.questions.len();
            if document.answers.len() != questions || document.options.len() != questions {
                bail!(
                    "{}: {questions} questions but {} answers and {} option lists",
                    at(),
                    document.answers.len(),
                    document.options.len()
                );
            }
            let article = tokenize(&clean_text(&document.article)).with_context(at)?;
            for ((question, options), answer) in document
                .questions
                .iter()
                .zip(&document.options)
                .zip(&document.answers)
            {
                let label = match answer.as_str() {
                    "A" => 0,
                    "B" => 1,
                    "C" => 2,
                    "D" => 3,
                    other => bail!("{}: answer {other:?} is not one of A, B, C, D", at()),
                };
                if options.len() != NUM_CHOICES {
                    bail!(
                        "{}: a question has {} options, RACE has {NUM_CHOICES}",
                        at(),
                        options.len()
                    );
                }
                let mut choices = Vec::with_capacity(NUM_CHOICES);
                for option in options {
                    let qa = if question.contains('_') {
                        question.replace('_', option)
                    } else {
                        format!("{question} {option}")
                    };
                    let mut qa_ids = tokenize(&clean_text(&qa)).with_context(at)?;
                    qa_ids.truncate(MAX_QA_LENGTH);
                    choices.push(PairInput::build(
                        &qa_ids,
                        Some(&article),
                        max_seq_length,
                        specials,
                    ));
                }
                samples.push(RaceSample {
                    choices,
                    label,
                    uid: samples.len() as u64,
                });
            }
        }
    }
    Ok(samples)
}
