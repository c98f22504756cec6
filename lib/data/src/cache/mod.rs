//! Megatron's index cache: a description text, its MD5 (the file-name prefix) and `.npy`
//! arrays, written so that a killed run never leaves a set that looks complete.

mod npy;
pub(crate) mod python_json;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use md5::{Digest, Md5};

pub use npy::{Dtype, IndexArray, NpyArray, NpyError};
pub use python_json::{python_float_repr, python_str_list_repr, python_str_of_json, PyJson};

/// Hex MD5 of a description text: the prefix of every cache file of that dataset.
pub fn description_hash(description: &str) -> String {
    Md5::digest(description.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The files of one cached dataset: `{dir}/{hash}-{class}-{split}-{affix}` (GPT, blends).
#[derive(Debug, Clone)]
pub struct CacheEntry {
    directory: PathBuf,
    base: String,
}

impl CacheEntry {
    pub fn new(directory: &Path, description_hash: &str, class: &str, split: &str) -> Self {
        CacheEntry {
            directory: directory.to_path_buf(),
            base: format!("{description_hash}-{class}-{split}"),
        }
    }

    /// `{dir}/{hash}-{class}-{affix}`: the masked-LM datasets keep the split out of the name
    /// (it is inside the hashed description).
    pub fn without_split(directory: &Path, description_hash: &str, class: &str) -> Self {
        CacheEntry {
            directory: directory.to_path_buf(),
            base: format!("{description_hash}-{class}"),
        }
    }

    pub fn path(&self, affix: &str) -> PathBuf {
        self.directory.join(format!("{}-{affix}", self.base))
    }

    /// Megatron's hit rule: every listed file exists.
    pub fn is_complete(&self, affixes: &[&str]) -> bool {
        affixes.iter().all(|affix| self.path(affix).is_file())
    }

    pub fn read_array(&self, affix: &str) -> Result<NpyArray> {
        let path = self.path(affix);
        NpyArray::read(&path).with_context(|| format!("reading cached index {}", path.display()))
    }

    /// Writes the arrays first and the description last, each through a temporary name, so a
    /// partial set is never mistaken for a hit by us (Megatron would need all files as well).
    pub fn write(&self, description: &str, arrays: &[(&str, &NpyArray)]) -> Result<()> {
        std::fs::create_dir_all(&self.directory)
            .with_context(|| format!("creating cache directory {}", self.directory.display()))?;
        for (affix, array) in arrays {
            write_atomically(&self.path(affix), &array.to_bytes())?;
        }
        write_atomically(&self.path("description.txt"), description.as_bytes())
    }
}

/// Writes `bytes` to `path` via a temporary sibling and a rename.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let file_name = path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?;
    let mut temporary_name = file_name.to_os_string();
    temporary_name.push(format!(".tmp{}", std::process::id()));
    let temporary = path.with_file_name(temporary_name);
    let result = (|| -> std::io::Result<()> {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn md5_of_known_text() {
        assert_eq!(description_hash(""), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(
            description_hash("The quick brown fox jumps over the lazy dog"),
            "9e107d9d372bb6826bd81d3542a419d6"
        );
    }

    #[test]
    fn written_entry_is_complete_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let entry = CacheEntry::new(dir.path(), "abc", "GPTDataset", "train");
        let affixes = ["description.txt", "document_index.npy"];
        assert!(!entry.is_complete(&affixes));
        let array = NpyArray::vector(IndexArray::I32(vec![3, 1, 2]));
        entry
            .write("{}", &[("document_index.npy", &array)])
            .unwrap();
        assert!(entry.is_complete(&affixes));
        assert_eq!(entry.read_array("document_index.npy").unwrap(), array);
        assert_eq!(
            entry.path("description.txt"),
            dir.path().join("abc-GPTDataset-train-description.txt")
        );
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .contains(".tmp")
            })
            .collect();
        assert!(leftovers.is_empty());
    }
}
