//! `filter_ngrams.py`: removes downstream-task text (13-gram matches) from training
//! documents, with the original's splitting and trimming rules:
//!
//! * task n-grams: lower-cased `\w+` words; texts under `min_ngram_size` words are
//!   ignored, shorter than `max_ngram_size` contribute whole, longer every window;
//! * a frequency pass counts the training documents containing each n-gram; only those
//!   found in fewer than `key_threshold` documents are removed (frequent ones are generic);
//! * a match is cut out with `remove_char_each_side` characters on each side, widened to
//!   the nearest `.`, `!` or `?`; pieces longer than `filter_text_char_len` survive, the
//!   right piece is searched again; documents split into more than `splits_count` pieces,
//!   and documents under `max_ngram_size` words are never examined (the original's loop).

use regex::Regex;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::LazyLock;

static WORD: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\w+").expect("static regex"));

/// Settings of `filter-ngrams` (defaults are the original's).
#[derive(Debug, Clone)]
pub struct NgramConfig {
    pub max_ngram_size: usize,
    pub min_ngram_size: usize,
    pub filter_text_char_len: usize,
    pub key_threshold: u64,
    pub splits_count: usize,
    pub remove_char_each_side: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        Self {
            max_ngram_size: 13,
            min_ngram_size: 8,
            filter_text_char_len: 200,
            key_threshold: 10,
            splits_count: 10,
            remove_char_each_side: 200,
        }
    }
}

/// Lower-cased words of a text and their start positions (in characters of the
/// lower-cased text, as Python indexes it).
fn words(text: &str) -> (Vec<String>, Vec<usize>) {
    let lower = text.to_lowercase();
    let mut out_words = Vec::new();
    let mut positions = Vec::new();
    let mut chars_before = 0usize;
    let mut last_byte = 0usize;
    for m in WORD.find_iter(&lower) {
        chars_before += lower[last_byte..m.start()].chars().count();
        last_byte = m.start();
        positions.push(chars_before);
        out_words.push(m.as_str().to_string());
    }
    (out_words, positions)
}

/// A set of task n-grams (space-joined words) and the sorted distinct lengths in it.
#[derive(Debug, Clone, Default)]
pub struct NgramSet {
    ngrams: HashSet<String>,
    lengths: Vec<usize>,
}

impl NgramSet {
    pub fn from_ngrams(ngrams: impl IntoIterator<Item = String>) -> Self {
        let ngrams: HashSet<String> = ngrams.into_iter().collect();
        let mut lengths: Vec<usize> = ngrams
            .iter()
            .map(|n| n.split(' ').count())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        lengths.sort_unstable();
        Self { ngrams, lengths }
    }

    /// Adds the n-grams of one task text.
    pub fn add_task_text(&mut self, text: &str, config: &NgramConfig) {
        let (w, _) = words(text);
        if w.len() < config.min_ngram_size {
            return;
        }
        if w.len() < config.max_ngram_size {
            self.insert(w.join(" "));
        }
        for window in w.windows(config.max_ngram_size) {
            self.insert(window.join(" "));
        }
    }

    fn insert(&mut self, ngram: String) {
        let n = ngram.split(' ').count();
        if let Err(at) = self.lengths.binary_search(&n) {
            self.lengths.insert(at, n);
        }
        self.ngrams.insert(ngram);
    }

    pub fn len(&self) -> usize {
        self.ngrams.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ngrams.is_empty()
    }

    /// The n-grams in sorted order (for saving a dictionary).
    pub fn sorted(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.ngrams.iter().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Keeps the n-grams found in fewer than `threshold` documents.
    pub fn below_threshold(&self, doc_counts: &HashMap<String, u64>, threshold: u64) -> Self {
        Self::from_ngrams(
            self.ngrams
                .iter()
                .filter(|n| doc_counts.get(*n).copied().unwrap_or(0) < threshold)
                .cloned(),
        )
    }
}

/// What one scan of a document produced.
enum Scan {
    /// Frequency pass: the n-grams that occur in the document.
    Frequencies(HashSet<String>),
    /// Cleaning pass: the n-gram-free pieces.
    Pieces(Vec<String>),
}

struct Scanner<'a> {
    set: &'a NgramSet,
    config: &'a NgramConfig,
    count_only: bool,
    queue: VecDeque<Vec<char>>,
    found: HashSet<String>,
    pieces: Vec<String>,
    key: String,
}

impl Scanner<'_> {
    /// Tests `window` (starting at character `start` of `text`); on a match records it
    /// and queues what is left. Returns true when the window is n-gram free.
    fn check(&mut self, window: &[String], text: &[char], start: usize) -> bool {
        self.key.clear();
        for (i, w) in window.iter().enumerate() {
            if i > 0 {
                self.key.push(' ');
            }
            self.key.push_str(w);
        }
        if !self.set.ngrams.contains(&self.key) {
            return true;
        }
        let seq_len = self.key.chars().count();
        if self.count_only {
            self.found.insert(self.key.clone());
            if start + seq_len + 1 < text.len() {
                self.queue.push_back(text[start + seq_len + 1..].to_vec());
            }
            return false;
        }
        let (first, second) = split_around(text, start, seq_len, self.config.remove_char_each_side);
        if first.len() > self.config.filter_text_char_len {
            self.pieces.push(first.iter().collect());
        }
        if second.len() > self.config.filter_text_char_len {
            self.queue.push_back(second.to_vec());
        }
        false
    }

    fn scan_one(&mut self, text: Vec<char>) {
        let as_string: String = text.iter().collect();
        let (w, pos) = words(&as_string);
        let max = self.config.max_ngram_size;
        let lengths = self.set.lengths.clone();
        let mut free = true;
        'windows: for i in 0..(w.len() + 1).saturating_sub(max) {
            if !self.check(&w[i..i + max], &text, pos[i]) {
                free = false;
                break;
            }
            for &n in &lengths {
                if !self.check(&w[i..(i + n).min(w.len())], &text, pos[i]) {
                    free = false;
                    break 'windows;
                }
            }
        }
        if free && w.len() > max {
            let last_start = w.len() - max;
            'lengths: for &n in lengths.iter().filter(|&&n| n != max) {
                for i in 0..(max + 1).saturating_sub(n) {
                    let s = last_start + i;
                    if !self.check(&w[s..s + n], &text, pos[s]) {
                        free = false;
                        break 'lengths;
                    }
                }
            }
        }
        if free && !self.count_only {
            self.pieces.push(as_string);
        }
    }

    fn run(mut self, text: &str) -> Scan {
        self.queue.push_back(text.chars().collect());
        while let Some(next) = self.queue.pop_front() {
            self.scan_one(next);
        }
        if self.count_only {
            Scan::Frequencies(self.found)
        } else {
            Scan::Pieces(self.pieces)
        }
    }
}

/// The parts left of and right of a match at `start` (`seq_len` characters long) after
/// removing `margin` characters each side and widening to sentence punctuation.
fn split_around(text: &[char], start: usize, seq_len: usize, margin: usize) -> (&[char], &[char]) {
    let is_punct = |c: char| matches!(c, '.' | '!' | '?');
    let mut first: &[char] = &[];
    if start > margin {
        let mut pos = start - margin;
        while pos > 0 && !is_punct(text[pos]) {
            pos -= 1;
        }
        if pos > 0 {
            first = &text[..=pos];
        }
    }
    let mut pos = start + seq_len + margin;
    while pos < text.len() && !is_punct(text[pos]) {
        pos += 1;
    }
    let second = if pos + 1 < text.len() {
        &text[pos + 1..]
    } else {
        &[]
    };
    (first, second)
}

/// The task n-grams that occur in `text` (frequency pass).
pub fn ngrams_in(text: &str, set: &NgramSet, config: &NgramConfig) -> HashSet<String> {
    match scanner(set, config, true).run(text) {
        Scan::Frequencies(found) => found,
        Scan::Pieces(_) => unreachable!("count-only scans report frequencies"),
    }
}

/// The n-gram-free pieces of `text` (cleaning pass); empty when nothing survives.
pub fn clean_pieces(text: &str, set: &NgramSet, config: &NgramConfig) -> Vec<String> {
    match scanner(set, config, false).run(text) {
        Scan::Pieces(pieces) => pieces,
        Scan::Frequencies(_) => unreachable!("cleaning scans report pieces"),
    }
}

fn scanner<'a>(set: &'a NgramSet, config: &'a NgramConfig, count_only: bool) -> Scanner<'a> {
    Scanner {
        set,
        config,
        count_only,
        queue: VecDeque::new(),
        found: HashSet::new(),
        pieces: Vec::new(),
        key: String::new(),
    }
}

/// The `split_id` of piece `piece` of document `counter` (1-based).
pub fn split_id(existing: Option<&str>, tasks: &[String], counter: u64, piece: usize) -> String {
    let prefix = existing.map_or(String::new(), |s| format!("{s}-"));
    format!("{prefix}{}-{counter:010}-{piece:04}", tasks.join("-"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lorem(n: usize, tag: &str) -> String {
        (0..n)
            .map(|i| format!("{tag}{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    #[test]
    fn task_ngrams_follow_length_rules() {
        let config = NgramConfig::default();
        let mut set = NgramSet::default();
        set.add_task_text("one two three four five six seven", &config);
        assert!(set.is_empty());
        set.add_task_text("One two three four five six seven eight", &config);
        assert_eq!(set.len(), 1);
        set.add_task_text(&lorem(15, "w"), &config);
        assert_eq!(set.len(), 1 + 3);
        assert_eq!(set.lengths, vec![8, 13]);
    }

    #[test]
    fn a_match_is_cut_out_with_margins_to_punctuation() {
        let config = NgramConfig::default();
        let task = lorem(13, "task");
        let mut set = NgramSet::default();
        set.add_task_text(&task, &config);
        let left = format!("{}. {}", lorem(60, "a"), lorem(60, "b"));
        let right = format!("{}. {}", lorem(60, "c"), lorem(60, "d"));
        let doc = format!("{left} {task} {right}");
        let pieces = clean_pieces(&doc, &set, &config);
        assert_eq!(pieces.len(), 2);
        assert!(pieces[0].ends_with("a59."), "{}", pieces[0]);
        assert!(pieces[1].trim_start().starts_with("d0"), "{}", pieces[1]);
        assert!(pieces.iter().all(|p| !p.contains("task")));
        assert_eq!(ngrams_in(&doc, &set, &config).len(), 1);
        assert_eq!(clean_pieces(&left, &set, &config), vec![left.clone()]);
    }

    #[test]
    fn split_ids() {
        let tasks = vec!["lambada".to_string(), "squad".to_string()];
        assert_eq!(
            split_id(None, &tasks, 7, 1),
            "lambada-squad-0000000007-0001"
        );
        assert_eq!(
            split_id(Some("x"), &tasks, 7, 0),
            "x-lambada-squad-0000000007-0000"
        );
    }
}
