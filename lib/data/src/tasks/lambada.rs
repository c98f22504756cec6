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

/// Which formulation of the task a dataset holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LambadaFormulation {
    /// Megatron's default: the last BPE token.
    MegatronNonStrict,
    /// Megatron's `--strict-lambada`: the whole last word.
    MegatronStrict,
    /// lm-evaluation-harness's `lambada_openai`: context `" ".join(text.split(" ")[:-1])`,
    /// continuation `" " + text.split(" ")[-1]`, split as lm-eval's causal `_encode_pair` does.
    LmEval,
}

impl LambadaPassage {
    /// lm-evaluation-harness's `lambada_openai` request for `text`, tokenized as its causal
    /// models do: trailing spaces of the context move to the continuation, the whole text is
    /// tokenized and the continuation is what follows the context's tokens; an empty context
    /// becomes the end-of-text token.
    pub fn lm_eval(text: &str, tokenizer: &dyn Tokenizer, eod: u32) -> Result<Self> {
        let words: Vec<&str> = text.split(' ').collect();
        let (last, rest) = words.split_last().expect("split yields at least one piece");
        let mut context = rest.join(" ");
        let mut continuation = format!(" {last}");
        if context.is_empty() {
            let target = tokenizer.tokenize(&continuation)?;
            ensure!(!target.is_empty(), "the text has no tokens");
            return Ok(if target[0] != eod {
                LambadaPassage {
                    context: vec![eod],
                    target,
                }
            } else {
                LambadaPassage {
                    context: target[..1].to_vec(),
                    target: target[1..].to_vec(),
                }
            });
        }
        let kept = context.trim_end_matches(super::is_python_space).len();
        if kept < context.len() {
            continuation = format!("{}{continuation}", &context[kept..]);
            context.truncate(kept);
        }
        let whole = tokenizer.tokenize(&format!("{context}{continuation}"))?;
        let context = tokenizer.tokenize(&context)?;
        let target = whole.get(context.len()..).unwrap_or_default().to_vec();
        Ok(LambadaPassage { context, target })
    }

    pub fn with_formulation(
        text: &str,
        tokenizer: &dyn Tokenizer,
        formulation: LambadaFormulation,
        eod: u32,
    ) -> Result<Self> {
        match formulation {
            LambadaFormulation::MegatronNonStrict => Self::new(text, tokenizer, false),
            LambadaFormulation::MegatronStrict => Self::new(text, tokenizer, true),
            LambadaFormulation::LmEval => Self::lm_eval(text, tokenizer, eod),
        }
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
        let formulation = if strict {
            LambadaFormulation::MegatronStrict
        } else {
            LambadaFormulation::MegatronNonStrict
        };
        Self::load_formulation(path, tokenizer, seq_length, formulation)
    }

    /// As [`load`](Self::load), in any formulation.
    pub fn load_formulation(
        path: &Path,
        tokenizer: &dyn Tokenizer,
        seq_length: usize,
        formulation: LambadaFormulation,
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
            let passage = LambadaPassage::with_formulation(text, tokenizer, formulation, pad)
                .with_context(at)?;
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
