//! LAMBADA (spec §7.2): predict a passage's last word from the rest of it.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::python_text::{python_split_whitespace, python_strip};
use super::window::TaskSample;
use crate::tokenizer::Tokenizer;

/// One passage: the context the model reads and the target tokens it must predict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LambadaPassage {
    pub context: Vec<u32>,
    pub target: Vec<u32>,
}

impl LambadaPassage {
    /// Megatron's two formulations. Non-strict: the target is the last BPE token of the whole
    /// text (possibly a fragment of the last word). Strict: the target is the tokenization of
    /// `' ' + last word` (whitespace-split), the context that of the text before it, stripped.
    pub fn new(text: &str, tokenizer: &dyn Tokenizer, strict: bool) -> Result<Self> {
        if !strict {
            let mut context = tokenizer.tokenize(text)?;
            let Some(last) = context.pop() else {
                bail!("the text has no tokens");
            };
            return Ok(LambadaPassage {
                context,
                target: vec![last],
            });
        }
        let Some(last_word) = python_split_whitespace(text).next_back() else {
            bail!("the text has no words");
        };
        let start = text
            .rfind(last_word)
            .expect("the last word is a substring of its text");
        Ok(LambadaPassage {
            context: tokenizer.tokenize(python_strip(&text[..start]))?,
            target: tokenizer.tokenize(&format!(" {last_word}"))?,
        })
    }
}

/// Megatron's `_LambadaDataset`: one passage per JSON line (key `text`).
#[derive(Debug, Clone)]
pub struct LambadaDataset {
    pub passages: Vec<LambadaPassage>,
    pub seq_length: usize,
    pub pad: u32,
}

impl LambadaDataset {
    /// Reads `path` (JSON lines with a `text` key; blank lines are skipped) and tokenizes
    /// every passage. A passage longer than `seq_length + 1` tokens is an error (Megatron does
    /// not truncate).
    pub fn load(
        path: &Path,
        tokenizer: &dyn Tokenizer,
        seq_length: usize,
        strict: bool,
    ) -> Result<Self> {
        let text = super::read_task_file(path)?;
        let pad = tokenizer
            .eod()
            .context("LAMBADA pads with the end-of-document token; this tokenizer has none")?;
        let mut passages = Vec::new();
        for (number, line) in text.lines().enumerate() {
            if python_strip(line).is_empty() {
                continue;
            }
            let at = || format!("{}:{}", path.display(), number + 1);
            let value: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}: not a JSON object", at()))?;
            let Some(text) = value.get("text").and_then(|t| t.as_str()) else {
                bail!("{}: no string field \"text\"", at());
            };
            let passage = LambadaPassage::new(text, tokenizer, strict).with_context(at)?;
            let length = passage.context.len() + passage.target.len();
            ensure!(
                length <= seq_length + 1,
                "{}: the passage has {length} tokens, more than --seq-length {seq_length} + 1",
                at()
            );
            passages.push(passage);
        }
        ensure!(!passages.is_empty(), "{}: no passages", path.display());
        Ok(LambadaDataset {
            passages,
            seq_length,
            pad,
        })
    }

    pub fn len(&self) -> usize {
        self.passages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.passages.is_empty()
    }

    /// Context then target, EOD-padded; exactly the target labels are scored.
    pub fn sample(&self, index: usize) -> TaskSample {
        let passage = &self.passages[index];
        let mut tokens = passage.context.clone();
        tokens.extend_from_slice(&passage.target);
        let mut scored = vec![0u8; passage.context.len()];
        scored.resize(tokens.len(), 1);
        TaskSample::padded(tokens, scored, self.seq_length, self.pad)
    }
}
