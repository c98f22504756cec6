//! Finding a checkpoint's files: Megatron's tracker and `iter_XXXXXXX` directories (spec §5.1),
//! the `mp_rank_XX[_YYY]` rank directories, and what format a directory holds.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The formats a checkpoint directory can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Ours: safetensors shards and `metadata.json`.
    MegatronRs,
    /// Megatron `--ckpt-format torch`: `mp_rank_*/model_optim_rng.pt`.
    MegatronTorch,
    /// Megatron `--ckpt-format torch_dist`: `.metadata`, `*.distcp`, `common.pt`.
    TorchDist,
    /// A HuggingFace model directory: `config.json` with safetensors or `pytorch_model*.bin`.
    HuggingFace,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::MegatronRs => "megatron-rs",
            Format::MegatronTorch => "Megatron torch",
            Format::TorchDist => "Megatron torch_dist",
            Format::HuggingFace => "HuggingFace",
        }
    }
}

/// The iteration directory a checkpoint root points at: the tracker's `iter_XXXXXXX` or
/// `release`; a directory that already is an iteration directory is returned as is.
pub fn iteration_directory(root: &Path) -> Result<PathBuf> {
    let tracker = root.join("latest_checkpointed_iteration.txt");
    if !tracker.is_file() {
        return Ok(root.to_path_buf());
    }
    let text = std::fs::read_to_string(&tracker)
        .with_context(|| format!("reading {}", tracker.display()))?;
    let text = text.trim();
    let directory = if text == "release" {
        root.join("release")
    } else {
        let iteration: u64 = text.parse().with_context(|| {
            format!(
                "{}: expected an iteration number or \"release\", found {text:?}",
                tracker.display()
            )
        })?;
        root.join(format!("iter_{iteration:07}"))
    };
    if !directory.is_dir() {
        bail!(
            "{} names {} which does not exist",
            tracker.display(),
            directory.display()
        );
    }
    Ok(directory)
}

/// Detects the format of the checkpoint under `root` and returns it with the directory that
/// holds its files.
pub fn detect(root: &Path) -> Result<(Format, PathBuf)> {
    if !root.is_dir() {
        bail!("{}: no such checkpoint directory", root.display());
    }
    if root.join("config.json").is_file() {
        return Ok((Format::HuggingFace, root.to_path_buf()));
    }
    let directory = iteration_directory(root)?;
    if directory.join("metadata.json").is_file() && !directory.join(".metadata").is_file() {
        let text = std::fs::read_to_string(directory.join("metadata.json"))?;
        if text.contains("megatron-rs-safetensors") {
            return Ok((Format::MegatronRs, directory));
        }
    }
    if directory.join(".metadata").is_file() {
        return Ok((Format::TorchDist, directory));
    }
    if !rank_directories(&directory)?.is_empty() {
        return Ok((Format::MegatronTorch, directory));
    }
    bail!(
        "{}: not a checkpoint (no latest_checkpointed_iteration.txt, metadata.json, .metadata, mp_rank_* or config.json)",
        root.display()
    )
}

/// A model-parallel rank directory of a Megatron checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RankDirectory {
    pub tensor_rank: usize,
    pub pipeline_rank: usize,
    pub expert_rank: usize,
    pub path: PathBuf,
}

impl RankDirectory {
    /// Megatron names a rank `mp_rank_TT_EEE` where expert parallelism alone adds a number
    /// (pipeline parallel size 1), and `mp_rank_TT_PPP` where pipeline parallelism alone does:
    /// only the run's args tell them apart. This reads a two-number name as the former.
    pub fn second_number_as_expert_rank(&mut self) {
        if self.expert_rank == 0 {
            self.expert_rank = std::mem::take(&mut self.pipeline_rank);
        }
    }
}

/// `mp_rank_TT`, `mp_rank_TT_PPP` (or `mp_rank_TT_EEE`: see
/// [`RankDirectory::second_number_as_expert_rank`]) and `mp_rank_TT_PPP_EEE` directories,
/// sorted by (tensor, pipeline, expert) rank.
pub fn rank_directories(directory: &Path) -> Result<Vec<RankDirectory>> {
    let mut out = Vec::new();
    let entries =
        std::fs::read_dir(directory).with_context(|| format!("listing {}", directory.display()))?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("mp_rank_") else {
            continue;
        };
        let parts: Vec<&str> = rest.split('_').collect();
        let numbers: Option<Vec<usize>> = parts.iter().map(|p| p.parse().ok()).collect();
        match numbers.as_deref() {
            Some([tp]) => out.push(RankDirectory {
                tensor_rank: *tp,
                pipeline_rank: 0,
                expert_rank: 0,
                path: entry.path(),
            }),
            Some([tp, pp]) => out.push(RankDirectory {
                tensor_rank: *tp,
                pipeline_rank: *pp,
                expert_rank: 0,
                path: entry.path(),
            }),
            Some([tp, pp, ep]) => out.push(RankDirectory {
                tensor_rank: *tp,
                pipeline_rank: *pp,
                expert_rank: *ep,
                path: entry.path(),
            }),
            _ => {}
        }
    }
    out.sort();
    Ok(out)
}

/// The rank file of a Megatron torch checkpoint (`model_optim_rng.pt`, or HF's converter's
/// older `model_rng.pt`).
pub fn rank_file(rank: &RankDirectory) -> Result<PathBuf> {
    for name in ["model_optim_rng.pt", "model_rng.pt"] {
        let path = rank.path.join(name);
        if path.is_file() {
            return Ok(path);
        }
    }
    bail!("{}: no model_optim_rng.pt", rank.path.display())
}
