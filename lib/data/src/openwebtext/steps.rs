//! File-level drivers of each step: read loose JSON, apply the step, write loose JSON,
//! return counts. The binary's subcommands and the `run` pipeline both call these.

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use std::collections::{BTreeMap, HashMap};
use std::io::BufRead;
use std::path::{Path, PathBuf};

use super::blacklist::UrlFilter;
use super::cleanup::{apply_fix_tasks, Cleanup, CleanupDrop, FixTask};
use super::find_duplicates::{similar_groups, FindDuplicatesConfig, FingerprintIndex};
use super::groups::{group_to_python_json, parse_group_line, DuplicateGroups, GroupDeduplicator};
use super::json::{JsonObject, JsonValue};
use super::jsonl::{
    for_each_parallel, parse_line, AtomicOutput, Input, InvalidLineTracker, InvalidLines, Line,
    LineError,
};
use super::ngrams::{clean_pieces, ngrams_in, split_id, NgramConfig, NgramSet};

/// Documents read, written, and dropped per reason.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepCounts {
    pub read: u64,
    pub written: u64,
    pub dropped: BTreeMap<String, u64>,
}

impl StepCounts {
    fn drop_for(&mut self, reason: &str) {
        *self.dropped.entry(reason.to_string()).or_default() += 1;
    }

    /// `read N, written M, dropped: reason k, …`.
    pub fn summary(&self) -> String {
        let drops: Vec<String> = self
            .dropped
            .iter()
            .map(|(r, n)| format!("{r} {n}"))
            .collect();
        let drops = if drops.is_empty() {
            "none".to_string()
        } else {
            drops.join(", ")
        };
        format!(
            "read {}, written {}, dropped: {drops}",
            self.read, self.written
        )
    }
}

fn record_invalid(
    tracker: &mut InvalidLineTracker,
    counts: &mut StepCounts,
    e: &LineError,
) -> Result<()> {
    tracker.handle(e)?;
    counts.drop_for("invalid line");
    Ok(())
}

/// Turns a step's message about `line` into that line's error.
fn line_error(line: &Line) -> impl FnOnce(String) -> LineError + '_ {
    |message| LineError {
        line_no: line.line_no,
        message,
    }
}

/// What a step decides for one document.
enum Verdict {
    Write(JsonObject),
    Drop(&'static str),
}

/// The shape of most steps: every line of `input` is parsed by `parse` (in parallel), then, in
/// data order, judged by `judge`; the documents it keeps go to `output`. Invalid lines are
/// refused or counted per `invalid`.
fn filter_documents<T: Send>(
    input: &Input,
    output: &Path,
    invalid: InvalidLines,
    progress: &ProgressBar,
    parse: impl Fn(&Line) -> Result<T, LineError> + Sync,
    mut judge: impl FnMut(T) -> Verdict,
) -> Result<StepCounts> {
    let mut tracker = InvalidLineTracker::new(invalid, input);
    let mut out = AtomicOutput::create(output)?;
    let mut counts = StepCounts::default();
    for_each_parallel(input, progress, parse, |r| {
        counts.read += 1;
        match r {
            Err(e) => record_invalid(&mut tracker, &mut counts, &e),
            Ok(parsed) => {
                match judge(parsed) {
                    Verdict::Drop(reason) => counts.drop_for(reason),
                    Verdict::Write(doc) => {
                        out.write_line(&doc.to_python_json())?;
                        counts.written += 1;
                    }
                }
                Ok(())
            }
        }
    })?;
    out.finish()?;
    Ok(counts)
}

/// Calls `each` with every line of the small JSON-lines file `input` (pairs, groups, task
/// texts); an unreadable line or one `each` refuses is an error naming the file and line.
fn for_each_json_line(
    input: &Input,
    mut each: impl FnMut(JsonObject) -> std::result::Result<(), String>,
) -> Result<()> {
    for (i, line) in input.open()?.lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", input.name()))?;
        JsonObject::parse(&line)
            .and_then(&mut each)
            .map_err(|m| anyhow::anyhow!("{}:{}: {m}", input.name(), i + 1))?;
    }
    Ok(())
}

/// `blacklist-urls`: every `*.txt` of `dir` (sorted by name), one URL per line.
pub fn blacklist_url_files(
    dir: &Path,
    output: &Path,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    let mut files = list_files(dir, &["txt"])?;
    files.sort();
    let mut filter = UrlFilter::new();
    let mut out = AtomicOutput::create(output)?;
    let mut counts = StepCounts::default();
    for file in files {
        let reader = Input::File(file.clone()).open()?;
        for line in reader.lines() {
            let line = line.with_context(|| format!("reading {}", file.display()))?;
            let url = line.trim();
            counts.read += 1;
            progress.inc(1);
            match filter.check(url) {
                Some(reason) => counts.drop_for(reason.label()),
                None => {
                    out.write_line(url)?;
                    counts.written += 1;
                }
            }
        }
    }
    out.finish()?;
    Ok(counts)
}

/// Sorted files of `dir` whose extension is one of `extensions`.
pub fn list_files(dir: &Path, extensions: &[&str]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if path.is_file() && extensions.contains(&ext) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Applies the URL rules to the `url_key` field of documents (the `run` pipeline's form of
/// `blacklist-urls`, for corpora whose URLs were not filtered before download).
pub fn blacklist_documents(
    input: &Input,
    output: &Path,
    url_key: &str,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    let rules = UrlFilter::new();
    let mut seen = UrlFilter::new();
    filter_documents(
        input,
        output,
        invalid,
        progress,
        |line| {
            let doc = parse_line(line)?;
            let url = doc.get_str(url_key).map_err(line_error(line))?.to_string();
            let verdict = rules.static_rejection(&url);
            Ok((doc, url, verdict))
        },
        |(doc, url, verdict)| match verdict.or_else(|| seen.check_duplicate(&url)) {
            Some(reason) => Verdict::Drop(reason.label()),
            None => Verdict::Write(doc),
        },
    )
}

/// `cleanup`: ftfy-style fixing, English only, minimum GPT-2 token count.
pub fn cleanup_file(
    input: &Input,
    output: &Path,
    cleanup: &Cleanup,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    filter_documents(
        input,
        output,
        invalid,
        progress,
        |line| cleanup.apply(parse_line(line)?).map_err(line_error(line)),
        |outcome| match outcome.dropped {
            Some(CleanupDrop::NonEnglish) => Verdict::Drop("non-english"),
            Some(CleanupDrop::TooShort) => Verdict::Drop("too short"),
            None => Verdict::Write(outcome.doc),
        },
    )
}

/// `cleanup-fix`: writes `<stem>_cleaned<ext>` and `<stem>_filtered<ext>` into `out_dir`.
pub fn cleanup_fix_file(
    input: &Path,
    out_dir: &Path,
    tasks: &[FixTask],
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    let stem = input
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = input
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    let mut cleaned = AtomicOutput::create(&out_dir.join(format!("{stem}_cleaned{ext}")))?;
    let mut filtered = AtomicOutput::create(&out_dir.join(format!("{stem}_filtered{ext}")))?;
    let input = Input::File(input.to_path_buf());
    let mut tracker = InvalidLineTracker::new(invalid, &input);
    let mut counts = StepCounts::default();
    for_each_parallel(
        &input,
        progress,
        |line| {
            let doc = parse_line(line)?;
            apply_fix_tasks(tasks, doc).map_err(line_error(line))
        },
        |r| {
            counts.read += 1;
            match r {
                Err(e) => record_invalid(&mut tracker, &mut counts, &e),
                Ok(outcome) => {
                    if outcome.filtered {
                        let task = outcome.task.map_or("filtered", FixTask::name);
                        counts.drop_for(task);
                        filtered.write_line(&outcome.doc.to_python_json())
                    } else {
                        counts.written += 1;
                        cleaned.write_line(&outcome.doc.to_python_json())
                    }
                }
            }
        },
    )?;
    cleaned.finish()?;
    filtered.finish()?;
    Ok(counts)
}

/// Counts of `find-duplicates`.
#[derive(Debug, Clone, Default)]
pub struct FindDuplicatesReport {
    pub documents: u64,
    pub candidate_buckets: u64,
    pub similar_pairs: u64,
    pub index_bytes: usize,
    pub skipped_invalid: u64,
}

/// `find-duplicates`: fingerprints `(file, id key)` inputs and writes similar pairs.
/// Fingerprint files to start from and to write (`--load-fingerprints`, `--save-fingerprints`).
#[derive(Debug, Clone, Default)]
pub struct FingerprintFiles {
    pub load: Vec<PathBuf>,
    pub save: Option<PathBuf>,
}

pub fn find_duplicates_files(
    inputs: &[(PathBuf, String)],
    fingerprints: &FingerprintFiles,
    output: &Path,
    config: &FindDuplicatesConfig,
    progress: &ProgressBar,
) -> Result<FindDuplicatesReport> {
    let mut index = FingerprintIndex::new(config)?;
    for path in &fingerprints.load {
        index.load(path)?;
    }
    for (path, key) in inputs {
        index.add_file(path, key, config.invalid, progress)?;
    }
    if let Some(path) = &fingerprints.save {
        index.save(path)?;
    }
    let buckets = index.candidate_buckets(config.num_bands);
    progress.set_position(0);
    progress.set_length(buckets.len() as u64);
    let groups = similar_groups(&index, &buckets, config, progress)?;
    let mut out = AtomicOutput::create(output)?;
    let mut pairs = 0;
    for g in &groups {
        pairs += g.others.len() as u64;
        out.write_line(&g.to_python_json())?;
    }
    out.finish()?;
    Ok(FindDuplicatesReport {
        documents: index.len() as u64,
        candidate_buckets: buckets.len() as u64,
        similar_pairs: pairs,
        index_bytes: index.memory_bytes(),
        skipped_invalid: index.skipped_invalid,
    })
}

/// `group-duplicates`: returns (ids in groups, groups).
pub fn group_duplicates_file(input: &Input, output: &Path, threshold: f64) -> Result<(u64, u64)> {
    let mut groups = DuplicateGroups::default();
    for_each_json_line(input, |pairs| groups.add_pairs_line(&pairs, threshold))?;
    let mut out = AtomicOutput::create(output)?;
    let all = groups.groups();
    let mut members = 0;
    for (n, g) in all.iter().enumerate() {
        members += g.len() as u64;
        out.write_line(&group_to_python_json(n, g))?;
    }
    out.finish()?;
    Ok((members, all.len() as u64))
}

/// `remove-duplicates`: keeps the first document (in data order) of every group.
pub fn remove_duplicates_file(
    groups_file: &Input,
    input: &Input,
    output: &Path,
    key: &str,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    let mut dedup = GroupDeduplicator::default();
    for_each_json_line(groups_file, |group| {
        dedup.add_group(parse_group_line(&group)?);
        Ok(())
    })?;
    filter_documents(
        input,
        output,
        invalid,
        progress,
        |line| {
            let doc = parse_line(line)?;
            let id = doc.get_str(key).map_err(line_error(line))?.to_string();
            Ok((doc, id))
        },
        |(doc, id)| {
            if dedup.is_duplicate(&id) {
                Verdict::Drop("near-duplicate")
            } else {
                Verdict::Write(doc)
            }
        },
    )
}

/// Where `filter-ngrams` gets the texts of one task.
#[derive(Debug, Clone)]
pub struct TaskSource {
    pub name: String,
    pub path: PathBuf,
    pub key: String,
}

/// Builds the task n-gram set from local JSONL task files.
pub fn task_ngrams(sources: &[TaskSource], config: &NgramConfig) -> Result<NgramSet> {
    let mut set = NgramSet::default();
    for source in sources {
        for_each_json_line(&Input::File(source.path.clone()), |task| {
            set.add_task_text(task.get_str(&source.key)?, config);
            Ok(())
        })?;
    }
    Ok(set)
}

/// Counts, per task n-gram, the training documents containing it, and keeps the rare ones.
pub fn rare_task_ngrams(
    task_set: &NgramSet,
    input: &Input,
    key: &str,
    config: &NgramConfig,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<NgramSet> {
    let mut tracker = InvalidLineTracker::new(invalid, input);
    let mut doc_counts: HashMap<String, u64> = HashMap::new();
    for_each_parallel(
        input,
        progress,
        |line| {
            let doc = parse_line(line)?;
            let text = doc.get_str(key).map_err(line_error(line))?;
            Ok(ngrams_in(text, task_set, config))
        },
        |r| match r {
            Err(e) => tracker.handle(&e),
            Ok(found) => {
                for n in found {
                    *doc_counts.entry(n).or_default() += 1;
                }
                Ok(())
            }
        },
    )?;
    Ok(task_set.below_threshold(&doc_counts, config.key_threshold))
}

/// Counts of the cleaning pass of `filter-ngrams`.
#[derive(Debug, Clone, Default)]
pub struct NgramReport {
    pub counts: StepCounts,
    pub split: u64,
    pub trimmed: u64,
    pub pieces_written: u64,
}

/// Cleaning pass: writes the n-gram-free pieces of every document.
#[allow(clippy::too_many_arguments)]
pub fn filter_ngrams_file(
    rare: &NgramSet,
    tasks: &[String],
    input: &Input,
    key: &str,
    output: &Path,
    config: &NgramConfig,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<NgramReport> {
    let mut tracker = InvalidLineTracker::new(invalid, input);
    let mut out = AtomicOutput::create(output)?;
    let mut report = NgramReport::default();
    for_each_parallel(
        input,
        progress,
        |line| {
            let doc = parse_line(line)?;
            let text = doc.get_str(key).map_err(line_error(line))?;
            let original_chars = text.chars().count();
            let pieces = clean_pieces(text, rare, config);
            Ok((line.line_no, doc, original_chars, pieces))
        },
        |r| {
            report.counts.read += 1;
            match r {
                Err(e) => record_invalid(&mut tracker, &mut report.counts, &e),
                Ok((counter, mut doc, original_chars, pieces)) => {
                    if pieces.len() > 1 {
                        report.split += 1;
                    }
                    if pieces.len() == 1 && pieces[0].chars().count() < original_chars {
                        report.trimmed += 1;
                    }
                    if pieces.is_empty() {
                        report.counts.drop_for("task n-gram (nothing left)");
                        return Ok(());
                    }
                    if pieces.len() > config.splits_count {
                        report.counts.drop_for("task n-gram (too many splits)");
                        return Ok(());
                    }
                    let existing = match doc.get("split_id") {
                        Some(JsonValue::String(s)) => Some(s.clone()),
                        _ => None,
                    };
                    report.counts.written += 1;
                    for (i, piece) in pieces.into_iter().enumerate() {
                        doc.insert(key, JsonValue::String(piece));
                        doc.insert(
                            "split_id",
                            JsonValue::String(split_id(existing.as_deref(), tasks, counter, i)),
                        );
                        out.write_line(&doc.to_python_json())?;
                        report.pieces_written += 1;
                    }
                    Ok(())
                }
            }
        },
    )?;
    out.finish()?;
    Ok(report)
}

/// `merge-jsons`: concatenates the lines of `dir/*.json` (sorted), checking each is JSON.
pub fn merge_json_files(dir: &Path, output: &Path, invalid: InvalidLines) -> Result<StepCounts> {
    let mut out = AtomicOutput::create(output)?;
    let mut counts = StepCounts::default();
    for file in list_files(dir, &["json"])? {
        let input = Input::File(file);
        let mut tracker = InvalidLineTracker::new(invalid, &input);
        for (i, line) in input.open()?.lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", input.name()))?;
            counts.read += 1;
            match serde_json::from_str::<serde::de::IgnoredAny>(&line) {
                Ok(_) => {
                    out.write_line(&line)?;
                    counts.written += 1;
                }
                Err(e) => {
                    let err = LineError {
                        line_no: i as u64 + 1,
                        message: format!("invalid JSON: {e}"),
                    };
                    record_invalid(&mut tracker, &mut counts, &err)?;
                }
            }
        }
    }
    out.finish()?;
    Ok(counts)
}

/// `add-id`: appends `adlr_id = "<prefix>-<10-digit counter from 1>"` to every document.
pub fn add_id_file(
    input: &Input,
    output: &Path,
    prefix: &str,
    invalid: InvalidLines,
    progress: &ProgressBar,
) -> Result<StepCounts> {
    let mut written = 0u64;
    filter_documents(input, output, invalid, progress, parse_line, |mut doc| {
        written += 1;
        let id = format!("{prefix}-{written:010}");
        doc.insert("adlr_id", JsonValue::String(id));
        Verdict::Write(doc)
    })
}
