//! Reading Megatron's `torch_dist` checkpoints (PyTorch distributed checkpoint, spec §5.4):
//! `.metadata` (a pickle naming every global tensor, its shape and the chunks it was saved in),
//! `__<rank>_<k>.distcp` data files (each tensor chunk an embedded `torch.save` archive) and
//! `common.pt` (args, iteration, scheduler). Tensors are assembled from their chunks on demand,
//! one at a time, optionally only a range of their first dimension (one layer of a stacked
//! `decoder.layers.*` tensor).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use memmap2::Mmap;

use crate::dtype::DType;
use crate::pickle::{unpickle, TensorRef, Value};
use crate::torch_file::{map_file, TorchFile};

/// One saved chunk of a global tensor.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
    pub file: String,
    pub byte_offset: usize,
    pub byte_length: usize,
}

/// A global tensor of the checkpoint.
#[derive(Debug, Clone)]
pub struct DistTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub chunks: Vec<Chunk>,
}

pub struct DistCheckpoint {
    directory: PathBuf,
    /// Global tensors by their sharded key (`decoder.layers.mlp.linear_fc1.weight`).
    pub tensors: BTreeMap<String, DistTensor>,
    /// Byte items (`_extra_state`, RNG states) by key: not model weights.
    pub byte_items: Vec<String>,
    /// Where each byte item is stored: (data file, byte offset, byte length).
    objects: HashMap<String, (String, usize, usize)>,
    /// `common.pt`: args, iteration, checkpoint_version, scheduler state.
    pub common: TorchFile,
    maps: std::sync::Mutex<HashMap<String, Arc<Mmap>>>,
}

/// `torch.Size([a, b])` (pickled as a reduce of `torch.Size` over a tuple) or a plain tuple.
fn size_list(value: &Value) -> Result<Vec<usize>> {
    let items = match value {
        Value::Object { name, args, .. } if name == "Size" => {
            args.first()
                .and_then(Value::items)
                .context("torch.Size without dimensions")?
        }
        other => other.items().context("expected a size")?,
    };
    items
        .iter()
        .map(|d| d.as_i64().map(|d| d as usize).context("size entry"))
        .collect()
}

impl DistCheckpoint {
    /// Is `directory` a `torch_dist` iteration directory?
    pub fn is_dist_checkpoint(directory: &Path) -> bool {
        directory.join(".metadata").is_file()
    }

    pub fn open(directory: &Path) -> Result<Self> {
        let metadata_path = directory.join(".metadata");
        let bytes = std::fs::read(&metadata_path)
            .with_context(|| format!("reading {}", metadata_path.display()))?;
        let metadata = unpickle(&bytes, &mut |pid| {
            bail!("unexpected persistent id {}", pid.describe())
        })
        .with_context(|| format!("{}: reading the pickle", metadata_path.display()))?;
        let context = || metadata_path.display().to_string();
        let state = metadata
            .get("state_dict_metadata")
            .and_then(Value::entries)
            .with_context(|| format!("{}: no state_dict_metadata", context()))?;
        let storage = metadata
            .get("storage_data")
            .and_then(Value::entries)
            .with_context(|| format!("{}: no storage_data", context()))?;
        // (fqn, chunk offsets) → (file, byte offset, byte length)
        let mut locations: HashMap<(String, Vec<usize>), (String, usize, usize)> = HashMap::new();
        for (index, info) in storage {
            let fqn = index
                .get("fqn")
                .and_then(Value::as_str)
                .with_context(|| format!("{}: storage entry without fqn", context()))?;
            let offsets = match index.get("offset") {
                Some(Value::None) | None => Vec::new(),
                Some(offset) => size_list(offset)?,
            };
            let file = info
                .get("relative_path")
                .and_then(Value::as_str)
                .with_context(|| format!("{}: {fqn}: no relative_path", context()))?;
            let offset = info.get("offset").and_then(Value::as_i64).unwrap_or(0) as usize;
            let length = info
                .get("length")
                .and_then(Value::as_i64)
                .with_context(|| format!("{}: {fqn}: no length", context()))?
                as usize;
            if let Some(transforms) = info.get("transform_descriptors").and_then(Value::items) {
                ensure!(
                    transforms.is_empty(),
                    "{}: {fqn}: transformed (compressed) items are not supported",
                    context()
                );
            }
            locations.insert(
                (fqn.to_string(), offsets),
                (file.to_string(), offset, length),
            );
        }
        let mut tensors = BTreeMap::new();
        let mut byte_items = Vec::new();
        let mut objects = HashMap::new();
        for (key, entry) in state {
            let name = key.as_str().context("non-string tensor key")?.to_string();
            let Value::Object { name: class, .. } = entry else {
                bail!(
                    "{}: {name}: unexpected metadata {}",
                    context(),
                    entry.describe()
                );
            };
            if class == "BytesStorageMetadata" {
                if let Some(location) = locations.get(&(name.clone(), Vec::new())) {
                    objects.insert(name.clone(), location.clone());
                }
                byte_items.push(name);
                continue;
            }
            // TensorProperties pickles its fields as a tuple state, dtype first.
            let properties = entry.get("properties");
            let dtype_value =
                properties
                    .and_then(|p| p.get("dtype"))
                    .or_else(|| match properties {
                        Some(Value::Object {
                            state: Some(state), ..
                        }) => state.items().and_then(|s| s.first()),
                        _ => None,
                    });
            let dtype = match dtype_value {
                Some(Value::Global { name: dtype, .. }) => DType::from_torch_name(dtype)
                    .with_context(|| format!("{}: {name}: dtype {dtype}", context()))?,
                _ => bail!("{}: {name}: no dtype", context()),
            };
            let shape = size_list(entry.get("size").context("no size")?)
                .with_context(|| format!("{}: {name}", context()))?;
            let mut chunks = Vec::new();
            for chunk in entry.get("chunks").and_then(Value::items).unwrap_or(&[]) {
                let offsets = size_list(chunk.get("offsets").context("chunk offsets")?)?;
                let sizes = size_list(chunk.get("sizes").context("chunk sizes")?)?;
                let (file, byte_offset, byte_length) = locations
                    .get(&(name.clone(), offsets.clone()))
                    .cloned()
                    .with_context(|| {
                        format!(
                            "{}: {name}: no storage for the chunk at {offsets:?}",
                            context()
                        )
                    })?;
                chunks.push(Chunk {
                    offsets,
                    sizes,
                    file,
                    byte_offset,
                    byte_length,
                });
            }
            tensors.insert(
                name,
                DistTensor {
                    dtype,
                    shape,
                    chunks,
                },
            );
        }
        let common = TorchFile::open(&directory.join("common.pt"))?;
        Ok(DistCheckpoint {
            directory: directory.to_path_buf(),
            tensors,
            byte_items,
            objects,
            common,
            maps: Default::default(),
        })
    }

    fn map(&self, file: &str) -> Result<Arc<Mmap>> {
        let mut maps = self.maps.lock().expect("map cache");
        if let Some(map) = maps.get(file) {
            return Ok(map.clone());
        }
        let path = self.directory.join(file);
        ensure!(
            path.is_file(),
            "{}: missing data file (named by .metadata)",
            path.display()
        );
        let map = map_file(&path)?;
        maps.insert(file.to_string(), map.clone());
        Ok(map)
    }

    /// The path of a data file named by `.metadata`.
    pub fn data_path(&self, file: &str) -> PathBuf {
        self.directory.join(file)
    }

    /// The `torch.save` archive holding `chunk` of tensor `name` and the tensor it holds (its
    /// `root`), checked to be of the chunk's shape and the tensor's dtype.
    pub fn chunk_archive(&self, name: &str, chunk: &Chunk) -> Result<(TorchFile, TensorRef)> {
        let tensor = self.tensor(name)?;
        let map = self.map(&chunk.file)?;
        let path = self.data_path(&chunk.file);
        let archive = TorchFile::open_within(&path, map, chunk.byte_offset, chunk.byte_length)
            .with_context(|| format!("tensor {name}"))?;
        let Value::Tensor(stored) = &archive.root else {
            bail!("{}: tensor {name}: chunk is not a tensor", path.display());
        };
        ensure!(
            stored.shape == chunk.sizes && stored.storage.dtype == tensor.dtype,
            "{}: tensor {name}: chunk holds {} {:?}, metadata says {} {:?}",
            path.display(),
            stored.storage.dtype,
            stored.shape,
            tensor.dtype,
            chunk.sizes
        );
        let stored = stored.clone();
        Ok((archive, stored))
    }

    /// The byte item `key` (a `torch.save` archive: Megatron's `ShardedObject`s, saved as the
    /// list of their data) and the data file holding it.
    pub fn object(&self, key: &str) -> Result<(TorchFile, String)> {
        let (file, offset, length) = self.objects.get(key).with_context(|| {
            format!("{}: no object {key} in .metadata", self.directory.display())
        })?;
        let archive =
            TorchFile::open_within(&self.data_path(file), self.map(file)?, *offset, *length)
                .with_context(|| format!("object {key}"))?;
        Ok((archive, file.clone()))
    }

    /// The whole tensor `name` (C order, little-endian bytes) and its shape.
    pub fn read(&self, name: &str) -> Result<(DType, Vec<usize>, Vec<u8>)> {
        let tensor = self.tensor(name)?;
        let rows = tensor.shape.first().copied().unwrap_or(1);
        self.read_rows(name, 0..rows)
    }

    fn tensor(&self, name: &str) -> Result<&DistTensor> {
        self.tensors
            .get(name)
            .with_context(|| format!("{}: no tensor {name}", self.directory.display()))
    }

    /// Rows `range` of the first dimension of tensor `name`: e.g. one layer of a stacked tensor.
    pub fn read_rows(
        &self,
        name: &str,
        range: std::ops::Range<usize>,
    ) -> Result<(DType, Vec<usize>, Vec<u8>)> {
        let tensor = self.tensor(name)?;
        let element = tensor.dtype.size();
        let mut shape = tensor.shape.clone();
        if shape.is_empty() {
            ensure!(range == (0..1), "{name} is a scalar");
        } else {
            ensure!(
                range.end <= shape[0],
                "{name}: rows {range:?} of {}",
                shape[0]
            );
            shape[0] = range.len();
        }
        let numel = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|n| n.checked_mul(element).is_some())
            .with_context(|| format!("{name}: impossible shape {shape:?}"))?;
        let mut out = vec![0u8; numel * element];
        let mut covered = 0usize;
        for chunk in &tensor.chunks {
            let (chunk_start, chunk_rows) = match (chunk.offsets.first(), chunk.sizes.first()) {
                (Some(&o), Some(&s)) => (o, s),
                _ => (0, 1),
            };
            let lo = range.start.max(chunk_start);
            let hi = range.end.min(chunk_start + chunk_rows);
            if lo >= hi && !tensor.shape.is_empty() {
                continue;
            }
            let (archive, stored) = self.chunk_archive(name, chunk)?;
            let bytes = archive.tensor_bytes(&stored)?;
            if tensor.shape.is_empty() {
                out.copy_from_slice(&bytes);
                covered += 1;
                continue;
            }
            // Copy the chunk's rows lo..hi into place, one innermost run at a time.
            let mut out_offsets = chunk.offsets.clone();
            out_offsets[0] = lo - range.start;
            let mut sub = chunk.sizes.clone();
            sub[0] = hi - lo;
            let skip_rows = lo - chunk_start;
            copy_block(
                &bytes,
                &chunk.sizes,
                skip_rows,
                &mut out,
                &shape,
                &out_offsets,
                &sub,
                element,
            );
            covered += sub.iter().product::<usize>();
        }
        ensure!(
            covered == numel,
            "{}: tensor {name}: the chunks cover {covered} of {numel} elements",
            self.directory.display()
        );
        Ok((tensor.dtype, shape, out))
    }
}

/// Copies the block `sub` (starting `skip_rows` rows into a source of shape `source_shape`)
/// into `out` (shape `out_shape`) at `out_offsets`.
#[allow(clippy::too_many_arguments)]
fn copy_block(
    source: &[u8],
    source_shape: &[usize],
    skip_rows: usize,
    out: &mut [u8],
    out_shape: &[usize],
    out_offsets: &[usize],
    sub: &[usize],
    element: usize,
) {
    let rank = sub.len();
    let strides = |shape: &[usize]| {
        let mut s = vec![1usize; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            s[d] = s[d + 1] * shape[d + 1];
        }
        s
    };
    let (source_strides, out_strides) = (strides(source_shape), strides(out_shape));
    let run = sub[rank - 1] * element;
    let outer: usize = sub[..rank - 1].iter().product();
    let mut index = vec![0usize; rank - 1];
    for _ in 0..outer {
        let mut from = 0;
        let mut to = 0;
        for d in 0..rank - 1 {
            let i = index[d] + if d == 0 { skip_rows } else { 0 };
            from += i * source_strides[d];
            to += (index[d] + out_offsets[d]) * out_strides[d];
        }
        if rank == 1 {
            from += skip_rows;
        }
        to += out_offsets[rank - 1];
        let (from, to) = (from * element, to * element);
        out[to..to + run].copy_from_slice(&source[from..from + run]);
        for d in (0..rank - 1).rev() {
            index[d] += 1;
            if index[d] < sub[d] {
                break;
            }
            index[d] = 0;
        }
    }
}
