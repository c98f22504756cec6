use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{bin_path, idx_path, DType, IndexError, IndexHeader};

/// A Megatron indexed dataset opened read-only.
///
/// Both files are memory-mapped; token reads decode straight from the `.bin` mapping.
/// The `.idx` arrays start at byte 34 and are therefore unaligned, so the sequence lengths and
/// document indices are decoded once at open (4 bytes per sequence, 8 per document) into
/// owned vectors that can be handed out as plain slices; pointers are read in place.
/// Opening validates the whole index against the `.bin` size, so later reads cannot go
/// out of bounds for in-range indices.
#[derive(Debug)]
pub struct IndexedDataset {
    prefix: PathBuf,
    header: IndexHeader,
    multimodal: bool,
    lengths: Vec<i32>,
    document_indices: Vec<i64>,
    idx: Mmap,
    bin: Option<Mmap>,
}

fn map(path: &Path) -> Result<Option<Mmap>, IndexError> {
    let file = File::open(path).map_err(|e| IndexError::io(path, e))?;
    let len = file.metadata().map_err(|e| IndexError::io(path, e))?.len();
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: the mapping is read-only; as in every mmap-based reader (numpy's memmap in
    // Megatron included), a file truncated by another process while mapped is not supported.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| IndexError::io(path, e))?;
    Ok(Some(mmap))
}

fn le_i64(bytes: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

impl IndexedDataset {
    /// Opens `prefix.idx` and `prefix.bin`. Whether the optional multimodal modes array is
    /// present is inferred from the `.idx` size.
    pub fn open(path_prefix: impl AsRef<Path>) -> Result<Self, IndexError> {
        let prefix = path_prefix.as_ref().to_path_buf();
        let idx_file = idx_path(&prefix);
        let bin_file = bin_path(&prefix);
        let idx = map(&idx_file)?.ok_or_else(|| IndexError::Size {
            path: idx_file.clone(),
            reason: "file is empty".into(),
        })?;
        let header = IndexHeader::parse(&idx, &idx_file)?;
        let actual = idx.len() as u64;
        let multimodal = if header.file_len(false) == Some(actual) {
            false
        } else if header.file_len(true) == Some(actual) {
            true
        } else {
            return Err(IndexError::Size {
                path: idx_file,
                reason: format!(
                    "header declares {} sequences and {} document-index entries, which need {} bytes \
                     ({} with multimodal modes), but the file has {actual} bytes (truncated or corrupt)",
                    header.sequence_count,
                    header.document_index_len,
                    header.file_len(false).map_or("too many".into(), |n| n.to_string()),
                    header.file_len(true).map_or("too many".into(), |n| n.to_string()),
                ),
            });
        };
        let lengths = decode_lengths(&idx, &header, &idx_file)?;
        let document_indices = decode_document_indices(&idx, &header, &idx_file)?;
        let expected_bin = check_pointers(&idx, &header, &lengths, &idx_file)?;
        let bin = map(&bin_file)?;
        let bin_len = bin.as_ref().map_or(0, |m| m.len() as u64);
        if bin_len != expected_bin {
            return Err(IndexError::Size {
                path: bin_file,
                reason: format!(
                    "the index describes {expected_bin} bytes of {} tokens but the file has {bin_len} bytes",
                    header.dtype
                ),
            });
        }
        Ok(IndexedDataset {
            prefix,
            header,
            multimodal,
            lengths,
            document_indices,
            idx,
            bin,
        })
    }

    pub fn prefix(&self) -> &Path {
        &self.prefix
    }

    pub fn header(&self) -> &IndexHeader {
        &self.header
    }

    /// Number of sequences.
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Number of documents (document-index entries minus the leading 0).
    pub fn document_count(&self) -> usize {
        self.document_indices.len() - 1
    }

    pub fn dtype(&self) -> DType {
        self.header.dtype
    }

    pub fn is_multimodal(&self) -> bool {
        self.multimodal
    }

    /// Tokens per sequence.
    pub fn sequence_lengths(&self) -> &[i32] {
        &self.lengths
    }

    /// Sequence-index boundaries of the documents, starting with 0 and ending with `len()`.
    pub fn document_indices(&self) -> &[i64] {
        &self.document_indices
    }

    /// Byte offset of sequence `idx` in the `.bin` file.
    pub fn sequence_pointer(&self, idx: usize) -> u64 {
        assert!(
            idx < self.len(),
            "sequence {idx} out of range (dataset has {})",
            self.len()
        );
        le_i64(&self.idx, self.header.pointers_offset() + 8 * idx) as u64
    }

    /// Per-sequence modes of a multimodal dataset (0 = text, 1 = image), `None` otherwise.
    pub fn sequence_modes(&self) -> Option<&[i8]> {
        if !self.multimodal {
            return None;
        }
        let start = self.header.modes_offset();
        let bytes = &self.idx[start..start + self.len()];
        // SAFETY: i8 and u8 have the same size and alignment.
        Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<i8>(), bytes.len()) })
    }

    /// Total number of tokens in the `.bin` file.
    pub fn token_count(&self) -> u64 {
        self.bin.as_ref().map_or(0, |m| m.len() as u64) / self.dtype().size() as u64
    }

    /// The raw little-endian bytes of `length` tokens of sequence `idx` starting at `offset`.
    pub fn get_bytes(&self, idx: usize, offset: usize, length: Option<usize>) -> &[u8] {
        let seq_len = self.lengths.get(idx).copied().unwrap_or_else(|| {
            panic!(
                "sequence {idx} out of range (dataset {} has {})",
                self.prefix.display(),
                self.len()
            )
        }) as usize;
        assert!(
            offset <= seq_len,
            "offset {offset} beyond sequence {idx} of length {seq_len}"
        );
        let length = length.unwrap_or(seq_len - offset);
        assert!(
            offset + length <= seq_len,
            "reading {length} tokens at offset {offset} overruns sequence {idx} of length {seq_len}"
        );
        let size = self.dtype().size();
        let start = self.sequence_pointer(idx) as usize + offset * size;
        match &self.bin {
            Some(bin) => &bin[start..start + length * size],
            None => &[],
        }
    }

    /// Like Megatron's `get(idx, offset, length)`: `length` tokens (default: to the end of the
    /// sequence) of sequence `idx` starting at token `offset`, widened to i64.
    ///
    /// Panics if the range lies outside the sequence.
    pub fn get(&self, idx: usize, offset: usize, length: Option<usize>) -> Vec<i64> {
        let dtype = self.dtype();
        self.get_bytes(idx, offset, length)
            .chunks_exact(dtype.size())
            .map(|c| dtype.read_le(c))
            .collect()
    }

    /// The whole sequence `idx`.
    pub fn sequence(&self, idx: usize) -> Vec<i64> {
        self.get(idx, 0, None)
    }
}

fn decode_lengths(idx: &[u8], header: &IndexHeader, path: &Path) -> Result<Vec<i32>, IndexError> {
    let start = header.lengths_offset();
    let bytes = &idx[start..start + 4 * header.sequence_count as usize];
    let lengths: Vec<i32> = bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    if let Some(i) = lengths.iter().position(|&l| l < 0) {
        return Err(IndexError::Corrupt {
            path: path.into(),
            reason: format!("sequence {i} has negative length {}", lengths[i]),
        });
    }
    Ok(lengths)
}

fn decode_document_indices(
    idx: &[u8],
    header: &IndexHeader,
    path: &Path,
) -> Result<Vec<i64>, IndexError> {
    let start = header.document_indices_offset();
    let bytes = &idx[start..start + 8 * header.document_index_len as usize];
    let docs: Vec<i64> = bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let corrupt = |reason: String| IndexError::Corrupt {
        path: path.into(),
        reason,
    };
    if docs[0] != 0 {
        return Err(corrupt(format!(
            "document index starts with {}, not 0",
            docs[0]
        )));
    }
    if let Some(i) = docs.windows(2).position(|w| w[1] < w[0]) {
        return Err(corrupt(format!(
            "document index decreases at entry {}: {} after {}",
            i + 1,
            docs[i + 1],
            docs[i]
        )));
    }
    let last = *docs.last().unwrap();
    if last != header.sequence_count as i64 {
        return Err(corrupt(format!(
            "document index ends at {last} but there are {} sequences",
            header.sequence_count
        )));
    }
    Ok(docs)
}

/// Checks that every pointer equals the running byte total of the preceding sequences and
/// returns the `.bin` size the index implies.
fn check_pointers(
    idx: &[u8],
    header: &IndexHeader,
    lengths: &[i32],
    path: &Path,
) -> Result<u64, IndexError> {
    let size = header.dtype.size() as u64;
    let base = header.pointers_offset();
    let mut expected: u64 = 0;
    for (i, &len) in lengths.iter().enumerate() {
        let ptr = le_i64(idx, base + 8 * i);
        if ptr as u64 != expected {
            return Err(IndexError::Corrupt {
                path: path.into(),
                reason: format!("sequence {i} points to byte {ptr}, expected {expected}"),
            });
        }
        expected += len as u64 * size;
    }
    Ok(expected)
}

impl IndexedDataset {
    /// The whole `.bin` file.
    pub(crate) fn bin_bytes(&self) -> &[u8] {
        self.bin.as_deref().unwrap_or(&[])
    }
}
