//! `openwebtext_filter`: Megatron's `tools/openwebtext` scripts as subcommands. Every step
//! reads and writes loose JSON (`-` for stdin/stdout where a single stream makes sense).

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use megatron_cli::bail_usage;
use megatron_data::openwebtext::cleanup::{Cleanup, FixTask, MIN_DOCUMENT_TOKENS};
use megatron_data::openwebtext::find_duplicates::FindDuplicatesConfig;
use megatron_data::openwebtext::groups::DEFAULT_GROUP_THRESHOLD;
use megatron_data::openwebtext::jsonl::{AtomicOutput, Input, InvalidLines};
use megatron_data::openwebtext::minhash::JaccardKind;
use megatron_data::openwebtext::ngrams::{NgramConfig, NgramSet};
use megatron_data::openwebtext::pipeline::{run_pipeline, PipelineConfig};
use megatron_data::openwebtext::steps::{self, StepCounts, TaskSource};
use megatron_data::tokenizer::Gpt2Bpe;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser)]
#[command(
    version,
    about = "Megatron's openwebtext cleaning pipeline (blacklist, cleanup, MinHash dedup, n-gram decontamination)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone, Copy)]
struct InvalidArgs {
    /// Drop lines that are not JSON objects (or lack a needed field) and count them,
    /// instead of stopping at the first one with its file:line.
    #[arg(long)]
    skip_invalid: bool,
}

impl InvalidArgs {
    fn policy(self) -> InvalidLines {
        if self.skip_invalid {
            InvalidLines::Skip
        } else {
            InvalidLines::Fail
        }
    }
}

#[derive(clap::Args, Clone)]
struct Gpt2Args {
    /// GPT-2 vocabulary (gpt2-vocab.json), used to count tokens for the minimum length.
    #[arg(long)]
    vocab_file: PathBuf,
    /// GPT-2 merges (gpt2-merges.txt).
    #[arg(long)]
    merge_file: PathBuf,
    /// Documents with fewer GPT-2 tokens (counting the end-of-document token) are dropped.
    #[arg(long, default_value_t = MIN_DOCUMENT_TOKENS)]
    min_tokens: usize,
}

#[derive(clap::Args, Clone)]
struct DedupArgs {
    /// Seed of the MinHash functions and of the per-bucket choice of main document.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Number of MinHash functions (must be a multiple of --num-bands).
    #[arg(long, default_value_t = 100)]
    num_seeds: usize,
    /// Number of LSH bands.
    #[arg(long, default_value_t = 10)]
    num_bands: usize,
    /// Similarity normalisation: intersection over union, smaller set or larger set.
    #[arg(long, value_enum, default_value_t = Jaccard::Union)]
    jaccard: Jaccard,
    /// Main documents drawn per bucket; -1 repeats until no bucket has two documents left.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true)]
    heuristic_iter: i64,
}

impl DedupArgs {
    fn config(&self, invalid: InvalidLines) -> Result<FindDuplicatesConfig> {
        let heuristic_iter = match self.heuristic_iter {
            -1 => None,
            n if n >= 1 => Some(n as usize),
            n => bail_usage!("--heuristic-iter must be -1 or at least 1, got {n}"),
        };
        Ok(FindDuplicatesConfig {
            seed: self.seed,
            num_seeds: self.num_seeds,
            num_bands: self.num_bands,
            jaccard: match self.jaccard {
                Jaccard::Union => JaccardKind::Union,
                Jaccard::Min => JaccardKind::Min,
                Jaccard::Max => JaccardKind::Max,
            },
            heuristic_iter,
            invalid,
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Jaccard {
    Union,
    Min,
    Max,
}

#[derive(clap::Args, Clone)]
struct NgramArgs {
    /// Task names, used for the split_id prefix; each needs its texts: --lambada-path for
    /// lambada, --task-file NAME=PATH[:KEY] for any other task.
    #[arg(long, num_args = 1.., required = true)]
    tasks: Vec<String>,
    /// LAMBADA test set (JSONL with a "text" field).
    #[arg(long)]
    lambada_path: Option<PathBuf>,
    /// Local JSONL texts of a task: NAME=PATH[:KEY] (KEY defaults to "text"), e.g. squad
    /// questions exported from the HF dataset.
    #[arg(long, value_name = "NAME=PATH[:KEY]")]
    task_file: Vec<String>,
    /// Longest n-gram (window size in words).
    #[arg(long, default_value_t = 13)]
    max_ngram_size: usize,
    /// Task texts with fewer words are ignored.
    #[arg(long, default_value_t = 8)]
    min_ngram_size: usize,
    /// Pieces of at most this many characters are dropped.
    #[arg(long, default_value_t = 200)]
    filter_text_char_len: usize,
    /// N-grams found in at least this many training documents are kept as generic.
    #[arg(long, default_value_t = 10)]
    key_threshold: u64,
    /// Documents split into more pieces are dropped.
    #[arg(long, default_value_t = 10)]
    splits_count: usize,
    /// Characters removed on each side of a match (then widened to punctuation).
    #[arg(long, default_value_t = 200)]
    remove_char_each_side: usize,
}

impl NgramArgs {
    fn config(&self) -> NgramConfig {
        NgramConfig {
            max_ngram_size: self.max_ngram_size,
            min_ngram_size: self.min_ngram_size,
            filter_text_char_len: self.filter_text_char_len,
            key_threshold: self.key_threshold,
            splits_count: self.splits_count,
            remove_char_each_side: self.remove_char_each_side,
        }
    }

    fn sources(&self) -> Result<Vec<TaskSource>> {
        let mut files = Vec::new();
        for spec in &self.task_file {
            let (name, rest) = spec
                .split_once('=')
                .with_context(|| format!("--task-file {spec}: expected NAME=PATH[:KEY]"))?;
            let (path, key) = match rest.rsplit_once(':') {
                Some((p, k)) if !k.contains('/') => (p, k),
                _ => (rest, "text"),
            };
            files.push(TaskSource {
                name: name.into(),
                path: path.into(),
                key: key.into(),
            });
        }
        let mut sources = Vec::new();
        for task in &self.tasks {
            if let Some(s) = files.iter().find(|s| &s.name == task) {
                sources.push(s.clone());
            } else if task == "lambada" {
                let path = self
                    .lambada_path
                    .clone()
                    .context("task lambada needs --lambada-path")?;
                sources.push(TaskSource {
                    name: task.clone(),
                    path,
                    key: "text".into(),
                });
            } else {
                bail_usage!("task {task} needs its texts as a local file: --task-file {task}=PATH[:KEY] (the original downloaded them from the Hugging Face hub)");
            }
        }
        Ok(sources)
    }
}

#[derive(Subcommand)]
enum Command {
    /// blacklist_urls.py: filter the URLs of every *.txt in a directory.
    BlacklistUrls {
        /// Directory of URL lists (one URL per line, *.txt).
        url_dir: PathBuf,
        /// Output URL list, kept URLs in input order.
        out_file: PathBuf,
    },
    /// cleanup_dataset.py: fix text (ftfy-like), keep English documents of at least
    /// --min-tokens GPT-2 tokens.
    Cleanup {
        /// Input loose JSON (`-` for stdin).
        input: PathBuf,
        /// Output loose JSON (`-` for stdout).
        output: PathBuf,
        #[command(flatten)]
        gpt2: Gpt2Args,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// cleanup_fix_dataset.py: per input, DIR/<stem>_cleaned<ext> and DIR/<stem>_filtered<ext>.
    CleanupFix {
        /// Input loose JSON files.
        #[arg(long, num_args = 1.., required = true)]
        input_files: Vec<PathBuf>,
        /// remove_512, remove_256_javascript, remove_512_non_english, ftfy_fix_text,
        /// general_cleaning; the first applicable one (in this order) decides.
        #[arg(long, num_args = 1.., required = true)]
        tasks: Vec<String>,
        /// Directory for the outputs.
        #[arg(long)]
        output_path: PathBuf,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// find_duplicates.py: MinHash + LSH candidates, exact Jaccard > 0.5 pairs.
    FindDuplicates {
        /// Pairs of input file and id field, e.g. `cc.json url news.json adlr_id`.
        #[arg(long, num_args = 2.., required_unless_present = "load_fingerprints", value_name = "FILE KEY")]
        inputs: Vec<String>,
        /// Start from fingerprints saved by earlier runs (same --seed and --num-seeds); their
        /// input files must still be where they were, unchanged.
        #[arg(long, num_args = 1..)]
        load_fingerprints: Vec<PathBuf>,
        /// Save the fingerprints of every document (loaded and new) for later runs.
        #[arg(long)]
        save_fingerprints: Option<PathBuf>,
        /// Output: one `{main: [{other: similarity}, …]}` per line.
        #[arg(long)]
        output: PathBuf,
        #[command(flatten)]
        dedup: DedupArgs,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// group_duplicate_url.py: connected groups of ids with similarity >= threshold.
    GroupDuplicates {
        /// find-duplicates output (`-` for stdin).
        pairs: PathBuf,
        /// Output groups, `{"<n>": [ids…]}` per line.
        groups: PathBuf,
        /// Similarity threshold (the code's default 0.7; the README's 0.9 never was).
        #[arg(default_value_t = DEFAULT_GROUP_THRESHOLD)]
        threshold: f64,
    },
    /// remove_group_duplicates.py: keep the first document (in data order) of each group.
    RemoveDuplicates {
        /// group-duplicates output.
        groups: PathBuf,
        /// Data loose JSON (`-` for stdin).
        data: PathBuf,
        /// Output loose JSON (`-` for stdout).
        output: PathBuf,
        /// Id field matched against the groups.
        #[arg(long, default_value = "url")]
        key: String,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// filter_ngrams.py: remove downstream-task 13-grams with their surroundings.
    FilterNgrams {
        #[command(flatten)]
        ngrams: NgramArgs,
        /// Training file and its text field, e.g. `train.json text`.
        #[arg(long, num_args = 2, required = true, value_names = ["FILE", "KEY"])]
        dedup_dataset: Vec<String>,
        /// Output loose JSON (`-` for stdout); omit to only build/save the dictionary.
        #[arg(long)]
        output: Option<PathBuf>,
        /// Save the rare task n-grams (one per line) after the frequency pass.
        #[arg(long)]
        save_dictionary: Option<PathBuf>,
        /// Load rare task n-grams saved by --save-dictionary and skip the frequency pass.
        #[arg(long)]
        load_dictionary: Option<PathBuf>,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// merge_jsons.py: concatenate DIR/*.json (sorted by name), checking every line.
    MergeJsons {
        /// Directory of *.json files.
        #[arg(long = "json_path", alias = "json-path", default_value = ".")]
        json_path: PathBuf,
        /// Merged output.
        #[arg(
            long = "output_file",
            alias = "output-file",
            default_value = "merged_output.json"
        )]
        output_file: PathBuf,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// add_id.py: add adlr_id = "<prefix>-<10-digit counter>" to every document.
    AddId {
        /// Input loose JSON (`-` for stdin).
        #[arg(long)]
        input_file: PathBuf,
        /// Output loose JSON (`-` for stdout).
        #[arg(long)]
        output_file: PathBuf,
        /// Id prefix.
        #[arg(long)]
        id_prefix: String,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
    /// The whole pipeline over a directory of *.json/*.jsonl shards: merge, URL filter,
    /// cleanup, find/group/remove duplicates, and task n-gram filtering when --tasks given.
    Run {
        /// Directory of input shards.
        #[arg(long)]
        input_dir: PathBuf,
        /// Directory for the intermediate files of each step.
        #[arg(long)]
        work_dir: PathBuf,
        /// Final loose JSON.
        #[arg(long)]
        output: PathBuf,
        /// Document field holding the URL (also the dedup id).
        #[arg(long, default_value = "url")]
        url_key: String,
        #[command(flatten)]
        gpt2: Gpt2Args,
        #[command(flatten)]
        dedup: DedupArgs,
        /// Similarity threshold for grouping duplicates.
        #[arg(long, default_value_t = DEFAULT_GROUP_THRESHOLD)]
        group_threshold: f64,
        /// Task names for n-gram filtering (skipped when none).
        #[arg(long, num_args = 1..)]
        tasks: Vec<String>,
        /// LAMBADA test set for the lambada task.
        #[arg(long)]
        lambada_path: Option<PathBuf>,
        /// Local task texts: NAME=PATH[:KEY].
        #[arg(long, value_name = "NAME=PATH[:KEY]")]
        task_file: Vec<String>,
        #[command(flatten)]
        invalid: InvalidArgs,
    },
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| run(cli.command))
}

fn bar(step: &str, total: Option<u64>) -> ProgressBar {
    let bar = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    };
    let style = ProgressStyle::with_template(
        "{prefix:>18} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
    )
    .expect("static template")
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(step.to_string());
    bar
}

fn load_gpt2(args: &Gpt2Args) -> Result<Gpt2Bpe> {
    Gpt2Bpe::from_files(&args.vocab_file, &args.merge_file).context("loading the GPT-2 tokenizer")
}

fn report(step: &str, counts: &StepCounts, started: Instant) {
    eprintln!(
        "{step}: {} in {:.2}s",
        counts.summary(),
        started.elapsed().as_secs_f64()
    );
}

fn run(command: Command) -> Result<()> {
    let started = Instant::now();
    match command {
        Command::BlacklistUrls { url_dir, out_file } => {
            let b = ProgressBar::new_spinner();
            let counts = steps::blacklist_url_files(&url_dir, &out_file, &b)?;
            b.finish_and_clear();
            report("blacklist-urls", &counts, started);
        }
        Command::Cleanup {
            input,
            output,
            gpt2,
            invalid,
        } => {
            let tokenizer = load_gpt2(&gpt2)?;
            let cleanup = Cleanup {
                min_tokens: gpt2.min_tokens,
                tokens: &tokenizer,
            };
            let input = Input::from_arg(&input);
            let b = bar("cleanup", input.size_bytes());
            let counts = steps::cleanup_file(&input, &output, &cleanup, invalid.policy(), &b)?;
            b.finish_and_clear();
            report("cleanup", &counts, started);
        }
        Command::CleanupFix {
            input_files,
            tasks,
            output_path,
            invalid,
        } => {
            let tasks = tasks
                .iter()
                .map(|t| FixTask::parse(t).with_context(|| format!("unknown task {t}")))
                .collect::<Result<Vec<_>>>()?;
            for file in input_files {
                let b = bar("cleanup-fix", Input::File(file.clone()).size_bytes());
                let counts =
                    steps::cleanup_fix_file(&file, &output_path, &tasks, invalid.policy(), &b)?;
                b.finish_and_clear();
                report(&format!("cleanup-fix {}", file.display()), &counts, started);
            }
        }
        Command::FindDuplicates {
            inputs,
            load_fingerprints,
            save_fingerprints,
            output,
            dedup,
            invalid,
        } => {
            if !inputs.len().is_multiple_of(2) {
                bail!(
                    "--inputs takes pairs of FILE KEY, got {} values",
                    inputs.len()
                );
            }
            let pairs: Vec<(PathBuf, String)> = inputs
                .chunks(2)
                .map(|p| (PathBuf::from(&p[0]), p[1].clone()))
                .collect();
            let total = pairs
                .iter()
                .filter_map(|(p, _)| Input::File(p.clone()).size_bytes())
                .sum();
            let b = bar("find-duplicates", Some(total));
            let fingerprints = steps::FingerprintFiles {
                load: load_fingerprints,
                save: save_fingerprints,
            };
            let r = steps::find_duplicates_files(
                &pairs,
                &fingerprints,
                &output,
                &dedup.config(invalid.policy())?,
                &b,
            )?;
            b.finish_and_clear();
            eprintln!(
                "find-duplicates: {} documents, {} candidate buckets, {} similar pairs, index {:.1} MiB, {} invalid lines skipped, {:.2}s",
                r.documents,
                r.candidate_buckets,
                r.similar_pairs,
                r.index_bytes as f64 / (1 << 20) as f64,
                r.skipped_invalid,
                started.elapsed().as_secs_f64()
            );
        }
        Command::GroupDuplicates {
            pairs,
            groups,
            threshold,
        } => {
            let (ids, n) =
                steps::group_duplicates_file(&Input::from_arg(&pairs), &groups, threshold)?;
            eprintln!(
                "out of {ids} urls, only {n} are unique and {} should be removed",
                ids - n
            );
        }
        Command::RemoveDuplicates {
            groups,
            data,
            output,
            key,
            invalid,
        } => {
            let input = Input::from_arg(&data);
            let b = bar("remove-duplicates", input.size_bytes());
            let counts = steps::remove_duplicates_file(
                &Input::from_arg(&groups),
                &input,
                &output,
                &key,
                invalid.policy(),
                &b,
            )?;
            b.finish_and_clear();
            report("remove-duplicates", &counts, started);
        }
        Command::FilterNgrams {
            ngrams,
            dedup_dataset,
            output,
            save_dictionary,
            load_dictionary,
            invalid,
        } => {
            filter_ngrams(
                &ngrams,
                &dedup_dataset,
                output.as_deref(),
                save_dictionary.as_deref(),
                load_dictionary.as_deref(),
                invalid.policy(),
            )?;
        }
        Command::MergeJsons {
            json_path,
            output_file,
            invalid,
        } => {
            let counts = steps::merge_json_files(&json_path, &output_file, invalid.policy())?;
            report("merge-jsons", &counts, started);
        }
        Command::AddId {
            input_file,
            output_file,
            id_prefix,
            invalid,
        } => {
            let input = Input::from_arg(&input_file);
            let b = bar("add-id", input.size_bytes());
            let counts =
                steps::add_id_file(&input, &output_file, &id_prefix, invalid.policy(), &b)?;
            b.finish_and_clear();
            report("add-id", &counts, started);
        }
        Command::Run {
            input_dir,
            work_dir,
            output,
            url_key,
            gpt2,
            dedup,
            group_threshold,
            tasks,
            lambada_path,
            task_file,
            invalid,
        } => {
            let tokenizer = load_gpt2(&gpt2)?;
            let task_sources = if tasks.is_empty() {
                Vec::new()
            } else {
                NgramArgs {
                    tasks,
                    lambada_path,
                    task_file,
                    ..NgramArgs::defaults()
                }
                .sources()?
            };
            let config = PipelineConfig {
                shard_dir: input_dir,
                work_dir,
                output,
                url_key,
                cleanup: Cleanup {
                    min_tokens: gpt2.min_tokens,
                    tokens: &tokenizer,
                },
                dedup: dedup.config(invalid.policy())?,
                group_threshold,
                tasks: task_sources,
                ngrams: NgramConfig::default(),
                invalid: invalid.policy(),
            };
            let summary = run_pipeline(&config, &bar)?;
            eprintln!("documents in: {}", summary.documents_in);
            for (reason, n) in &summary.dropped {
                eprintln!("dropped ({reason}): {n}");
            }
            eprintln!(
                "kept: {} (dedup index {:.1} MiB) in {:.2}s",
                summary.kept,
                summary.dedup_index_bytes as f64 / (1 << 20) as f64,
                started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(())
}

impl NgramArgs {
    fn defaults() -> Self {
        let d = NgramConfig::default();
        Self {
            tasks: Vec::new(),
            lambada_path: None,
            task_file: Vec::new(),
            max_ngram_size: d.max_ngram_size,
            min_ngram_size: d.min_ngram_size,
            filter_text_char_len: d.filter_text_char_len,
            key_threshold: d.key_threshold,
            splits_count: d.splits_count,
            remove_char_each_side: d.remove_char_each_side,
        }
    }
}

fn filter_ngrams(
    args: &NgramArgs,
    dataset: &[String],
    output: Option<&Path>,
    save: Option<&Path>,
    load: Option<&Path>,
    invalid: InvalidLines,
) -> Result<()> {
    let started = Instant::now();
    let config = args.config();
    let (file, key) = (PathBuf::from(&dataset[0]), dataset[1].as_str());
    let input = Input::File(file);
    let rare = match load {
        Some(path) => {
            let reader = Input::File(path.to_path_buf()).open()?;
            let lines = reader
                .lines()
                .collect::<std::io::Result<Vec<_>>>()
                .with_context(|| format!("reading {}", path.display()))?;
            NgramSet::from_ngrams(lines.into_iter().filter(|l| !l.is_empty()))
        }
        None => {
            let task_set = steps::task_ngrams(&args.sources()?, &config)?;
            let b = bar("n-gram counts", input.size_bytes());
            let rare = steps::rare_task_ngrams(&task_set, &input, key, &config, invalid, &b)?;
            b.finish_and_clear();
            eprintln!(
                "filter-ngrams: {} task n-grams, {} below --key-threshold",
                task_set.len(),
                rare.len()
            );
            rare
        }
    };
    if let Some(path) = save {
        let mut out = AtomicOutput::create(path)?;
        for n in rare.sorted() {
            out.write_line(n)?;
        }
        out.finish()?;
    }
    if let Some(output) = output {
        let b = bar("filter-ngrams", input.size_bytes());
        let r = steps::filter_ngrams_file(
            &rare,
            &args.tasks,
            &input,
            key,
            output,
            &config,
            invalid,
            &b,
        )?;
        b.finish_and_clear();
        eprintln!(
            "filter-ngrams: {}; split {}, trimmed {}, pieces written {} in {:.2}s",
            r.counts.summary(),
            r.split,
            r.trimmed,
            r.pieces_written,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
