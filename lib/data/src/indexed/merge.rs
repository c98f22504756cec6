use std::path::{Path, PathBuf};

use super::{IndexError, IndexedDataset, IndexedDatasetBuilder};

/// The dataset prefixes in `dir`, in the order `tools/merge_datasets.py` merges them
/// (lexicographic by file stem), plus the regular files that are not part of a dataset.
///
/// Megatron aborts on any stray file; here only `.bin`/`.idx` files count, and a `.bin`
/// without its `.idx` (or the reverse) is an error. Sub-directories are ignored.
pub fn prefixes_in_directory(dir: &Path) -> Result<(Vec<PathBuf>, Vec<PathBuf>), IndexError> {
    let entries = std::fs::read_dir(dir).map_err(|e| IndexError::io(dir, e))?;
    let mut stems = std::collections::BTreeSet::new();
    let mut ignored = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| IndexError::io(dir, e))?;
        let path = entry.path();
        if !path.is_file() {
            continue;
        }
        let ext = path.extension().and_then(|e| e.to_str());
        let partner = match ext {
            Some("bin") => "idx",
            Some("idx") => "bin",
            _ => {
                ignored.push(path);
                continue;
            }
        };
        if !path.with_extension(partner).is_file() {
            return Err(IndexError::Usage(format!(
                "{} has no matching .{partner} file",
                path.display()
            )));
        }
        let stem = path.file_stem().and_then(|s| s.to_str()).ok_or_else(|| {
            IndexError::Usage(format!("{}: file name is not UTF-8", path.display()))
        })?;
        stems.insert(stem.to_string());
    }
    ignored.sort();
    Ok((stems.into_iter().map(|s| dir.join(s)).collect(), ignored))
}

/// Merges the datasets `inputs`, in order, into `output_prefix`; the dtype comes from the
/// first input and every other input must match it.
pub fn merge_datasets(
    inputs: &[PathBuf],
    output_prefix: &Path,
    multimodal: bool,
) -> Result<(), IndexError> {
    let first = inputs
        .first()
        .ok_or_else(|| IndexError::Usage("no datasets to merge".into()))?;
    let dtype = IndexedDataset::open(first)?.dtype();
    let mut builder = if multimodal {
        IndexedDatasetBuilder::new_multimodal(output_prefix, dtype)?
    } else {
        IndexedDatasetBuilder::new(output_prefix, dtype)?
    };
    for prefix in inputs {
        builder.add_index(prefix)?;
    }
    builder.finalize()
}
