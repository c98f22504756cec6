//! The `run` pipeline: merge the shards of a directory, drop documents with bad URLs,
//! clean up, find and remove near-duplicates, and (when task files are given) remove task
//! n-grams. Intermediate files go to a work directory; the summary counts every drop.

use anyhow::Result;
use indicatif::ProgressBar;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::cleanup::Cleanup;
use super::find_duplicates::FindDuplicatesConfig;
use super::jsonl::{AtomicOutput, Input, InvalidLines};
use super::ngrams::NgramConfig;
use super::steps::{self, StepCounts, TaskSource};

/// Settings of a pipeline run.
pub struct PipelineConfig<'a> {
    pub shard_dir: PathBuf,
    pub work_dir: PathBuf,
    pub output: PathBuf,
    pub url_key: String,
    pub cleanup: Cleanup<'a>,
    pub dedup: FindDuplicatesConfig,
    pub group_threshold: f64,
    pub tasks: Vec<TaskSource>,
    pub ngrams: NgramConfig,
    pub invalid: InvalidLines,
}

/// Documents in, drops per step and reason, documents kept.
#[derive(Debug, Clone, Default)]
pub struct PipelineSummary {
    pub documents_in: u64,
    pub dropped: BTreeMap<String, u64>,
    pub kept: u64,
    pub dedup_index_bytes: usize,
}

impl PipelineSummary {
    fn absorb(&mut self, step: &str, counts: &StepCounts) {
        for (reason, n) in &counts.dropped {
            *self.dropped.entry(format!("{step}: {reason}")).or_default() += n;
        }
    }
}

/// Runs every step; `progress(step, total_bytes)` makes each step's progress bar.
pub fn run_pipeline(
    config: &PipelineConfig,
    progress: &dyn Fn(&str, Option<u64>) -> ProgressBar,
) -> Result<PipelineSummary> {
    std::fs::create_dir_all(&config.work_dir)?;
    let work = |name: &str| config.work_dir.join(name);
    let mut summary = PipelineSummary::default();

    let merged = work("01_merged.json");
    let counts = merge_shards(&config.shard_dir, &merged, config.invalid)?;
    summary.documents_in = counts.read;
    summary.absorb("merge", &counts);

    let filtered = work("02_urls_filtered.json");
    let input = Input::File(merged);
    let bar = progress("blacklist-urls", input.size_bytes());
    let counts =
        steps::blacklist_documents(&input, &filtered, &config.url_key, config.invalid, &bar)?;
    bar.finish_and_clear();
    summary.absorb("blacklist-urls", &counts);

    let cleaned = work("03_cleaned.json");
    let input = Input::File(filtered);
    let bar = progress("cleanup", input.size_bytes());
    let counts = steps::cleanup_file(&input, &cleaned, &config.cleanup, config.invalid, &bar)?;
    bar.finish_and_clear();
    summary.absorb("cleanup", &counts);

    let pairs = work("04_similar_pairs.json");
    let bar = progress("find-duplicates", Input::File(cleaned.clone()).size_bytes());
    let report = steps::find_duplicates_files(
        &[(cleaned.clone(), config.url_key.clone())],
        &steps::FingerprintFiles::default(),
        &pairs,
        &config.dedup,
        &bar,
    )?;
    bar.finish_and_clear();
    summary.dedup_index_bytes = report.index_bytes;

    let groups = work("05_duplicate_groups.json");
    steps::group_duplicates_file(&Input::File(pairs), &groups, config.group_threshold)?;

    let deduped = if config.tasks.is_empty() {
        config.output.clone()
    } else {
        work("06_deduplicated.json")
    };
    let input = Input::File(cleaned);
    let bar = progress("remove-duplicates", input.size_bytes());
    let counts = steps::remove_duplicates_file(
        &Input::File(groups),
        &input,
        &deduped,
        &config.url_key,
        config.invalid,
        &bar,
    )?;
    bar.finish_and_clear();
    summary.absorb("remove-duplicates", &counts);
    summary.kept = counts.written;

    if !config.tasks.is_empty() {
        let task_set = steps::task_ngrams(&config.tasks, &config.ngrams)?;
        let input = Input::File(deduped);
        let bar = progress("filter-ngrams (frequencies)", input.size_bytes());
        let rare = steps::rare_task_ngrams(
            &task_set,
            &input,
            "text",
            &config.ngrams,
            config.invalid,
            &bar,
        )?;
        bar.finish_and_clear();
        let names: Vec<String> = config.tasks.iter().map(|t| t.name.clone()).collect();
        let bar = progress("filter-ngrams", input.size_bytes());
        let report = steps::filter_ngrams_file(
            &rare,
            &names,
            &input,
            "text",
            &config.output,
            &config.ngrams,
            config.invalid,
            &bar,
        )?;
        bar.finish_and_clear();
        summary.absorb("filter-ngrams", &report.counts);
        summary.kept = report.counts.written;
    }
    Ok(summary)
}

/// Concatenates every `*.json`/`*.jsonl` shard of `dir` (sorted by name).
fn merge_shards(dir: &Path, output: &Path, invalid: InvalidLines) -> Result<StepCounts> {
    let mut out = AtomicOutput::create(output)?;
    let mut counts = StepCounts::default();
    for shard in steps::list_files(dir, &["json", "jsonl"])? {
        let input = Input::File(shard);
        let mut tracker = super::jsonl::InvalidLineTracker::new(invalid, &input);
        let mut batches = super::jsonl::LineBatches::open(&input)?;
        loop {
            let batch = batches.next_batch()?;
            if batch.is_empty() {
                break;
            }
            for line in batch {
                counts.read += 1;
                match super::jsonl::parse_line(&line) {
                    Ok(_) => {
                        out.write_line(&line.text)?;
                        counts.written += 1;
                    }
                    Err(e) => {
                        tracker.handle(&e)?;
                        *counts
                            .dropped
                            .entry("invalid line".to_string())
                            .or_default() += 1;
                    }
                }
            }
        }
    }
    out.finish()?;
    Ok(counts)
}
