//! `cleanup_dataset.py` and `cleanup_fix_dataset.py`: text fixing, English-only, minimum
//! length in GPT-2 tokens; and the fix script's task variants.
//!
//! Language identification uses `whatlang` (deterministic) in place of the unseeded
//! `langdetect`; a text whose language cannot be identified counts as non-English.

use regex::Regex;
use std::sync::LazyLock;

use super::json::{JsonObject, JsonValue};
use super::textfix::fix_text;

/// Counts the tokens a document encodes to (without the end-of-document token).
pub trait TokenCounter: Sync {
    fn count_tokens(&self, text: &str) -> usize;
}

impl<T: crate::tokenizer::Tokenizer + ?Sized> TokenCounter for T {
    /// A text the tokenizer rejects counts as empty, so it is dropped as too short (the
    /// original dropped any document whose processing raised).
    fn count_tokens(&self, text: &str) -> usize {
        self.tokenize(text).map_or(0, |ids| ids.len())
    }
}

/// Minimum document length of `cleanup_dataset.py`, in GPT-2 tokens including the EOD.
pub const MIN_DOCUMENT_TOKENS: usize = 128;

/// Documents with at least this many characters per required token skip tokenization:
/// the original's "8 characters per token is an upper bound" shortcut.
const CHARS_PER_TOKEN_BOUND: usize = 8;

/// True when the text's most likely language is English.
pub fn is_english(text: &str) -> bool {
    whatlang::detect_lang(text) == Some(whatlang::Lang::Eng)
}

/// Why `cleanup` dropped a document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupDrop {
    NonEnglish,
    TooShort,
}

/// What `cleanup` decided for one document.
#[derive(Debug, Clone, PartialEq)]
pub struct CleanupOutcome {
    /// The document with its text fixed (also when dropped, for the record).
    pub doc: JsonObject,
    pub text_was_fixed: bool,
    pub dropped: Option<CleanupDrop>,
    pub chars: usize,
}

/// Settings of the cleanup step.
pub struct Cleanup<'a> {
    pub min_tokens: usize,
    pub tokens: &'a dyn TokenCounter,
}

impl Cleanup<'_> {
    /// Fixes the `text` field, then applies the English and minimum-length rules.
    pub fn apply(&self, mut doc: JsonObject) -> Result<CleanupOutcome, String> {
        let original = doc.get_str("text")?;
        let fixed = fix_text(original).into_owned();
        let text_was_fixed = fixed != original;
        let chars = fixed.chars().count();
        let dropped = if !is_english(&fixed) {
            Some(CleanupDrop::NonEnglish)
        } else if chars < CHARS_PER_TOKEN_BOUND * self.min_tokens
            && self.tokens.count_tokens(&fixed) + 1 < self.min_tokens
        {
            Some(CleanupDrop::TooShort)
        } else {
            None
        };
        doc.insert("text", JsonValue::String(fixed));
        Ok(CleanupOutcome {
            doc,
            text_was_fixed,
            dropped,
            chars,
        })
    }
}

/// The tasks of `cleanup_fix_dataset.py`, in the fixed order in which they are tried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FixTask {
    Remove512,
    Remove256Javascript,
    Remove512NonEnglish,
    FtfyFixText,
    GeneralCleaning,
}

impl FixTask {
    pub const ALL: [FixTask; 5] = [
        FixTask::Remove512,
        FixTask::Remove256Javascript,
        FixTask::Remove512NonEnglish,
        FixTask::FtfyFixText,
        FixTask::GeneralCleaning,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FixTask::Remove512 => "remove_512",
            FixTask::Remove256Javascript => "remove_256_javascript",
            FixTask::Remove512NonEnglish => "remove_512_non_english",
            FixTask::FtfyFixText => "ftfy_fix_text",
            FixTask::GeneralCleaning => "general_cleaning",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

static GENERAL_CLEANING: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"  +|\b\n+ |\b\n+").expect("static regex"));

/// Result of the fix tasks for one document.
#[derive(Debug, Clone, PartialEq)]
pub struct FixOutcome {
    pub doc: JsonObject,
    /// The task that decided, if any applied.
    pub task: Option<FixTask>,
    /// True when the document goes to the `_filtered` output.
    pub filtered: bool,
}

/// Runs the first applicable task of `tasks` (a filter or a transform ends processing, as
/// in the original, so `ftfy_fix_text` with `general_cleaning` only runs ftfy).
pub fn apply_fix_tasks(tasks: &[FixTask], mut doc: JsonObject) -> Result<FixOutcome, String> {
    let text = doc.get_str("text")?.to_string();
    let chars = text.chars().count();
    for task in FixTask::ALL.into_iter().filter(|t| tasks.contains(t)) {
        let (filtered, new_text) = match task {
            FixTask::Remove512 if chars < 512 => (true, None),
            FixTask::Remove256Javascript
                if chars < 256 && text.to_lowercase().contains("javascript") =>
            {
                (true, None)
            }
            FixTask::Remove512NonEnglish if chars < 512 && !is_english(&text) => (true, None),
            FixTask::FtfyFixText => (false, Some(fix_text(&text).into_owned())),
            FixTask::GeneralCleaning => (
                false,
                Some(GENERAL_CLEANING.replace_all(&text, " ").into_owned()),
            ),
            _ => continue,
        };
        if let Some(t) = new_text {
            doc.insert("text", JsonValue::String(t));
        }
        return Ok(FixOutcome {
            doc,
            task: Some(task),
            filtered,
        });
    }
    Ok(FixOutcome {
        doc,
        task: None,
        filtered: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Words;
    impl TokenCounter for Words {
        fn count_tokens(&self, text: &str) -> usize {
            text.split_whitespace().count()
        }
    }

    fn doc(text: &str) -> JsonObject {
        let mut d = JsonObject::default();
        d.insert("text", JsonValue::String(text.into()));
        d.insert("url", JsonValue::String("u".into()));
        d
    }

    #[test]
    fn cleanup_rules() {
        let c = Cleanup {
            min_tokens: 10,
            tokens: &Words,
        };
        let english =
            "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.";
        let out = c.apply(doc(english)).unwrap();
        assert_eq!(out.dropped, None);
        let out = c.apply(doc("The fox jumps over the dog.")).unwrap();
        assert_eq!(out.dropped, Some(CleanupDrop::TooShort));
        let german = "Der schnelle braune Fuchs springt über den faulen Hund, während der Bauer von der Veranda aus zusieht.";
        assert_eq!(
            c.apply(doc(german)).unwrap().dropped,
            Some(CleanupDrop::NonEnglish)
        );
        let fixed = c.apply(doc(&format!("{english} Itâ€™s fine."))).unwrap();
        assert!(fixed.text_was_fixed);
        assert!(fixed.doc.get_str("text").unwrap().ends_with("It's fine."));
    }

    #[test]
    fn fix_tasks_first_applicable_decides() {
        let long = "word ".repeat(120);
        let out = apply_fix_tasks(&[FixTask::Remove512], doc("short")).unwrap();
        assert!(out.filtered);
        let out = apply_fix_tasks(
            &[FixTask::Remove256Javascript],
            doc("Enable JavaScript to view"),
        )
        .unwrap();
        assert_eq!(out.task, Some(FixTask::Remove256Javascript));
        let tasks = [FixTask::FtfyFixText, FixTask::GeneralCleaning];
        let out = apply_fix_tasks(&tasks, doc(&format!("{long}  a\n\nb"))).unwrap();
        assert_eq!(out.task, Some(FixTask::FtfyFixText));
        assert!(out.doc.get_str("text").unwrap().contains("  a\n\nb"));
        let out = apply_fix_tasks(&[FixTask::GeneralCleaning], doc("a  b\n\nc\n d")).unwrap();
        assert_eq!(out.doc.get_str("text").unwrap(), "a b c d");
        assert!(!out.filtered);
    }
}
