use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::{bin_path, idx_path, DType, IndexError, IndexHeader, IndexedDataset};

/// An integer token id the builder accepts.
pub trait TokenId: Copy {
    fn to_i64(self) -> i64;
}

macro_rules! token_id {
    ($($t:ty),*) => {$(
        impl TokenId for $t {
            fn to_i64(self) -> i64 {
                self as i64
            }
        }
    )*};
}
token_id!(u8, i8, u16, i16, u32, i32, i64);

fn temp_name(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Streams a new indexed dataset to disk, like Megatron's `IndexedDatasetBuilder`.
///
/// Tokens go to `prefix.bin.tmp` as they arrive; `finalize` writes `prefix.idx.tmp` and
/// renames both into place, so an interrupted run never leaves a pair that looks complete.
/// Dropping an unfinished builder removes its temporary file.
pub struct IndexedDatasetBuilder {
    prefix: PathBuf,
    dtype: DType,
    multimodal: bool,
    bin: Option<BufWriter<File>>,
    bin_tmp: PathBuf,
    lengths: Vec<i32>,
    document_indices: Vec<i64>,
    modes: Vec<i8>,
    scratch: Vec<u8>,
}

impl IndexedDatasetBuilder {
    /// A text dataset at `prefix` (without `.bin`/`.idx`).
    pub fn new(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, IndexError> {
        Self::create(prefix.as_ref(), dtype, false)
    }

    /// A multimodal dataset: every sequence also records a mode byte.
    pub fn new_multimodal(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, IndexError> {
        Self::create(prefix.as_ref(), dtype, true)
    }

    fn create(prefix: &Path, dtype: DType, multimodal: bool) -> Result<Self, IndexError> {
        let bin_tmp = temp_name(&bin_path(prefix));
        let file = File::create(&bin_tmp).map_err(|e| IndexError::io(&bin_tmp, e))?;
        Ok(IndexedDatasetBuilder {
            prefix: prefix.to_path_buf(),
            dtype,
            multimodal,
            bin: Some(BufWriter::with_capacity(1 << 20, file)),
            bin_tmp,
            lengths: Vec::new(),
            document_indices: vec![0],
            modes: Vec::new(),
            scratch: Vec::new(),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sequences written so far.
    pub fn sequence_count(&self) -> usize {
        self.lengths.len()
    }

    /// Documents closed so far.
    pub fn document_count(&self) -> usize {
        self.document_indices.len() - 1
    }

    fn write_tokens<T: TokenId>(&mut self, tokens: &[T]) -> Result<(), IndexError> {
        self.scratch.clear();
        for &t in tokens {
            let value = t.to_i64();
            self.dtype
                .write_le(value, &mut self.scratch)
                .ok_or(IndexError::TokenOutOfRange {
                    value,
                    dtype: self.dtype,
                })?;
        }
        let bin = self.bin.as_mut().expect("builder used after finalize");
        bin.write_all(&self.scratch)
            .map_err(|e| IndexError::io(&self.bin_tmp, e))
    }

    fn push_length(&mut self, len: usize, mode: i8) -> Result<(), IndexError> {
        let len = i32::try_from(len).map_err(|_| {
            IndexError::Usage(format!(
                "a sequence of {len} tokens exceeds the format's i32 length"
            ))
        })?;
        self.lengths.push(len);
        if self.multimodal {
            self.modes.push(mode);
        }
        Ok(())
    }

    /// Appends one sequence (mode 0); it belongs to the current document until `end_document`.
    pub fn add_item<T: TokenId>(&mut self, tokens: &[T]) -> Result<(), IndexError> {
        self.add_item_with_mode(tokens, 0)
    }

    /// Appends one sequence with a multimodal mode (ignored for text datasets).
    pub fn add_item_with_mode<T: TokenId>(
        &mut self,
        tokens: &[T],
        mode: i8,
    ) -> Result<(), IndexError> {
        self.write_tokens(tokens)?;
        self.push_length(tokens.len(), mode)
    }

    /// Closes the current document (possibly empty).
    pub fn end_document(&mut self) {
        self.document_indices.push(self.lengths.len() as i64);
    }

    /// Appends a whole document: `tokens` cut into sequences of the given `lengths`.
    pub fn add_document<T: TokenId>(
        &mut self,
        tokens: &[T],
        lengths: &[usize],
    ) -> Result<(), IndexError> {
        let total: usize = lengths.iter().sum();
        if total != tokens.len() {
            return Err(IndexError::Usage(format!(
                "document lengths sum to {total} but {} tokens were given",
                tokens.len()
            )));
        }
        self.write_tokens(tokens)?;
        for &len in lengths {
            self.push_length(len, 0)?;
        }
        self.end_document();
        Ok(())
    }

    /// Appends every document of the dataset at `other_prefix`, copying its `.bin` verbatim.
    pub fn add_index(&mut self, other_prefix: impl AsRef<Path>) -> Result<(), IndexError> {
        let other = IndexedDataset::open(other_prefix.as_ref())?;
        if other.dtype() != self.dtype {
            return Err(IndexError::DTypeMismatch {
                other: other_prefix.as_ref().into(),
                expected: self.dtype,
                found: other.dtype(),
            });
        }
        if self.multimodal != other.is_multimodal() {
            return Err(IndexError::Usage(format!(
                "cannot append {}: it is {}multimodal but the output is {}",
                other_prefix.as_ref().display(),
                if other.is_multimodal() { "" } else { "not " },
                if self.multimodal {
                    "multimodal"
                } else {
                    "text only"
                },
            )));
        }
        let offset = self.lengths.len() as i64;
        self.lengths.extend_from_slice(other.sequence_lengths());
        self.document_indices
            .extend(other.document_indices()[1..].iter().map(|d| d + offset));
        if let Some(modes) = other.sequence_modes() {
            self.modes.extend_from_slice(modes);
        }
        let bin = self.bin.as_mut().expect("builder used after finalize");
        bin.write_all(other.bin_bytes())
            .map_err(|e| IndexError::io(&self.bin_tmp, e))
    }

    /// Writes the index and moves both files to their final names.
    pub fn finalize(mut self) -> Result<(), IndexError> {
        let bin = self.bin.take().expect("builder finalized twice");
        let result = self.publish(bin);
        if result.is_err() {
            let _ = fs::remove_file(&self.bin_tmp);
        }
        result
    }

    fn publish(&self, bin: BufWriter<File>) -> Result<(), IndexError> {
        bin.into_inner()
            .map_err(|e| IndexError::io(&self.bin_tmp, e.into_error()))?;
        let idx_final = idx_path(&self.prefix);
        let idx_tmp = temp_name(&idx_final);
        self.write_index(&idx_tmp)?;
        let bin_final = bin_path(&self.prefix);
        // Remove a previous index first: a new .bin beside an old .idx must never be visible.
        match fs::remove_file(&idx_final) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(IndexError::io(&idx_final, e))
            }
            _ => {}
        }
        fs::rename(&self.bin_tmp, &bin_final).map_err(|e| IndexError::io(&bin_final, e))?;
        fs::rename(&idx_tmp, &idx_final).map_err(|e| IndexError::io(&idx_final, e))
    }

    fn write_index(&self, path: &Path) -> Result<(), IndexError> {
        let header = IndexHeader {
            dtype: self.dtype,
            sequence_count: self.lengths.len() as u64,
            document_index_len: self.document_indices.len() as u64,
        };
        let io = |e| IndexError::io(path, e);
        let file = File::create(path).map_err(io)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let result = (|| {
            out.write_all(&header.to_bytes())?;
            for len in &self.lengths {
                out.write_all(&len.to_le_bytes())?;
            }
            let size = self.dtype.size() as i64;
            let mut pointer: i64 = 0;
            for &len in &self.lengths {
                out.write_all(&pointer.to_le_bytes())?;
                pointer += len as i64 * size;
            }
            for doc in &self.document_indices {
                out.write_all(&doc.to_le_bytes())?;
            }
            if self.multimodal {
                let modes: Vec<u8> = self.modes.iter().map(|&m| m as u8).collect();
                out.write_all(&modes)?;
            }
            out.flush()
        })();
        if let Err(e) = result {
            let _ = fs::remove_file(path);
            return Err(io(e));
        }
        Ok(())
    }
}

impl Drop for IndexedDatasetBuilder {
    fn drop(&mut self) {
        if self.bin.take().is_some() {
            let _ = fs::remove_file(&self.bin_tmp);
        }
    }
}
