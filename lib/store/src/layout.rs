//! Megatron's checkpoint directory layout (spec §5.1): a tracker file naming the latest
//! iteration, one directory per saved iteration, one sub-directory per model-parallel rank.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";

/// What the tracker file points at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrackedCheckpoint {
    Iteration(u64),
    /// A `release` checkpoint (converted weights): loaded like `--finetune`.
    Release,
}

impl TrackedCheckpoint {
    pub fn directory(self, root: &Path) -> PathBuf {
        match self {
            TrackedCheckpoint::Iteration(iteration) => iteration_directory(root, iteration),
            TrackedCheckpoint::Release => root.join("release"),
        }
    }
}

/// `iter_0000500`.
pub fn iteration_directory(root: &Path, iteration: u64) -> PathBuf {
    root.join(format!("iter_{iteration:07}"))
}

/// The iterations of the `iter_NNNNNNN` directories under `root` (whatever they hold), newest
/// first; none when `root` does not exist.
pub fn saved_iterations(root: &Path) -> Result<Vec<u64>> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", root.display())),
    };
    let mut iterations: Vec<u64> = entries
        .flatten()
        .filter(|entry| entry.path().is_dir())
        .filter_map(|entry| {
            let name = entry.file_name();
            let digits = name.to_str()?.strip_prefix("iter_")?;
            let iteration = digits.parse().ok()?;
            (iteration_directory(root, iteration) == entry.path()).then_some(iteration)
        })
        .collect();
    iterations.sort_unstable_by(|a, b| b.cmp(a));
    Ok(iterations)
}

/// `mp_rank_00` without pipeline parallelism, `mp_rank_01_003` with it.
pub fn rank_directory_name(
    tensor_rank: usize,
    pipeline_rank: usize,
    pipeline_size: usize,
) -> String {
    if pipeline_size == 1 {
        format!("mp_rank_{tensor_rank:02}")
    } else {
        format!("mp_rank_{tensor_rank:02}_{pipeline_rank:03}")
    }
}

/// Reads the tracker; `None` when there is no checkpoint under `root`.
pub fn read_tracker(root: &Path) -> Result<Option<TrackedCheckpoint>> {
    let path = root.join(TRACKER_FILE);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let text = text.trim();
    if text == "release" {
        return Ok(Some(TrackedCheckpoint::Release));
    }
    match text.parse::<u64>() {
        Ok(iteration) => Ok(Some(TrackedCheckpoint::Iteration(iteration))),
        Err(_) => bail!(
            "{}: expected an iteration number or \"release\", found {text:?}",
            path.display()
        ),
    }
}

/// Points the tracker at `iteration`, atomically (temporary file, fsync, rename).
pub fn write_tracker(root: &Path, iteration: u64) -> Result<()> {
    let path = root.join(TRACKER_FILE);
    let temporary = root.join(format!(".{TRACKER_FILE}.tmp-{}", std::process::id()));
    fs::write(&temporary, iteration.to_string())
        .with_context(|| format!("writing {}", temporary.display()))?;
    fs::File::open(&temporary)
        .and_then(|file| file.sync_all())
        .with_context(|| format!("syncing {}", temporary.display()))?;
    fs::rename(&temporary, &path)
        .with_context(|| format!("renaming {} to {}", temporary.display(), path.display()))?;
    sync_directory(root)
}

/// Makes renames inside `dir` durable.
pub fn sync_directory(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tracker_follow_megatron() {
        assert_eq!(
            iteration_directory(Path::new("ckpt"), 500),
            Path::new("ckpt/iter_0000500")
        );
        assert_eq!(rank_directory_name(0, 0, 1), "mp_rank_00");
        assert_eq!(rank_directory_name(1, 3, 4), "mp_rank_01_003");
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read_tracker(dir.path()).unwrap(), None);
        write_tracker(dir.path(), 42).unwrap();
        assert_eq!(
            read_tracker(dir.path()).unwrap(),
            Some(TrackedCheckpoint::Iteration(42))
        );
        fs::write(dir.path().join(TRACKER_FILE), "release\n").unwrap();
        assert_eq!(
            read_tracker(dir.path()).unwrap(),
            Some(TrackedCheckpoint::Release)
        );
        for name in [
            "iter_0000005",
            "iter_0000020",
            "iter_12",
            "iter_x",
            "release",
        ] {
            fs::create_dir(dir.path().join(name)).unwrap();
        }
        fs::write(dir.path().join("iter_0000030"), "a file").unwrap();
        assert_eq!(saved_iterations(dir.path()).unwrap(), [20, 5]);
        fs::write(dir.path().join(TRACKER_FILE), "soon").unwrap();
        assert!(read_tracker(dir.path())
            .unwrap_err()
            .to_string()
            .contains("soon"));
    }
}
