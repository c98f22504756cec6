//! The smallest and largest token id of a dataset, so that training can refuse a `.bin` whose
//! ids its embedding table does not have (which would otherwise fail deep inside libtorch) and
//! name the document. The scan reads the whole `.bin` once, in parallel; its outcome is cached
//! beside the GPT sampler's index caches, keyed by the `.bin` file's size and modification time.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use md5::{Digest, Md5};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::{bin_path, DType, IndexError, IndexedDataset};

/// Tokens per parallel work item.
const CHUNK_TOKENS: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRange {
    pub min: i64,
    pub max: i64,
}

/// A token id outside the vocabulary, where it was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfVocabulary {
    pub document: usize,
    pub sequence: usize,
    pub position: usize,
    pub id: i64,
}

/// What the cache file holds: the range and the `.bin` it was computed from.
#[derive(Serialize, Deserialize, PartialEq)]
struct CachedRange {
    bin_bytes: u64,
    modified_ns: u128,
    range: TokenRange,
}

fn fold(bytes: &[u8], dtype: DType) -> Option<TokenRange> {
    let size = dtype.size();
    bytes
        .par_chunks(CHUNK_TOKENS * size)
        .filter_map(|chunk| {
            chunk.chunks_exact(size).map(|t| dtype.read_le(t)).fold(
                None,
                |acc: Option<TokenRange>, id| {
                    Some(match acc {
                        None => TokenRange { min: id, max: id },
                        Some(r) => TokenRange {
                            min: r.min.min(id),
                            max: r.max.max(id),
                        },
                    })
                },
            )
        })
        .reduce_with(|a, b| TokenRange {
            min: a.min.min(b.min),
            max: a.max.max(b.max),
        })
}

impl IndexedDataset {
    /// The smallest and largest token id in the `.bin` (`None` when it holds no tokens).
    pub fn token_range(&self) -> Option<TokenRange> {
        if self.is_empty() {
            return None;
        }
        fold(self.bin_bytes(), self.dtype())
    }

    /// The first token id outside `0..vocab_size`, with its document.
    pub fn first_out_of_vocabulary(&self, vocab_size: usize) -> Option<OutOfVocabulary> {
        let documents = self.document_indices();
        (0..self.document_count()).find_map(|document| {
            let sequences = documents[document] as usize..documents[document + 1] as usize;
            sequences.into_iter().find_map(|sequence| {
                self.sequence(sequence)
                    .into_iter()
                    .enumerate()
                    .find(|&(_, id)| id < 0 || id as u64 >= vocab_size as u64)
                    .map(|(position, id)| OutOfVocabulary {
                        document,
                        sequence,
                        position,
                        id,
                    })
            })
        })
    }

    /// [`Self::token_range`], read from `cache_dir` when an earlier scan of the same `.bin`
    /// left it there, and stored there otherwise (a cache that cannot be written is skipped).
    pub fn cached_token_range(&self, cache_dir: &Path) -> Option<TokenRange> {
        let bin = bin_path(self.prefix());
        let stamp = std::fs::metadata(&bin).ok().and_then(|m| {
            let modified = m.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
            Some((m.len(), modified.as_nanos()))
        });
        let cache_file = range_cache_file(cache_dir, self.prefix());
        if let Some((bin_bytes, modified_ns)) = stamp {
            let cached = std::fs::read(&cache_file)
                .ok()
                .and_then(|b| serde_json::from_slice::<CachedRange>(&b).ok());
            if let Some(c) =
                cached.filter(|c| (c.bin_bytes, c.modified_ns) == (bin_bytes, modified_ns))
            {
                return Some(c.range);
            }
            let range = self.token_range()?;
            let entry = CachedRange {
                bin_bytes,
                modified_ns,
                range,
            };
            let _ = write_cache(&cache_file, &entry);
            return Some(range);
        }
        self.token_range()
    }

    /// Fails, naming the file and document, when a token id is not below `vocab_size`: the
    /// check training runs on every dataset it opens.
    pub fn check_token_ids(
        &self,
        vocab_size: usize,
        cache_dir: Option<&Path>,
    ) -> Result<(), IndexError> {
        // A uint16 file cannot hold an id the vocabulary lacks when it has 65536 or more.
        if (self.dtype() == DType::U16 && vocab_size > u16::MAX as usize)
            || (self.dtype() == DType::U8 && vocab_size > u8::MAX as usize)
        {
            return Ok(());
        }
        let range = match cache_dir {
            Some(dir) => self.cached_token_range(dir),
            None => self.token_range(),
        };
        let Some(range) = range else {
            return Ok(());
        };
        if range.min >= 0 && (range.max as u64) < vocab_size as u64 {
            return Ok(());
        }
        let found = self.first_out_of_vocabulary(vocab_size);
        Err(IndexError::OutOfVocabulary {
            path: bin_path(self.prefix()),
            vocab_size,
            found: match found {
                Some(f) => format!(
                    "token id {} in document {} (sequence {}, position {})",
                    f.id, f.document, f.sequence, f.position
                ),
                None => format!(
                    "token id {}",
                    if range.min < 0 { range.min } else { range.max }
                ),
            },
        })
    }
}

fn range_cache_file(cache_dir: &Path, prefix: &Path) -> PathBuf {
    let name = prefix
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let hash = format!("{:x}", Md5::digest(prefix.to_string_lossy().as_bytes()));
    cache_dir.join(format!("{name}-{hash}-token_range.json"))
}

fn write_cache(path: &Path, entry: &CachedRange) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temporary = path.with_extension("json.tmp");
    std::fs::write(&temporary, serde_json::to_vec(entry)?)?;
    std::fs::rename(&temporary, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::IndexedDatasetBuilder;

    fn dataset(dir: &Path, documents: &[&[i64]]) -> IndexedDataset {
        let prefix = dir.join("d");
        let mut builder = IndexedDatasetBuilder::new(&prefix, DType::U16).unwrap();
        for doc in documents {
            builder.add_document(*doc, &[doc.len()]).unwrap();
        }
        builder.finalize().unwrap();
        IndexedDataset::open(&prefix).unwrap()
    }

    #[test]
    fn ids_beyond_the_vocabulary_are_found_with_their_document() {
        let dir = tempfile::tempdir().unwrap();
        let data = dataset(dir.path(), &[&[1, 2, 3], &[4, 99, 5], &[7]]);
        assert_eq!(data.token_range(), Some(TokenRange { min: 1, max: 99 }));
        data.check_token_ids(100, None).unwrap();
        let error = data.check_token_ids(50, None).unwrap_err().to_string();
        assert!(
            error.contains("d.bin")
                && error.contains("token id 99 in document 1 (sequence 1, position 1)")
                && error.contains("vocabulary of 50"),
            "{error}"
        );
        // The range is cached and reused while the .bin is unchanged.
        let cache = dir.path().join("cache");
        assert_eq!(data.cached_token_range(&cache).unwrap().max, 99);
        let file = std::fs::read_dir(&cache)
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let mut entry: CachedRange =
            serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        entry.range.max = 7;
        std::fs::write(&file, serde_json::to_vec(&entry).unwrap()).unwrap();
        assert_eq!(data.cached_token_range(&cache).unwrap().max, 7);
    }
}
