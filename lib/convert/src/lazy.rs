//! Tensors of a checkpoint being converted, read from their files only when a saver asks for
//! them, and then in pieces of whole rows ([`LazyTensor::for_each_chunk`]), so that a
//! conversion holds about [`CHUNK_BYTES`] of tensor data whatever the size of the model and of
//! its largest tensor. A lazy tensor knows its shape and kind up front (savers write file
//! headers before any data) and how to assemble any range of its rows: bytes at an offset of
//! an input file, pieces of a flat optimizer buffer, tensor-parallel shards joined, a shard's
//! row ranges or columns, or a tensor already in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::{DType, TensorRef, TorchFile};
use tch::{Device, Kind, Tensor};

use super::progress::report_written;
use super::tensors::{fit_vocab_rows, kind_of, tensor_from_bytes};
use megatron_store::{cpu_bytes, join_shards, take_shard, TensorSplit};

/// Bytes of tensor data a streamed read ([`LazyTensor::for_each_chunk`]) reads, converts and
/// hands on at a time: what bounds a conversion's memory.
pub const CHUNK_BYTES: usize = 4 << 20;

/// Runs libtorch's operators on the calling thread only. A conversion is bound by memory and
/// disk bandwidth: its copies gain nothing from libtorch's OpenMP workers, which busy-wait
/// between them and take the cores that the background file writers need (a third of the
/// CPU time of a reshape on two cores).
pub fn use_one_torch_thread() {
    tch::set_num_threads(1);
}

/// Hands the allocator's free memory back to the system. A conversion allocates and frees
/// chunk-sized buffers of many sizes; glibc keeps freed blocks in its heaps (a hundred MiB or
/// more of them by the end of a large tensor), which would make peak memory grow with the
/// largest tensor after all. Called once a large tensor is done: within a tensor, buffers of
/// one size are reused without new page faults.
pub(crate) fn return_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free pages of the allocator's heaps.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// An input file read with positioned reads: nothing of it stays resident after a read
/// (a memory map would keep every touched page in the process's resident set).
pub struct InputFile {
    path: PathBuf,
    file: File,
    len: u64,
}

impl InputFile {
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        Ok(Arc::new(InputFile {
            path: path.to_path_buf(),
            file,
            len,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fills `buffer` from `offset`.
    pub fn read_at(&self, buffer: &mut [u8], offset: u64) -> Result<()> {
        ensure!(
            offset + buffer.len() as u64 <= self.len,
            "{}: {} bytes at offset {offset} run past its end ({} bytes; truncated?)",
            self.path.display(),
            buffer.len(),
            self.len
        );
        self.file
            .read_exact_at(buffer, offset)
            .with_context(|| format!("reading {}", self.path.display()))
    }
}

enum Source {
    Memory(Tensor),
    /// C-order little-endian bytes at `offset` of `file`.
    File {
        file: Arc<InputFile>,
        offset: u64,
    },
    /// 1-D pieces of one flat buffer, concatenated (a distributed optimizer's shards).
    Concat(Vec<LazyTensor>),
    /// Tensor-parallel shards joined in rank order.
    Joined {
        shards: Vec<LazyTensor>,
        split: TensorSplit,
    },
    /// Another tensor with its rows cut or padded with zeros (the padded vocabulary).
    Rows(Box<LazyTensor>),
    /// Row ranges `(tensor, start, count)` of other tensors, stacked in order (a row-parallel
    /// shard, fused projections).
    RowRanges(Vec<(LazyTensor, i64, i64)>),
    /// Columns `start..start + count` of another tensor (a column-parallel shard).
    Columns {
        inner: Box<LazyTensor>,
        start: i64,
        count: i64,
    },
    /// Made from other tensors (a HuggingFace import's fused projections).
    Derived {
        inputs: Vec<LazyTensor>,
        make: Arc<dyn Fn(&[Tensor]) -> Tensor + Send + Sync>,
    },
}

/// A tensor known by shape and kind, read on demand.
pub struct LazyTensor {
    shape: Vec<i64>,
    kind: Kind,
    source: Source,
}

impl Clone for LazyTensor {
    fn clone(&self) -> Self {
        let source = match &self.source {
            Source::Memory(t) => Source::Memory(t.shallow_clone()),
            Source::File { file, offset } => Source::File {
                file: file.clone(),
                offset: *offset,
            },
            Source::Concat(pieces) => Source::Concat(pieces.clone()),
            Source::Joined { shards, split } => Source::Joined {
                shards: shards.clone(),
                split: *split,
            },
            Source::Rows(inner) => Source::Rows(inner.clone()),
            Source::RowRanges(ranges) => Source::RowRanges(ranges.clone()),
            Source::Columns {
                inner,
                start,
                count,
            } => Source::Columns {
                inner: inner.clone(),
                start: *start,
                count: *count,
            },
            Source::Derived { inputs, make } => Source::Derived {
                inputs: inputs.clone(),
                make: make.clone(),
            },
        };
        LazyTensor {
            shape: self.shape.clone(),
            kind: self.kind,
            source,
        }
    }
}

impl std::fmt::Debug for LazyTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LazyTensor({:?}, {:?})", self.kind, self.shape)
    }
}

impl From<Tensor> for LazyTensor {
    fn from(tensor: Tensor) -> Self {
        LazyTensor {
            shape: tensor.size(),
            kind: tensor.kind(),
            source: Source::Memory(tensor),
        }
    }
}

impl LazyTensor {
    /// `shape` of `dtype` stored at `offset` of `file`.
    pub fn in_file(
        file: &Arc<InputFile>,
        offset: u64,
        dtype: DType,
        shape: Vec<i64>,
    ) -> Result<Self> {
        let tensor = LazyTensor {
            shape,
            kind: kind_of(dtype)?,
            source: Source::File {
                file: file.clone(),
                offset,
            },
        };
        ensure!(
            offset + tensor.bytes() as u64 <= file.len(),
            "{}: a {dtype} tensor of shape {:?} at offset {offset} runs past the end of the file ({} bytes)",
            file.path().display(),
            tensor.shape,
            file.len()
        );
        Ok(tensor)
    }

    /// Elements `start..start + len` of this tensor taken flat, viewed as `shape`: a parameter
    /// inside an optimizer's flat buffer, one layer of a stacked tensor.
    pub fn flat_slice(&self, start: i64, len: i64, shape: Vec<i64>) -> Result<Self> {
        ensure!(
            shape.iter().product::<i64>() == len && start >= 0 && start + len <= self.numel(),
            "elements {start}..{} of a buffer of {} as shape {shape:?}",
            start + len,
            self.numel()
        );
        let element = self.kind.elt_size_in_bytes() as u64;
        let source = match &self.source {
            Source::File { file, offset } => Source::File {
                file: file.clone(),
                offset: offset + start as u64 * element,
            },
            Source::Concat(pieces) => {
                let mut inside = Vec::new();
                let mut at = 0;
                for piece in pieces {
                    let n = piece.numel();
                    let (lo, hi) = (start.max(at), (start + len).min(at + n));
                    if lo < hi {
                        inside.push(piece.flat_slice(lo - at, hi - lo, vec![hi - lo])?);
                    }
                    at += n;
                }
                Source::Concat(inside)
            }
            _ => Source::Memory(
                self.read()?
                    .reshape([-1])
                    .narrow(0, start, len)
                    .reshape(shape.as_slice()),
            ),
        };
        Ok(LazyTensor {
            shape,
            kind: self.kind,
            source,
        })
    }

    /// The concatenation of 1-D `pieces` of one kind, viewed as `shape`.
    pub fn concat(pieces: Vec<LazyTensor>, shape: Vec<i64>) -> Result<Self> {
        let kind = pieces.first().map_or(Kind::Float, |p| p.kind);
        ensure!(
            pieces.iter().all(|p| p.kind == kind)
                && pieces.iter().map(LazyTensor::numel).sum::<i64>()
                    == shape.iter().product::<i64>(),
            "pieces of {} elements do not make a tensor of shape {shape:?}",
            pieces.iter().map(LazyTensor::numel).sum::<i64>()
        );
        Ok(LazyTensor {
            shape,
            kind,
            source: Source::Concat(pieces),
        })
    }

    /// Tensor-parallel `shards` (rank order) joined along `split`.
    pub fn joined(shards: Vec<LazyTensor>, split: TensorSplit) -> Result<Self> {
        let first = shards.first().context("no shards to join")?;
        let mut shape = first.shape.clone();
        let kind = first.kind;
        ensure!(
            shards.iter().all(|s| s.shape == shape && s.kind == kind),
            "tensor-parallel shards of different shapes or kinds: {:?}",
            shards
        );
        match split {
            TensorSplit::Replicated => {}
            TensorSplit::Rows { .. } => shape[0] *= shards.len() as i64,
            TensorSplit::Columns => shape[1] *= shards.len() as i64,
        }
        Ok(LazyTensor {
            shape,
            kind,
            source: Source::Joined { shards, split },
        })
    }

    /// Row ranges `(tensor, start, count)` of tensors of one kind and row shape, stacked.
    pub fn row_ranges(ranges: Vec<(LazyTensor, i64, i64)>) -> Result<Self> {
        let (first, _, _) = ranges.first().context("no row ranges to stack")?;
        let (kind, row) = (
            first.kind,
            first.shape.get(1..).unwrap_or_default().to_vec(),
        );
        for (tensor, start, count) in &ranges {
            ensure!(
                tensor.kind == kind
                    && tensor.shape.get(1..) == Some(row.as_slice())
                    && *start >= 0
                    && *count >= 0
                    && start + count <= tensor.shape[0],
                "rows {start}..{} of {tensor:?} stacked with rows of shape {row:?}",
                start + count
            );
        }
        let shape = std::iter::once(ranges.iter().map(|(_, _, count)| count).sum())
            .chain(row)
            .collect();
        Ok(LazyTensor {
            shape,
            kind,
            source: Source::RowRanges(ranges),
        })
    }

    /// Columns `start..start + count` of this tensor.
    pub fn columns(self, start: i64, count: i64) -> Result<Self> {
        ensure!(
            self.shape.len() >= 2 && start >= 0 && start + count <= self.shape[1],
            "columns {start}..{} of {self:?}",
            start + count
        );
        let mut shape = self.shape.clone();
        shape[1] = count;
        Ok(LazyTensor {
            shape,
            kind: self.kind,
            source: Source::Columns {
                inner: Box::new(self),
                start,
                count,
            },
        })
    }

    /// A tensor of `shape` made by `make` from `inputs` (of one kind) when read.
    pub fn derived(
        inputs: Vec<LazyTensor>,
        shape: Vec<i64>,
        make: Arc<dyn Fn(&[Tensor]) -> Tensor + Send + Sync>,
    ) -> Result<Self> {
        let kind = inputs
            .first()
            .context("a derived tensor needs inputs")?
            .kind;
        ensure!(
            inputs.iter().all(|i| i.kind == kind),
            "inputs of different kinds: {inputs:?}"
        );
        Ok(LazyTensor {
            shape,
            kind,
            source: Source::Derived { inputs, make },
        })
    }

    /// This tensor with `rows` rows: cut, or padded with zero rows.
    pub fn with_rows(self, rows: i64) -> Self {
        if self.shape[0] == rows {
            return self;
        }
        let mut shape = self.shape.clone();
        shape[0] = rows;
        LazyTensor {
            shape,
            kind: self.kind,
            source: Source::Rows(Box::new(self)),
        }
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    pub fn bytes(&self) -> usize {
        self.numel() as usize * self.kind.elt_size_in_bytes()
    }

    /// Tensor-parallel rank `rank`'s shard (of `size`) along `split` of this tensor with its
    /// rows first cut or padded to `rows`, as a lazy tensor that reads only what the shard
    /// needs: a source shard that is already the target one, row ranges, or columns.
    pub fn shard(
        &self,
        split: TensorSplit,
        rank: usize,
        size: usize,
        rows: Option<i64>,
    ) -> Result<LazyTensor> {
        let rows_kept = rows.is_none_or(|r| r == self.shape[0]);
        match &self.source {
            Source::Rows(inner) if rows == Some(inner.shape[0]) => {
                return inner.shard(split, rank, size, None)
            }
            Source::Joined {
                shards,
                split: joined,
            } if rows_kept && *joined == split && shards.len() == size => {
                return Ok(shards[rank].clone())
            }
            Source::Joined { shards, .. } if rows_kept && shards.len() == 1 => {
                return shards[0].shard(split, rank, size, None)
            }
            _ => {}
        }
        let full = match rows {
            Some(rows) => self.clone().with_rows(rows),
            None => self.clone(),
        };
        let (rank, size) = (rank as i64, size as i64);
        match split {
            TensorSplit::Replicated => Ok(full),
            TensorSplit::Columns if full.shape.len() >= 2 && full.shape[1] % size == 0 => {
                let count = full.shape[1] / size;
                full.columns(rank * count, count)
            }
            TensorSplit::Rows { stride }
                if !full.shape.is_empty() && full.shape[0] % (stride * size) == 0 =>
            {
                let part = full.shape[0] / stride;
                let count = part / size;
                LazyTensor::row_ranges(
                    (0..stride)
                        .map(|p| (full.clone(), p * part + rank * count, count))
                        .collect(),
                )
            }
            // Uneven parts: cut as torch's chunk does, from the whole tensor.
            _ => Ok(take_shard(&full.read()?, split, rank as usize, size as usize).into()),
        }
    }

    /// Can rows of this tensor be read without materialising all of it?
    fn streams(&self) -> bool {
        match &self.source {
            Source::Memory(_) | Source::File { .. } => true,
            Source::Rows(inner) | Source::Columns { inner, .. } => inner.streams(),
            Source::Concat(pieces) | Source::Joined { shards: pieces, .. } => {
                pieces.iter().all(LazyTensor::streams)
            }
            Source::RowRanges(ranges) => ranges.iter().all(|(t, _, _)| t.streams()),
            Source::Derived { .. } => false,
        }
    }

    /// Bytes read from the sources per row of this tensor (more than a row's own bytes for a
    /// column shard, whose source rows are read whole).
    fn source_row_bytes(&self) -> usize {
        match &self.source {
            Source::Columns { inner, .. } => inner.source_row_bytes(),
            _ => self.bytes() / self.shape.first().map_or(1, |&rows| rows.max(1) as usize),
        }
    }

    /// Hands this tensor to `f` in pieces of whole rows, in order, each read when its turn
    /// comes: about [`CHUNK_BYTES`] at a time whatever the tensor's size (a tensor made by a
    /// function of whole inputs is read once, then handed on in the same pieces).
    pub fn for_each_chunk(&self, f: impl FnMut(&Tensor) -> Result<()>) -> Result<()> {
        self.for_each_chunk_of(CHUNK_BYTES, f)
    }

    /// [`LazyTensor::for_each_chunk`] in pieces of about `chunk_bytes`.
    fn for_each_chunk_of(
        &self,
        chunk_bytes: usize,
        mut f: impl FnMut(&Tensor) -> Result<()>,
    ) -> Result<()> {
        let mut f = |chunk: &Tensor| {
            f(chunk)?;
            report_written((chunk.numel() * self.kind.elt_size_in_bytes()) as u64);
            Ok(())
        };
        if self.shape.is_empty() {
            return f(&self.read()?);
        }
        let rows = self.shape[0];
        let step = (chunk_bytes / self.source_row_bytes().max(1)).max(1) as i64;
        let whole = if self.streams() {
            None
        } else {
            Some(self.read()?)
        };
        let mut start = 0;
        while start < rows {
            let count = step.min(rows - start);
            match &whole {
                Some(whole) => f(&whole.narrow(0, start, count))?,
                None => f(&self.read_rows(start, count)?)?,
            }
            start += count;
        }
        if self.bytes() > chunk_bytes {
            drop(whole);
            return_freed_memory();
        }
        Ok(())
    }

    /// Rows `start..start + count`, rows past the tensor's end as zeros, reading only those
    /// rows from the files (except from a tensor made by a function of whole inputs).
    pub fn read_rows(&self, start: i64, count: i64) -> Result<Tensor> {
        ensure!(!self.shape.is_empty(), "rows of a scalar");
        let have = self.shape[0];
        let mut shape = self.shape.clone();
        shape[0] = count;
        let inside = (have - start).clamp(0, count);
        if inside < count {
            let mut parts = Vec::new();
            if inside > 0 {
                parts.push(self.read_rows(start, inside)?);
            }
            shape[0] = count - inside;
            parts.push(Tensor::zeros(shape.as_slice(), (self.kind, Device::Cpu)));
            return Ok(Tensor::cat(&parts, 0));
        }
        let row_elements = self.shape[1..].iter().product::<i64>();
        let tensor = match &self.source {
            Source::Memory(t) => t.narrow(0, start, count).contiguous(),
            Source::File { file, offset } => {
                let row_bytes = row_elements as usize * self.kind.elt_size_in_bytes();
                let tensor = Tensor::empty(shape.as_slice(), (self.kind, Device::Cpu));
                // SAFETY: a fresh contiguous CPU tensor of `count` rows.
                let buffer = unsafe {
                    std::slice::from_raw_parts_mut(
                        tensor.data_ptr() as *mut u8,
                        count as usize * row_bytes,
                    )
                };
                file.read_at(buffer, offset + start as u64 * row_bytes as u64)?;
                tensor
            }
            Source::Rows(inner) => inner.read_rows(start, count)?,
            Source::Concat(pieces) => {
                let (lo, hi) = (start * row_elements, (start + count) * row_elements);
                let mut parts = Vec::new();
                let mut at = 0;
                for piece in pieces {
                    let n = piece.numel();
                    let (from, to) = (lo.max(at), hi.min(at + n));
                    if from < to {
                        parts.push(piece.read_rows(from - at, to - from)?.reshape([-1]));
                    }
                    at += n;
                }
                cat_rows(parts).view(shape.as_slice())
            }
            Source::Joined { shards, split } => match *split {
                TensorSplit::Replicated => shards[0].read_rows(start, count)?,
                TensorSplit::Columns => {
                    let parts = shards
                        .iter()
                        .map(|s| s.read_rows(start, count))
                        .collect::<Result<Vec<_>>>()?;
                    Tensor::cat(&parts, 1)
                }
                TensorSplit::Rows { stride } if shards[0].shape[0] % stride == 0 => {
                    // Joined rows are, per stride part, every shard's part in rank order.
                    let per = shards[0].shape[0] / stride;
                    let part_rows = per * shards.len() as i64;
                    let mut parts = Vec::new();
                    let mut at = start;
                    while at < start + count {
                        let (part, within) = (at / part_rows, at % part_rows);
                        let (shard, local) = (within / per, within % per);
                        let take = (per - local).min(start + count - at);
                        parts.push(shards[shard as usize].read_rows(part * per + local, take)?);
                        at += take;
                    }
                    cat_rows(parts)
                }
                TensorSplit::Rows { .. } => self.read()?.narrow(0, start, count).contiguous(),
            },
            Source::RowRanges(ranges) => {
                let mut parts = Vec::new();
                let mut at = 0;
                for (tensor, first, n) in ranges {
                    let (from, to) = (start.max(at), (start + count).min(at + n));
                    if from < to {
                        parts.push(tensor.read_rows(first + from - at, to - from)?);
                    }
                    at += n;
                }
                cat_rows(parts)
            }
            Source::Columns {
                inner,
                start: column,
                count: columns,
            } => inner
                .read_rows(start, count)?
                .narrow(1, *column, *columns)
                .contiguous(),
            Source::Derived { .. } => self.read()?.narrow(0, start, count).contiguous(),
        };
        ensure!(
            tensor.size() == shape,
            "read rows of shape {:?} for {:?}",
            tensor.size(),
            shape
        );
        Ok(tensor)
    }

    /// The tensor, read from its files now (a CPU tensor of its own).
    pub fn read(&self) -> Result<Tensor> {
        let tensor = match &self.source {
            Source::Memory(t) => t.shallow_clone(),
            Source::Derived { inputs, make } => {
                let inputs = inputs
                    .iter()
                    .map(LazyTensor::read)
                    .collect::<Result<Vec<_>>>()?;
                make(&inputs)
            }
            Source::Joined { shards, split } if !self.streams() => {
                let shards = shards
                    .iter()
                    .map(LazyTensor::read)
                    .collect::<Result<Vec<_>>>()?;
                join_shards(&shards, *split)
            }
            Source::Rows(inner) if !inner.streams() => {
                fit_vocab_rows(&inner.read()?, self.shape[0])
            }
            _ if self.shape.is_empty() => match &self.source {
                Source::File { .. } | Source::Concat(_) => {
                    self.flat_slice(0, 1, vec![1])?.read_rows(0, 1)?.view([])
                }
                _ => bail!("a scalar {self:?} that is not stored"),
            },
            _ => self.read_rows(0, self.shape[0])?,
        };
        ensure!(
            tensor.size() == self.shape,
            "read a tensor of shape {:?} for one of {:?}",
            tensor.size(),
            self.shape
        );
        Ok(tensor)
    }
}

/// Hands a CPU tensor's C-order little-endian bytes to `emit`.
pub fn with_bytes(tensor: &Tensor, emit: &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()> {
    emit(cpu_bytes(&tensor.contiguous()))
}

/// Row pieces stacked (one piece as it is).
fn cat_rows(mut parts: Vec<Tensor>) -> Tensor {
    if parts.len() == 1 {
        parts.pop().expect("one part")
    } else {
        Tensor::cat(&parts, 0)
    }
}

/// The largest safetensors header read (the safetensors crate's own limit).
const MAX_HEADER: u64 = 100 << 20;

/// Every tensor of a safetensors file, by name, read from its header alone.
pub fn safetensors_tensors(path: &Path) -> Result<BTreeMap<String, LazyTensor>> {
    let file = InputFile::open(path)?;
    let mut length = [0u8; 8];
    file.read_at(&mut length, 0)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let length = u64::from_le_bytes(length);
    ensure!(
        length <= MAX_HEADER && 8 + length <= file.len(),
        "{}: not a safetensors file (a header of {length} bytes in a file of {})",
        path.display(),
        file.len()
    );
    let mut header = vec![0u8; length as usize];
    file.read_at(&mut header, 8)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&header)
        .with_context(|| {
            format!(
                "{}: the safetensors header is not a JSON object",
                path.display()
            )
        })?;
    let data = 8 + length;
    let mut out = BTreeMap::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            continue;
        }
        let context = || format!("{}: tensor {name}", path.display());
        let dtype = entry["dtype"]
            .as_str()
            .map(DType::from_safetensors_name)
            .transpose()?
            .with_context(|| format!("{}: no dtype", context()))?;
        let shape: Vec<i64> = serde_json::from_value(entry["shape"].clone())
            .with_context(|| format!("{}: shape", context()))?;
        let offsets: [u64; 2] = serde_json::from_value(entry["data_offsets"].clone())
            .with_context(|| format!("{}: data_offsets", context()))?;
        let tensor =
            LazyTensor::in_file(&file, data + offsets[0], dtype, shape).with_context(context)?;
        ensure!(
            offsets[1].checked_sub(offsets[0]) == Some(tensor.bytes() as u64),
            "{}: data_offsets {offsets:?} do not hold a {dtype} tensor of shape {:?}",
            context(),
            tensor.shape()
        );
        out.insert(name, tensor);
    }
    Ok(out)
}

/// A tensor of a rank file, read from `input` (the same file) when a saver asks; strided views
/// are gathered now.
pub(crate) fn tensor_of(
    file: &TorchFile,
    input: &Arc<InputFile>,
    tensor: &TensorRef,
) -> Result<LazyTensor> {
    let shape: Vec<i64> = tensor.shape.iter().map(|&d| d as i64).collect();
    match file.tensor_offset(tensor)? {
        Some(offset) => LazyTensor::in_file(input, offset, tensor.storage.dtype, shape),
        None => {
            let bytes = file.tensor_bytes(tensor)?;
            Ok(tensor_from_bytes(tensor.storage.dtype, &tensor.shape, &bytes)?.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_slices_join_and_pad_like_the_tensors_they_stand_for() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flat");
        let values: Vec<f32> = (0..24).map(|v| v as f32).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = InputFile::open(&path).unwrap();
        let flat = LazyTensor::in_file(&file, 0, DType::F32, vec![24]).unwrap();
        let a = flat.flat_slice(0, 12, vec![3, 4]).unwrap();
        let b = flat.flat_slice(12, 12, vec![3, 4]).unwrap();
        let whole = Tensor::from_slice(&values).view([6, 4]);
        let rows = LazyTensor::joined(vec![a.clone(), b.clone()], TensorSplit::Rows { stride: 1 })
            .unwrap();
        assert_eq!(rows.shape(), &[6, 4]);
        assert!(rows.read().unwrap().equal(&whole));
        let columns = LazyTensor::joined(vec![a, b], TensorSplit::Columns).unwrap();
        assert_eq!(columns.shape(), &[3, 8]);
        let padded = rows.with_rows(8).read().unwrap();
        assert!(padded.narrow(0, 0, 6).equal(&whole));
        assert_eq!(
            padded
                .narrow(0, 6, 2)
                .abs()
                .sum(Kind::Float)
                .double_value(&[]),
            0.0
        );
        let pieces = LazyTensor::concat(
            vec![
                flat.flat_slice(20, 4, vec![4]).unwrap(),
                flat.flat_slice(0, 4, vec![4]).unwrap(),
            ],
            vec![2, 4],
        )
        .unwrap();
        assert_eq!(
            Vec::<f32>::try_from(pieces.read().unwrap().reshape([-1])).unwrap(),
            [20.0, 21.0, 22.0, 23.0, 0.0, 1.0, 2.0, 3.0]
        );
        // Every shortcut of shard agrees with cutting the whole tensor.
        let whole_file = flat.flat_slice(0, 24, vec![6, 4]).unwrap();
        let two = LazyTensor::joined(
            vec![
                flat.flat_slice(0, 12, vec![3, 4]).unwrap(),
                flat.flat_slice(12, 12, vec![3, 4]).unwrap(),
            ],
            TensorSplit::Rows { stride: 1 },
        )
        .unwrap();
        let one =
            LazyTensor::joined(vec![whole_file.clone()], TensorSplit::Rows { stride: 2 }).unwrap();
        let padded_two = two.clone().with_rows(8);
        // Shards joined with a stride, column blocks, flat pieces and stacked row ranges.
        let strided = LazyTensor::joined(
            vec![
                flat.flat_slice(0, 12, vec![3, 4]).unwrap().with_rows(4),
                flat.flat_slice(12, 12, vec![3, 4]).unwrap().with_rows(4),
            ],
            TensorSplit::Rows { stride: 2 },
        )
        .unwrap();
        let blocks = LazyTensor::joined(
            vec![
                flat.flat_slice(0, 12, vec![6, 2]).unwrap(),
                flat.flat_slice(12, 12, vec![6, 2]).unwrap(),
            ],
            TensorSplit::Columns,
        )
        .unwrap();
        let stacked = LazyTensor::row_ranges(vec![
            (whole_file.clone(), 4, 2),
            (
                LazyTensor::concat(
                    vec![
                        flat.flat_slice(16, 8, vec![8]).unwrap(),
                        flat.flat_slice(0, 8, vec![8]).unwrap(),
                    ],
                    vec![4, 4],
                )
                .unwrap(),
                0,
                4,
            ),
        ])
        .unwrap();
        assert_eq!(stacked.shape(), &[6, 4]);
        // Row by row they read as the tensors joined whole.
        let rows_of = |t: &Tensor, ranges: &[(i64, i64)]| {
            Tensor::cat(
                &ranges
                    .iter()
                    .map(|&(s, n)| t.narrow(0, s, n))
                    .collect::<Vec<_>>(),
                0,
            )
        };
        let halves = [
            fit_vocab_rows(&whole.narrow(0, 0, 3), 4),
            fit_vocab_rows(&whole.narrow(0, 3, 3), 4),
        ];
        assert!(strided
            .read()
            .unwrap()
            .equal(&join_shards(&halves, TensorSplit::Rows { stride: 2 })));
        let flat_whole = Tensor::from_slice(&values);
        assert!(blocks.read().unwrap().equal(&Tensor::cat(
            &[
                flat_whole.narrow(0, 0, 12).view([6, 2]),
                flat_whole.narrow(0, 12, 12).view([6, 2])
            ],
            1
        )));
        assert!(stacked.read().unwrap().equal(&Tensor::cat(
            &[
                rows_of(&whole, &[(4, 2)]),
                rows_of(&whole, &[(4, 2), (0, 2)])
            ],
            0
        )));
        for (lazy, split, size, rows) in [
            (&whole_file, TensorSplit::Rows { stride: 2 }, 3, None),
            (&whole_file, TensorSplit::Rows { stride: 1 }, 2, Some(8)),
            (&whole_file, TensorSplit::Rows { stride: 1 }, 2, Some(4)),
            (&whole_file, TensorSplit::Columns, 2, None),
            (&two, TensorSplit::Rows { stride: 1 }, 2, None),
            (&two, TensorSplit::Rows { stride: 1 }, 3, None),
            (&two, TensorSplit::Rows { stride: 1 }, 4, Some(8)),
            (&padded_two, TensorSplit::Rows { stride: 1 }, 2, Some(6)),
            (&padded_two, TensorSplit::Rows { stride: 1 }, 2, Some(10)),
            (&one, TensorSplit::Rows { stride: 2 }, 3, None),
            (&strided, TensorSplit::Rows { stride: 2 }, 2, None),
            (&strided, TensorSplit::Rows { stride: 1 }, 3, None),
            (&strided, TensorSplit::Columns, 2, Some(8)),
            (&blocks, TensorSplit::Columns, 2, None),
            (&blocks, TensorSplit::Rows { stride: 1 }, 2, None),
            (&blocks, TensorSplit::Replicated, 1, Some(2)),
            (&stacked, TensorSplit::Rows { stride: 3 }, 2, None),
        ] {
            let padded = rows.map_or(lazy.clone(), |r| lazy.clone().with_rows(r));
            for rank in 0..size {
                let mut expected = lazy.read().unwrap();
                if let Some(rows) = rows {
                    expected = fit_vocab_rows(&expected, rows);
                }
                let expected = take_shard(&expected, split, rank, size);
                assert!(
                    lazy.shard(split, rank, size, rows)
                        .unwrap()
                        .read()
                        .unwrap()
                        .equal(&expected),
                    "{split:?} rank {rank} of {size}"
                );
                assert!(padded
                    .shard(split, rank, size, rows)
                    .unwrap()
                    .read()
                    .unwrap()
                    .equal(&expected));
                // Streamed a row (or a few elements) at a time, the pieces make the shard.
                for chunk_bytes in [1, 24] {
                    let mut pieces = Vec::new();
                    lazy.shard(split, rank, size, rows)
                        .unwrap()
                        .for_each_chunk_of(chunk_bytes, |piece| {
                            pieces.push(piece.shallow_clone());
                            Ok(())
                        })
                        .unwrap();
                    assert!(Tensor::cat(&pieces, 0).equal(&expected));
                }
            }
        }
        let error = format!(
            "{:#}",
            LazyTensor::in_file(&file, 64, DType::F32, vec![24]).unwrap_err()
        );
        assert!(
            error.contains("flat") && error.contains("past the end"),
            "{error}"
        );
    }
}
