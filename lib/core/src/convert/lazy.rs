//! Tensors of a checkpoint being converted, read from their files only when a saver asks for
//! them, so that a conversion holds one tensor at a time whatever the model's size. A lazy
//! tensor knows its shape and kind up front (savers write file headers before any data) and
//! how to assemble itself: bytes at an offset of an input file, pieces of a flat optimizer
//! buffer, tensor-parallel shards joined, or a tensor already in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use megatron_checkpoint::DType;
use tch::{Device, Kind, Tensor};

use super::state::{fit_vocab_rows, kind_of};
use crate::checkpoint::{join_shards, take_shard, TensorSplit};

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
    /// inside an optimizer's flat buffer.
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
            _ => Source::Memory(self.read()?.reshape([-1]).narrow(0, start, len)),
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
    /// rows first cut or padded to `rows`, reading only what the shard needs where the layout
    /// allows: a source shard that is already the target one, or the row ranges of a tensor
    /// split by rows.
    pub fn read_shard(
        &self,
        split: TensorSplit,
        rank: usize,
        size: usize,
        rows: Option<i64>,
    ) -> Result<Tensor> {
        let rows_kept = rows.is_none_or(|r| r == self.shape[0]);
        match (&self.source, split) {
            (Source::Rows(inner), _) if rows == Some(inner.shape[0]) => {
                return inner.read_shard(split, rank, size, None)
            }
            (
                Source::Joined {
                    shards,
                    split: joined,
                },
                _,
            ) if rows_kept && *joined == split && shards.len() == size => {
                return shards[rank].read()
            }
            (Source::Joined { shards, .. }, _) if rows_kept && shards.len() == 1 => {
                return shards[0].read_shard(split, rank, size, None)
            }
            // Split by rows: each of the `stride` parts contributes a contiguous row range.
            (_, TensorSplit::Rows { stride })
                if (rows_kept || stride == 1)
                    && rows.unwrap_or(self.shape[0]) % (stride * size as i64) == 0 =>
            {
                let part_rows = rows.unwrap_or(self.shape[0]) / stride;
                let count = part_rows / size as i64;
                let parts = (0..stride)
                    .map(|p| self.read_rows(p * part_rows + rank as i64 * count, count))
                    .collect::<Result<Vec<_>>>()?;
                return Ok(if parts.len() == 1 {
                    parts.into_iter().next().expect("one part")
                } else {
                    Tensor::cat(&parts, 0)
                });
            }
            _ => {}
        }
        let mut full = self.read()?;
        if let Some(rows) = rows {
            full = fit_vocab_rows(&full, rows);
        }
        Ok(take_shard(&full, split, rank, size))
    }

    /// Rows `start..start + count`, rows past the tensor's end as zeros, reading only those
    /// rows where the source allows (a file, row-split shards, a padded tensor).
    pub fn read_rows(&self, start: i64, count: i64) -> Result<Tensor> {
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
        match &self.source {
            Source::File { file, offset } => {
                let row_bytes = self.shape[1..].iter().product::<i64>() as usize
                    * self.kind.elt_size_in_bytes();
                let tensor = Tensor::empty(shape.as_slice(), (self.kind, Device::Cpu));
                // SAFETY: a fresh contiguous CPU tensor of `count` rows.
                let buffer = unsafe {
                    std::slice::from_raw_parts_mut(
                        tensor.data_ptr() as *mut u8,
                        count as usize * row_bytes,
                    )
                };
                file.read_at(buffer, offset + start as u64 * row_bytes as u64)?;
                Ok(tensor)
            }
            Source::Rows(inner) => inner.read_rows(start, count),
            Source::Joined { shards, split }
                if shards.len() == 1 || *split == TensorSplit::Rows { stride: 1 } =>
            {
                let per_shard = shards[0].shape[0];
                if shards.len() == 1 {
                    return shards[0].read_rows(start, count);
                }
                let mut parts = Vec::new();
                let mut at = start;
                while at < start + count {
                    let shard = (at / per_shard) as usize;
                    let local = at % per_shard;
                    let take = (per_shard - local).min(start + count - at);
                    parts.push(shards[shard].read_rows(local, take)?);
                    at += take;
                }
                Ok(if parts.len() == 1 {
                    parts.into_iter().next().expect("one part")
                } else {
                    Tensor::cat(&parts, 0)
                })
            }
            _ => Ok(self.read()?.narrow(0, start, count).contiguous()),
        }
    }

    /// The tensor, read from its files now (a CPU tensor of its own).
    pub fn read(&self) -> Result<Tensor> {
        let tensor = match &self.source {
            Source::Memory(t) => t.shallow_clone(),
            Source::File { file, offset } => {
                let tensor = Tensor::empty(self.shape.as_slice(), (self.kind, Device::Cpu));
                // SAFETY: a fresh contiguous CPU tensor of exactly `bytes()` bytes.
                let buffer = unsafe {
                    std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut u8, self.bytes())
                };
                file.read_at(buffer, *offset)?;
                tensor
            }
            Source::Concat(pieces) => {
                let pieces = pieces
                    .iter()
                    .map(|p| Ok(p.read()?.reshape([-1])))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&pieces, 0).view(self.shape.as_slice())
            }
            Source::Joined { shards, .. } if shards.len() == 1 => shards[0].read()?,
            Source::Joined { shards, split } => {
                let shards = shards
                    .iter()
                    .map(LazyTensor::read)
                    .collect::<Result<Vec<_>>>()?;
                join_shards(&shards, *split)
            }
            Source::Rows(inner) => fit_vocab_rows(&inner.read()?, self.shape[0]),
            Source::Derived { inputs, make } => {
                let inputs = inputs
                    .iter()
                    .map(LazyTensor::read)
                    .collect::<Result<Vec<_>>>()?;
                make(&inputs)
            }
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
        // Every shortcut of read_shard agrees with cutting the whole tensor.
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
        ] {
            let padded = rows.map_or(lazy.clone(), |r| lazy.clone().with_rows(r));
            for rank in 0..size {
                let mut expected = lazy.read().unwrap();
                if let Some(rows) = rows {
                    expected = fit_vocab_rows(&expected, rows);
                }
                let expected = take_shard(&expected, split, rank, size);
                assert!(
                    lazy.read_shard(split, rank, size, rows)
                        .unwrap()
                        .equal(&expected),
                    "{split:?} rank {rank} of {size}"
                );
                assert!(padded
                    .read_shard(split, rank, size, rows)
                    .unwrap()
                    .equal(&expected));
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
