//! Files written by `torch.save` (the zip format of PyTorch ≥ 1.6): `<archive>/data.pkl` holds
//! the pickled object, `<archive>/data/<key>` the raw bytes of each storage. The file is memory
//! mapped and storages are stored uncompressed, so a tensor's bytes are read in place, one
//! tensor at a time.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;

use crate::pickle::{torch_persistent_load, unpickle, TensorRef, Value};

/// An opened `torch.save` archive.
pub struct TorchFile {
    path: PathBuf,
    map: Arc<Mmap>,
    /// Byte range of each storage record (`data/<key>`), absolute in `map`.
    storages: HashMap<String, (usize, usize)>,
    /// The unpickled object.
    pub root: Value,
}

impl std::fmt::Debug for TorchFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TorchFile({})", self.path.display())
    }
}

/// Maps `path` read-only.
pub fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: checkpoint inputs are not modified while being converted.
    let map = unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
    Ok(Arc::new(map))
}

impl TorchFile {
    pub fn open(path: &Path) -> Result<Self> {
        let map = map_file(path)?;
        let len = map.len();
        Self::open_within(path, map, 0, len)
    }

    /// A `torch.save` archive embedded at `offset..offset + len` of a mapped file (how
    /// `torch.distributed.checkpoint` stores each tensor in a `.distcp` file).
    pub fn open_within(path: &Path, map: Arc<Mmap>, offset: usize, len: usize) -> Result<Self> {
        let whole = offset == 0 && len == map.len();
        let describe = || {
            if whole {
                path.display().to_string()
            } else {
                format!("{} (bytes {offset}..{})", path.display(), offset + len)
            }
        };
        ensure!(
            offset.checked_add(len).is_some_and(|end| end <= map.len()),
            "{}: truncated (the file has {} bytes)",
            describe(),
            map.len()
        );
        let bytes = &map[offset..offset + len];
        if !bytes.starts_with(b"PK\x03\x04") {
            if bytes.starts_with(&[0x80]) {
                bail!(
                    "{}: a legacy (pre-1.6, non-zip) torch.save file; re-save it with a current PyTorch",
                    describe()
                );
            }
            bail!("{}: not a PyTorch checkpoint (no zip archive)", describe());
        }
        let mut archive = zip::ZipArchive::new(Cursor::new(bytes))
            .with_context(|| format!("{}: corrupt or truncated zip archive", describe()))?;
        let mut pickle_range = None;
        let mut storages = HashMap::new();
        for index in 0..archive.len() {
            let entry = archive
                .by_index_raw(index)
                .with_context(|| format!("{}: zip entry {index}", describe()))?;
            let name = entry.name().to_string();
            let Some((_, inner)) = name.split_once('/') else {
                continue;
            };
            let start = offset + entry.data_start() as usize;
            let size = entry.compressed_size() as usize;
            ensure!(
                start
                    .checked_add(size)
                    .is_some_and(|end| end <= offset + len),
                "{}: record {name} is truncated",
                describe()
            );
            let stored = entry.compression() == zip::CompressionMethod::Stored;
            if inner == "data.pkl" {
                ensure!(stored, "{}: {name} is compressed", describe());
                pickle_range = Some((start, size));
            } else if let Some(key) = inner.strip_prefix("data/") {
                ensure!(stored, "{}: storage {name} is compressed", describe());
                storages.insert(key.to_string(), (start, size));
            }
        }
        drop(archive);
        let (start, size) =
            pickle_range.with_context(|| format!("{}: no data.pkl record", describe()))?;
        let root = unpickle(&map[start..start + size], &mut torch_persistent_load)
            .with_context(|| format!("{}: reading data.pkl", describe()))?;
        let file = TorchFile {
            path: path.to_path_buf(),
            map,
            storages,
            root,
        };
        for (name, tensor) in file.tensors() {
            let (_, bytes) = file
                .storage_range(tensor)
                .with_context(|| format!("tensor {name}"))?;
            let needed = tensor.storage.numel * tensor.storage.dtype.size();
            ensure!(
                bytes >= needed,
                "{}: tensor {name}: storage {} has {bytes} bytes, {needed} expected (truncated file?)",
                describe(),
                tensor.storage.key
            );
        }
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn storage_range(&self, tensor: &TensorRef) -> Result<(usize, usize)> {
        self.storages
            .get(&tensor.storage.key)
            .copied()
            .with_context(|| {
                format!(
                    "{}: storage record data/{} is missing",
                    self.path.display(),
                    tensor.storage.key
                )
            })
    }

    /// Where a contiguous tensor's bytes start in the file (for reading it without the map);
    /// `None` for a strided view, whose elements are not one byte range.
    pub fn tensor_offset(&self, tensor: &TensorRef) -> Result<Option<u64>> {
        let (start, _) = self.storage_range(tensor)?;
        let at = start + tensor.offset * tensor.storage.dtype.size();
        Ok(tensor.is_contiguous().then_some(at as u64))
    }

    /// The tensor's elements in C order, little-endian: borrowed from the map when the tensor
    /// is contiguous, gathered otherwise.
    pub fn tensor_bytes(&self, tensor: &TensorRef) -> Result<Cow<'_, [u8]>> {
        let (start, _) = self.storage_range(tensor)?;
        let element = tensor.storage.dtype.size();
        let storage = &self.map[start..start + tensor.storage.numel * element];
        if tensor.is_contiguous() {
            let begin = tensor.offset * element;
            return Ok(Cow::Borrowed(
                &storage[begin..begin + tensor.numel() * element],
            ));
        }
        let mut out = Vec::with_capacity(tensor.numel() * element);
        let mut index = vec![0usize; tensor.shape.len()];
        for _ in 0..tensor.numel() {
            let at = tensor.offset
                + index
                    .iter()
                    .zip(&tensor.stride)
                    .map(|(i, s)| i * s)
                    .sum::<usize>();
            out.extend_from_slice(&storage[at * element..(at + 1) * element]);
            for dim in (0..index.len()).rev() {
                index[dim] += 1;
                if index[dim] < tensor.shape[dim] {
                    break;
                }
                index[dim] = 0;
            }
        }
        Ok(Cow::Owned(out))
    }

    /// Every tensor in the pickled object with its path (`model/decoder.layers.0...`).
    pub fn tensors(&self) -> Vec<(String, &TensorRef)> {
        let mut out = Vec::new();
        collect_tensors(&self.root, String::new(), &mut out);
        out
    }
}

fn key_text(key: &Value) -> String {
    match key {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        other => other.describe(),
    }
}

/// Walks dicts, lists and object states; paths join keys with `/`.
pub fn collect_tensors<'a>(value: &'a Value, path: String, out: &mut Vec<(String, &'a TensorRef)>) {
    let join = |key: String| {
        if path.is_empty() {
            key
        } else {
            format!("{path}/{key}")
        }
    };
    match value {
        Value::Tensor(t) => out.push((path, t)),
        Value::Dict(items) => {
            for (k, v) in items {
                collect_tensors(v, join(key_text(k)), out);
            }
        }
        Value::List(items) | Value::Tuple(items) => {
            for (i, v) in items.iter().enumerate() {
                collect_tensors(v, join(i.to_string()), out);
            }
        }
        Value::Object {
            state: Some(state), ..
        } => collect_tensors(state, path, out),
        _ => {}
    }
}
