//! From Megatron's data flags (`--data-path`, per-split paths, `--split`) to data sources.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use super::builder::DataSources;
use super::data_path::Blend;
use super::trained_on::TrainedOn;

/// Megatron's `--split` when only `--data-path` is given.
pub const DEFAULT_SPLIT: &str = "969, 30, 1";

/// The data-path flags as given on the command line, shared by every binary that reads
/// Megatron datasets.
#[derive(Debug, Clone, Default, clap::Args, serde::Serialize)]
pub struct DataPathFlags {
    /// Dataset prefixes, optionally weighted: `A`, `A B`, or `0.3 A 0.7 B`.
    #[arg(long, num_args = 1.., value_name = "[WEIGHT] PREFIX", action = clap::ArgAction::Set)]
    pub data_path: Vec<String>,
    /// File whose whitespace-separated words are the --data-path list.
    #[arg(long)]
    pub data_args_path: Option<PathBuf>,
    /// Train-split prefixes (per-split mode; excludes --data-path and --split).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub train_data_path: Vec<String>,
    /// Validation-split prefixes (per-split mode).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub valid_data_path: Vec<String>,
    /// Test-split prefixes (per-split mode).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
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
        let resolved = self.resolve()?;
        if self.split.is_none() && resolved.1.is_some() {
            eprintln!("warning: --split not given, using \"{DEFAULT_SPLIT}\" like Megatron");
        }
        Ok(resolved)
    }

    /// What the run trains on, for its checkpoints.
    pub fn trained_on(&self) -> Result<TrainedOn> {
        let (sources, split) = self.resolve()?;
        TrainedOn::of(&sources, split.as_deref())
    }

    /// [`Self::sources`], silently.
    fn resolve(&self) -> Result<(DataSources, Option<String>)> {
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
                let split = self
                    .split
                    .clone()
                    .unwrap_or_else(|| DEFAULT_SPLIT.to_string());
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::blend::{SplitShare, WeightedPrefix};

    /// Parsed as every binary parses: a repeated flag overrides itself, as in argparse.
    #[derive(Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        paths: DataPathFlags,
    }

    fn parse(args: &[&str]) -> DataPathFlags {
        Cli::try_parse_from(std::iter::once("test").chain(args.iter().copied()))
            .unwrap()
            .paths
    }

    fn prefix(prefix: &str, weight: Option<f64>) -> WeightedPrefix {
        WeightedPrefix {
            prefix: prefix.to_string(),
            weight,
        }
    }

    #[test]
    fn a_repeated_list_flag_takes_its_last_list_like_argparse() {
        let flags = parse(&["--data-path", "a", "b", "--data-path", "3", "c", "1", "d"]);
        assert_eq!(flags.data_path, ["3", "c", "1", "d"]);
        let flags = parse(&[
            "--train-data-path",
            "a",
            "--valid-data-path",
            "v",
            "--train-data-path",
            "b",
            "c",
        ]);
        assert_eq!(flags.train_data_path, ["b", "c"]);
        assert_eq!(flags.valid_data_path, ["v"]);
        for flag in ["--test-data-path", "--valid-data-path"] {
            let flags = parse(&[flag, "x", "y", flag, "z"]);
            let list = if flag == "--test-data-path" {
                flags.test_data_path
            } else {
                flags.valid_data_path
            };
            assert_eq!(list, ["z"], "{flag}");
        }
    }

    #[test]
    fn what_is_trained_on_is_the_resolved_blend_and_split() {
        let flags = parse(&["--data-path", "3", "c", "1", "d", "--split", "90,8,2"]);
        let trained = flags.trained_on().unwrap();
        let TrainedOn::Blend {
            data_path,
            split,
            splits,
        } = &trained
        else {
            panic!("{trained:?}");
        };
        assert_eq!(
            *data_path,
            [prefix("c", Some(0.75)), prefix("d", Some(0.25))]
        );
        assert_eq!(split, "90,8,2");
        let shares: Vec<(&str, f64, f64)> = splits
            .iter()
            .map(|SplitShare { split, begin, end }| (split.as_str(), *begin, *end))
            .collect();
        assert_eq!(
            shares,
            [
                ("train", 0.0, 0.9),
                ("valid", 0.9, 0.98),
                ("test", 0.98, 1.0)
            ]
        );
        assert_eq!(
            serde_json::to_value(&trained).unwrap()["data_path"][0],
            serde_json::json!({"prefix": "c", "weight": 0.75})
        );

        let flags = parse(&["--data-path", "only"]);
        let TrainedOn::Blend {
            data_path,
            split,
            splits,
        } = flags.trained_on().unwrap()
        else {
            panic!()
        };
        assert_eq!(data_path, [prefix("only", Some(1.0))]);
        assert_eq!((split.as_str(), splits.len()), (DEFAULT_SPLIT, 3));

        let flags = parse(&["--train-data-path", "a", "b", "--test-data-path", "t"]);
        assert_eq!(
            flags.trained_on().unwrap(),
            TrainedOn::PerSplit {
                train_data_path: Some(vec![prefix("a", None), prefix("b", None)]),
                valid_data_path: None,
                test_data_path: Some(vec![prefix("t", Some(1.0))]),
            }
        );
    }
}
