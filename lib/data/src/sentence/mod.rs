//! Sentence splitting equivalent to NLTK's pre-trained Punkt tokenizer, which Megatron's
//! `--split-sentences` uses.
//!
//! The parameters are NLTK's `punkt_tab/<lang>` files; `--keep-newlines` switches to the
//! period-context pattern Megatron substitutes so that whitespace after a sentence stays in it.

mod download;
mod params;
mod punkt;
mod words;

pub use download::{
    download_punkt_tab, nltk_download_root, PUNKT_TAB_SHA256, PUNKT_TAB_URL, SHA256_VARIABLE,
    URL_VARIABLE,
};
pub use params::{find_punkt_dir, PunktParameters};
pub use punkt::{SentenceSplitter, MEGATRON_SLICE_CHARS};

/// Why the Punkt parameters could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SentenceError {
    #[error("{path}: {reason}")]
    File {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("{0}")]
    NotFound(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::{parse_line, FieldText};
    use std::path::Path;

    fn splitter(keep_newlines: bool) -> SentenceSplitter {
        let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared");
        let params = PunktParameters::load(&shared.join("data/punkt_tab_english")).unwrap();
        SentenceSplitter::new(params, keep_newlines)
    }

    fn corpus(name: &str) -> Vec<FieldText> {
        let shared =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden/preprocess");
        let text = std::fs::read_to_string(shared.join(name)).unwrap();
        text.lines()
            .map(|l| parse_line(l, &["text".to_string()]).unwrap().remove(0))
            .collect()
    }

    #[test]
    fn sentences_equal_megatrons_split_file() {
        let s = splitter(false);
        let docs = corpus("small_corpus.jsonl");
        let split = corpus("small_corpus_ss.jsonl");
        assert_eq!(docs.len(), 554);
        let mut total = 0;
        for (i, (doc, want)) in docs.iter().zip(&split).enumerate() {
            let (FieldText::Text(text), FieldText::Sentences(want)) = (doc, want) else {
                panic!("doc {i}")
            };
            assert_eq!(&s.split_document(text), want, "document {i}");
            total += want.len();
        }
        assert_eq!(total, 2099);
    }

    #[test]
    fn keep_newlines_keeps_whitespace_after_sentences() {
        // Expected values checked against NLTK 3.10.4 with Megatron's CustomLanguageVars.
        let s = splitter(true);
        assert_eq!(
            s.split("Hello there.\nHow are you?  Fine."),
            ["Hello there.\n", "How are you?  ", "Fine."]
        );
        // A closing quote is realigned onto its sentence and the whitespace after it is lost.
        assert_eq!(
            s.split("He said \"no.\" \n Then left."),
            ["He said \"no.\"", "Then left."]
        );
    }

    #[test]
    fn abbreviations_and_initials_do_not_end_sentences() {
        let s = splitter(false);
        assert_eq!(
            s.split("Mr. Smith met J. S. Bach at 5 p.m. yesterday. They talked."),
            [
                "Mr. Smith met J. S. Bach at 5 p.m. yesterday.",
                "They talked."
            ]
        );
        assert_eq!(
            s.split("(How odd?) \"It is.\" Next"),
            ["(How odd?)", "\"It is.\"", "Next"]
        );
    }
}
