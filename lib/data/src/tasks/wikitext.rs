//! WikiText-103 perplexity data (spec §7.3): the raw word-level file, detokenized with
//! Megatron's rules (quirks included), tokenized into one stream and cut into overlapping
//! windows that score every target exactly once.

use std::path::Path;
use std::sync::LazyLock;

use anyhow::{ensure, Result};
use regex::Regex;

use super::window::TaskSample;
use crate::tokenizer::Tokenizer;

/// Megatron's detokenizers, chosen by a substring of the data path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detokenizer {
    Ptb,
    Wikitext,
    /// The identity.
    Lambada,
}

impl Detokenizer {
    pub fn apply(self, text: &str) -> String {
        match self {
            Detokenizer::Ptb => ptb_detokenize(text),
            Detokenizer::Wikitext => wikitext_detokenize(text),
            Detokenizer::Lambada => text.to_string(),
        }
    }
}

/// Megatron's `get_detokenizer`: the first of `ptb`, `wiki`, `lambada` the path contains.
pub fn detokenizer_for_path(path: &str) -> Option<Detokenizer> {
    [
        ("ptb", Detokenizer::Ptb),
        ("wiki", Detokenizer::Wikitext),
        ("lambada", Detokenizer::Lambada),
    ]
    .into_iter()
    .find(|(key, _)| path.contains(key))
    .map(|(_, detokenizer)| detokenizer)
}

fn ptb_detokenize(text: &str) -> String {
    [
        (" '", "'"),
        (" \n", "\n"),
        ("\n ", "\n"),
        (" n't", "n't"),
        (" N ", "1 "),
        ("$ 1", "$1"),
        ("# 1", "#1"),
    ]
    .iter()
    .fold(text.to_string(), |s, (from, to)| s.replace(from, to))
}

/// A regex over Python's whitespace (`\s` in a `str` pattern also matches U+001C–U+001F).
fn python_regex(pattern: &str) -> Regex {
    Regex::new(&pattern.replace(r"\s", r"[\s\x1C-\x1F]")).expect("static pattern is valid")
}

/// Spaces just inside `( )`, `[ ]`, `{ }`, `" "` and `' '` pairs (non-greedy, no nesting).
static PAIRS: LazyLock<[Regex; 5]> = LazyLock::new(|| {
    [
        python_regex(r"\(\s*([^)]*?)\s*\)"),
        python_regex(r"\[\s*([^\]]*?)\s*\]"),
        python_regex(r"\{\s*([^}]*?)\s*\}"),
        python_regex(r#""\s*([^"]*?)\s*""#),
        python_regex(r"'\s*([^']*?)\s*'"),
    ]
});
static PAIR_REPLACEMENTS: [&str; 5] = ["(${1})", "[${1}]", "{${1}}", "\"${1}\"", "'${1}'"];

/// Megatron's buggy "digit after a quote" rule: it only ever matches the literal text
/// `/' <digit>/` and replaces it with the literal `/'[0-9]/`.
static SLASH_QUOTE_DIGIT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"/' [0-9]/").expect("static pattern is valid"));

/// Megatron's `wikitext_detokenizer`, rule for rule and in its order.
pub fn wikitext_detokenize(text: &str) -> String {
    let mut s = text.replace("s '", "s'");
    s = SLASH_QUOTE_DIGIT
        .replace_all(&s, regex::NoExpand("/'[0-9]/"))
        .into_owned();
    for (from, to) in [
        (" @-@ ", "-"),
        (" @,@ ", ","),
        (" @.@ ", "."),
        (" : ", ": "),
        (" ; ", "; "),
        (" . ", ". "),
        (" ! ", "! "),
        (" ? ", "? "),
        (" , ", ", "),
    ] {
        s = s.replace(from, to);
    }
    for (pattern, replacement) in PAIRS.iter().zip(PAIR_REPLACEMENTS) {
        s = pattern.replace_all(&s, replacement).into_owned();
    }
    for (from, to) in [
        ("= = = =", "===="),
        ("= = =", "==="),
        ("= =", "=="),
        (" \u{b0} ", "\u{b0}"),
        (" \n", "\n"),
        ("\n ", "\n"),
        (" N ", " 1 "),
        (" 's", "'s"),
    ] {
        s = s.replace(from, to);
    }
    s
}

/// A WikiText file as Megatron's `_build_wikitext103_dataset` reads it.
#[derive(Debug, Clone)]
pub struct WikitextData {
    /// `len(raw.strip().split(" "))`: whitespace tokens of the raw file, counted before
    /// detokenizing (the denominator of the adjusted perplexity).
    pub num_original_tokens: usize,
    pub detokenized: String,
    pub tokens: Vec<u32>,
}

impl WikitextData {
    pub fn load(path: &Path, tokenizer: &dyn Tokenizer, detokenizer: Detokenizer) -> Result<Self> {
        let raw = super::read_task_file(path)?;
        Self::from_text(&raw, tokenizer, detokenizer)
            .map_err(|e| e.context(path.display().to_string()))
    }

    pub fn from_text(
        raw: &str,
        tokenizer: &dyn Tokenizer,
        detokenizer: Detokenizer,
    ) -> Result<Self> {
        let num_original_tokens = super::python_strip(raw).split(' ').count();
        let detokenized = detokenizer.apply(raw);
        let tokens = tokenizer.tokenize(&detokenized)?;
        ensure!(
            num_original_tokens >= 2 && tokens.len() >= 2,
            "too short to evaluate ({num_original_tokens} words, {} tokens; at least 2 of each are needed)",
            tokens.len()
        );
        Ok(WikitextData {
            num_original_tokens,
            detokenized,
            tokens,
        })
    }
}

/// Megatron's `_LMDataset`: windows of `seq_length + 1` tokens every `overlapping_eval`
/// tokens; the first scores all its targets, each later one only its last `overlapping_eval`.
#[derive(Debug, Clone)]
pub struct LmDataset {
    pub tokens: Vec<u32>,
    pub seq_length: usize,
    pub pad: u32,
    /// The stride (at least 1; `seq_length` when not overlapping).
    pub overlapping_eval: usize,
    pub num_original_tokens: usize,
    pub num_tokenized_tokens: usize,
}

impl LmDataset {
    /// `overlapping_eval`: `None` for non-overlapping windows; values below 1 mean 1.
    pub fn new(
        tokens: Vec<u32>,
        seq_length: usize,
        pad: u32,
        num_original_tokens: usize,
        overlapping_eval: Option<i64>,
    ) -> Self {
        let stride = overlapping_eval.map_or(seq_length, |s| s.max(1) as usize);
        LmDataset {
            num_tokenized_tokens: tokens.len(),
            tokens,
            seq_length,
            pad,
            overlapping_eval: stride,
            num_original_tokens,
        }
    }

    /// Megatron's window count, `max(ceil(max(N - 1 - S, 0) / S) + 1, 1)`: with a stride
    /// below the sequence length it includes trailing windows whose scored slots are all
    /// padding, kept so that counts and logs agree with Megatron's.
    pub fn len(&self) -> usize {
        let targets = self.tokens.len().saturating_sub(1);
        targets
            .saturating_sub(self.overlapping_eval)
            .div_ceil(self.overlapping_eval)
            + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn sample(&self, index: usize) -> TaskSample {
        let start = (index * self.overlapping_eval).min(self.tokens.len());
        let end = (start + self.seq_length + 1).min(self.tokens.len());
        let tokens = self.tokens[start..end].to_vec();
        let scored = vec![1u8; tokens.len()];
        let mut sample = TaskSample::padded(tokens, scored, self.seq_length, self.pad);
        if self.overlapping_eval != self.seq_length && index != 0 {
            let unscored = self.seq_length.saturating_sub(self.overlapping_eval);
            sample.pad_mask[..unscored].fill(0);
        }
        sample
    }
}
