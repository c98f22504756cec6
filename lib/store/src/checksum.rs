//! Per-file checksums of a checkpoint: recorded under `checksums` in `metadata.json` when a save
//! is committed, verified when a file is read, so flipped bits on disk are an error naming the
//! file instead of a model that quietly answers "!!!". CRC-32C (hardware-accelerated, streamed
//! in 8 MiB blocks) detects corruption; it is no defence against deliberate tampering.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// The key in `metadata.json`.
pub const CHECKSUMS_KEY: &str = "checksums";

const ALGORITHM: &str = "crc32c";
const BLOCK: usize = 8 << 20;

static ENABLED: AtomicBool = AtomicBool::new(true);

/// Checksums of files this process wrote, taken from the bytes as they went out (with each
/// file's length), so that committing a save does not read every file back.
static WRITTEN: Mutex<BTreeMap<PathBuf, (u64, u32)>> = Mutex::new(BTreeMap::new());

/// Records the CRC-32C of the `len` bytes just written to `path`.
pub fn remember_written(path: &Path, len: u64, crc: u32) {
    WRITTEN
        .lock()
        .expect("checksum registry")
        .insert(path.to_path_buf(), (len, crc));
}

/// The checksum of `path`: the one recorded as it was written when its length still matches,
/// else read from the file.
fn checksum_of_written(path: &Path) -> Result<String> {
    let recorded = WRITTEN.lock().expect("checksum registry").remove(path);
    if let Some((len, crc)) = recorded {
        let on_disk = std::fs::metadata(path)
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        if on_disk == len {
            return Ok(format!("{ALGORITHM}:{crc:08x}"));
        }
    }
    file_checksum(path)
}

/// `--no-checkpoint-checksums`: saves record no checksums and loads verify none.
pub fn set_checksums_enabled(enabled: bool) {
    ENABLED.store(enabled, Ordering::Relaxed);
}

pub fn checksums_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Checksums by path relative to the iteration directory (`mp_rank_00/model.safetensors`),
/// each as `crc32c:0123abcd`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileChecksums(pub BTreeMap<String, String>);

/// The `checksums` section of a `metadata.json` (absent in checkpoints saved without them).
#[derive(Deserialize)]
struct Section {
    #[serde(default)]
    checksums: FileChecksums,
}

impl FileChecksums {
    /// Hashes every file under `directory` (its rank sub-directories), `metadata.json` aside;
    /// files this process wrote through [`remember_written`] are not read again.
    pub fn of_directory(directory: &Path, metadata_file: &str) -> Result<Self> {
        let mut sums = BTreeMap::new();
        let mut pending = vec![directory.to_path_buf()];
        while let Some(folder) = pending.pop() {
            for entry in std::fs::read_dir(&folder)
                .with_context(|| format!("listing {}", folder.display()))?
            {
                let path = entry
                    .with_context(|| format!("listing {}", folder.display()))?
                    .path();
                if path.is_dir() {
                    pending.push(path);
                    continue;
                }
                let relative = path
                    .strip_prefix(directory)
                    .expect("listed under the directory")
                    .to_string_lossy()
                    .into_owned();
                if relative != metadata_file {
                    sums.insert(relative, checksum_of_written(&path)?);
                }
            }
        }
        Ok(FileChecksums(sums))
    }

    /// The checksums recorded in the `metadata.json` at `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let section: Section = serde_json::from_str(&text)
            .with_context(|| format!("{}: invalid checksums", path.display()))?;
        Ok(section.checksums)
    }

    /// Checks `path` (`relative` inside the iteration directory) against its recorded checksum;
    /// files without one (older checkpoints) pass.
    pub fn verify(&self, relative: &str, path: &Path) -> Result<()> {
        let Some(expected) = self.0.get(relative) else {
            return Ok(());
        };
        let actual = file_checksum(path)?;
        if &actual != expected {
            bail!(
                "{} is corrupt: its checksum is {actual} but metadata.json recorded {expected} \
                 when it was saved (--no-checkpoint-checksums loads it anyway)",
                path.display()
            );
        }
        Ok(())
    }
}

/// `crc32c:xxxxxxxx` of a file's bytes, read in blocks.
pub fn file_checksum(path: &Path) -> Result<String> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut block = vec![0u8; BLOCK];
    let mut crc = 0u32;
    loop {
        let n = file
            .read(&mut block)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        crc = crc32c::crc32c_append(crc, &block[..n]);
    }
    Ok(format!("{ALGORITHM}:{crc:08x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_changed_byte_is_caught_and_the_file_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("mp_rank_00")).unwrap();
        let file = dir.path().join("mp_rank_00/model.safetensors");
        let bytes: Vec<u8> = (0..(BLOCK + 1000)).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&file, &bytes).unwrap();
        std::fs::write(dir.path().join("metadata.json"), "{}").unwrap();
        let sums = FileChecksums::of_directory(dir.path(), "metadata.json").unwrap();
        assert_eq!(
            sums.0.keys().collect::<Vec<_>>(),
            ["mp_rank_00/model.safetensors"]
        );
        assert_eq!(
            sums.0["mp_rank_00/model.safetensors"],
            format!("crc32c:{:08x}", crc32c::crc32c(&bytes))
        );
        sums.verify("mp_rank_00/model.safetensors", &file).unwrap();
        let mut corrupted = bytes;
        corrupted[BLOCK + 10] ^= 1;
        std::fs::write(&file, &corrupted).unwrap();
        let error = sums
            .verify("mp_rank_00/model.safetensors", &file)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("mp_rank_00/model.safetensors is corrupt"),
            "{error}"
        );
        // A file the metadata does not list (an older checkpoint) is not checked.
        FileChecksums::default()
            .verify("mp_rank_00/model.safetensors", &file)
            .unwrap();
    }
}
