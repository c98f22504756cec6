//! From Megatron's data flags (`--data-path`, per-split paths, `--split`) to data sources.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::builder::DataSources;
use super::data_path::Blend;

/// Megatron's `--split` when only `--data-path` is given.
pub const DEFAULT_SPLIT: &str = "969, 30, 1";

/// The data-path flags as given on the command line.
#[derive(Debug, Clone, Default)]
pub struct DataPathFlags {
    pub data_path: Vec<String>,
    pub data_args_path: Option<PathBuf>,
    pub train_data_path: Vec<String>,
    pub valid_data_path: Vec<String>,
    pub test_data_path: Vec<String>,
    pub per_split_data_args_path: Option<PathBuf>,
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
