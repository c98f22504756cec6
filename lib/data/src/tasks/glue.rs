//! MNLI and QQP (`tasks/glue`): GLUE's tab-separated files with a header line, turned into
//! `[CLS] a [SEP] b [SEP]` classification inputs.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::tokenizer::Tokenizer;

use super::pair::{PairInput, PairSpecials};
use super::text::{clean_text, is_python_space};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlueTask {
    /// 3 classes: contradiction 0, entailment 1, neutral 2.
    Mnli,
    /// 2 classes: `is_duplicate`.
    Qqp,
}

impl GlueTask {
    pub fn num_classes(self) -> usize {
        match self {
            GlueTask::Mnli => 3,
            GlueTask::Qqp => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GlueTask::Mnli => "MNLI",
            GlueTask::Qqp => "QQP",
        }
    }
}

/// One row: cleaned texts, label and the file's id column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlueRow {
    pub uid: u64,
    pub text_a: String,
    pub text_b: String,
    pub label: usize,
}

/// The rows of one file, and what was skipped (QQP's malformed rows, with Megatron's warning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GlueFile {
    pub rows: Vec<GlueRow>,
    /// A test file (MNLI: 10 columns, QQP: 3): labels are the placeholder class 0.
    pub is_test: bool,
    pub skipped: Vec<String>,
}

/// One classification sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassificationSample {
    pub input: PairInput,
    pub label: usize,
    pub uid: u64,
}

impl ClassificationSample {
    /// Tokenizes a row as Megatron's `GLUEAbstractDataset.__getitem__` does (no 128 cap).
    pub fn build(
        row: &GlueRow,
        tokenizer: &dyn Tokenizer,
        specials: PairSpecials,
        max_seq_length: usize,
    ) -> Result<ClassificationSample> {
        let ids = |text: &str| -> Result<Vec<i64>> {
            Ok(tokenizer
                .tokenize(text)?
                .into_iter()
                .map(i64::from)
                .collect())
        };
        let (a, b) = (ids(&row.text_a)?, ids(&row.text_b)?);
        Ok(ClassificationSample {
            input: PairInput::build(&a, Some(&b), max_seq_length, specials),
            label: row.label,
            uid: row.uid,
        })
    }
}

fn python_strip(s: &str) -> &str {
    s.trim_matches(is_python_space)
}

fn parse_uid(field: &str, at: &str) -> Result<u64> {
    python_strip(field)
        .parse()
        .with_context(|| format!("{at}: id {field:?} is not a non-negative integer"))
}

/// Reads a GLUE `.tsv` of `task` (header line first).
pub fn read_glue_tsv(task: GlueTask, path: &Path) -> Result<GlueFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut lines = text.lines().enumerate();
    let Some((_, header)) = lines.next() else {
        bail!("{}: empty file (expected a header line)", path.display());
    };
    let header: Vec<&str> = python_strip(header).split('\t').collect();
    let is_test = match task {
        GlueTask::Mnli => {
            if header.len() < 10 {
                bail!(
                    "{}: the MNLI header has {} columns, expected at least 10",
                    path.display(),
                    header.len()
                );
            }
            header.len() == 10
        }
        GlueTask::Qqp => match header.len() {
            3 => true,
            6 => false,
            n => bail!(
                "{}: the QQP header has {n} columns, expected 6 (train/dev) or 3 (test)",
                path.display()
            ),
        },
    };
    let mut file = GlueFile {
        rows: Vec::new(),
        is_test,
        skipped: Vec::new(),
    };
    for (index, line) in lines {
        let at = format!("{}:{}", path.display(), index + 1);
        let row: Vec<&str> = python_strip(line).split('\t').collect();
        let clean = |i: usize| clean_text(python_strip(row[i]));
        match task {
            GlueTask::Mnli => {
                if row.len() < 10 {
                    bail!("{at}: {} columns, MNLI rows have at least 10", row.len());
                }
                let (text_a, text_b) = (clean(8), clean(9));
                let label_text = if is_test {
                    "contradiction"
                } else {
                    python_strip(row[row.len() - 1])
                };
                let label = match label_text {
                    "contradiction" => 0,
                    "entailment" => 1,
                    "neutral" => 2,
                    other => {
                        bail!("{at}: label {other:?} is not contradiction, entailment or neutral")
                    }
                };
                if text_a.is_empty() || text_b.is_empty() {
                    bail!("{at}: empty sentence1 or sentence2");
                }
                file.rows.push(GlueRow {
                    uid: parse_uid(row[0], &at)?,
                    text_a,
                    text_b,
                    label,
                });
            }
            GlueTask::Qqp if is_test => {
                if row.len() != 3 {
                    bail!("{at}: {} columns, QQP test rows have 3", row.len());
                }
                let (text_a, text_b) = (clean(1), clean(2));
                if text_a.is_empty() || text_b.is_empty() {
                    bail!("{at}: empty question1 or question2");
                }
                file.rows.push(GlueRow {
                    uid: parse_uid(row[0], &at)?,
                    text_a,
                    text_b,
                    label: 0,
                });
            }
            GlueTask::Qqp => {
                if row.len() != 6 {
                    file.skipped.push(format!(
                        "{at}: index error ({} columns), skipping",
                        row.len()
                    ));
                    continue;
                }
                let uid = parse_uid(row[0], &at)?;
                let (text_a, text_b) = (clean(3), clean(4));
                let label = match python_strip(row[5]) {
                    "0" => 0,
                    "1" => 1,
                    other => bail!("{at}: is_duplicate {other:?} is not 0 or 1"),
                };
                if text_a.is_empty() {
                    file.skipped.push(format!("{at}: zero length a, skipping"));
                    continue;
                }
                if text_b.is_empty() {
                    file.skipped.push(format!("{at}: zero length b, skipping"));
                    continue;
                }
                file.rows.push(GlueRow {
                    uid,
                    text_a,
                    text_b,
                    label,
                });
            }
        }
    }
    Ok(file)
}
