//! From Megatron's data flags (`--data-path`, per-split paths, `--split`) to data sources.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::builder::DataSources;
use super::data_path::Blend;

/// Megatron's `--split` when only `--data-path` is given.
pub const DEFAULT_SPLIT: &str = "969, 30, 1";

/// The data-path flags as given on the command line, shared by every binary that reads
/// Megatron datasets.
#[derive(Debug, Clone, Default, clap::Args, serde::Serialize)]
pub struct DataPathFlags {
    /// Dataset prefixes, optionally weighted: `A`, `A B`, or `0.3 A 0.7 B`.
    #[arg(long, num_args = 1.., value_name = "[WEIGHT] PREFIX")]
    pub data_path: Vec<String>,
    /// File whose whitespace-separated words are the --data-path list.
    #[arg(long)]
    pub data_args_path: Option<PathBuf>,
    /// Train-split prefixes (per-split mode; excludes --data-path and --split).
    #[arg(long, num_args = 1..)]
    pub train_data_path: Vec<String>,
    /// Validation-split prefixes (per-split mode).
    #[arg(long, num_args = 1..)]
    pub valid_data_path: Vec<String>,
    /// Test-split prefixes (per-split mode).
    #[arg(long, num_args = 1..)]
    pub test_data_path: Vec<String>,
    /// JSON {"train": [...], "valid": [...], "test": [...]} (per-split mode).
    #[arg(long)]
    pub per_split_data_args_path: Option<PathBuf>,
    /// Train/valid/test proportions, e.g. 949,50,1 (hashed verbatim into cache names)
    /// [default: 969, 30, 1].
    #[arg(long)]
    pub split: Option<String>,
}

impl DataPathFlags {
    /// True when any data path was given.
    pub fn any(&self) -> bool {
        !self.data_path.is_empty()
            || self.data_args_path.is_some()
            || self.per_split_lists().iter().any(|l| !l.is_empty())
            || self.per_split_data_args_path.is_some()
    }

    fn per_split_lists(&self) -> [&Vec<String>; 3] {
        [
            &self.train_data_path,
            &self.valid_data_path,
            &self.test_data_path,
        ]
    }

    /// The sources and the split string (`None` in per-split mode). A missing `--split` with
    /// `--data-path` falls back to Megatron's default, with a warning.
    pub fn sources(&self) -> Result<(DataSources, Option<String>)> {
        let per_split = self.per_split_lists().iter().any(|l| !l.is_empty())
            || self.per_split_data_args_path.is_some();
        let blend = !self.data_path.is_empty() || self.data_args_path.is_some();
        match (blend, per_split) {
            (true, true) => bail!("--data-path and per-split data paths are mutually exclusive"),
            (false, false) => {
                bail!("give --data-path (or --data-args-path) or per-split data paths")
            }
            (true, false) => {
                let blend = match &self.data_args_path {
                    Some(path) => Blend::from_args_file(path)?,
                    None => Blend::parse(&self.data_path).context("parsing --data-path")?,
                };
                let split = self.split.clone().unwrap_or_else(|| {
                    eprintln!(
                        "warning: --split not given, using \"{DEFAULT_SPLIT}\" like Megatron"
                    );
                    DEFAULT_SPLIT.to_string()
                });
                Ok((DataSources::Blend(blend), Some(split)))
            }
            (false, true) => {
                if self.split.is_some() {
                    bail!("--split cannot be combined with per-split data paths");
                }
                let blends = match &self.per_split_data_args_path {
                    Some(path) => Blend::per_split_from_json(path)?,
                    None => {
                        let parse = |list: &Vec<String>, flag: &str| -> Result<Option<Blend>> {
                            (!list.is_empty())
                                .then(|| {
                                    Blend::parse(list).with_context(|| format!("parsing {flag}"))
                                })
                                .transpose()
                        };
                        [
                            parse(&self.train_data_path, "--train-data-path")?,
                            parse(&self.valid_data_path, "--valid-data-path")?,
                            parse(&self.test_data_path, "--test-data-path")?,
                        ]
                    }
                };
                Ok((DataSources::PerSplit(blends), None))
            }
        }
    }
}
