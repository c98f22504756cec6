//! Writing Megatron's `torch_dist` checkpoints as core_v0.14.0 lays them out (spec §5.4): each
//! tensor chunk and byte object a `torch.save` archive appended to a `__<rank>_0.distcp` file of
//! the rank that would save it, `.metadata` (the pickled
//! `torch.distributed.checkpoint.metadata.Metadata`: every global tensor's dtype, shape and
//! chunks, and where each item lies), `common.pt` (what every rank shares: args, iteration,
//! the optimizer's parameter groups) and `metadata.json` (the backends Megatron checks).
//! Items stream to their files one at a time; only the metadata stays in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{ensure, Context, Result};

use crate::direct_file::DirectWriter;
use crate::dtype::DType;
use crate::pickle::Value;
use crate::torch_writer::{pickle_value, write_torch_archive, write_torch_file, Saved, TensorSlot};

const METADATA_MODULE: &str = "torch.distributed.checkpoint.metadata";

/// Megatron's `metadata.json`: the sharded and common backends of the checkpoint.
const MEGATRON_METADATA: &str = r#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}"#;

/// A chunk of a global tensor: where it starts and its extent in every dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPlace {
    pub offsets: Vec<usize>,
    pub sizes: Vec<usize>,
}

struct GlobalTensor {
    dtype: DType,
    shape: Vec<usize>,
    chunks: Vec<ChunkPlace>,
}

enum Entry {
    Tensor(GlobalTensor),
    Bytes,
}

/// Where an item was written: its key, the chunk's offsets (tensors), file, offset, length.
struct Stored {
    key: String,
    offsets: Option<Vec<usize>>,
    file: String,
    offset: u64,
    length: u64,
}

/// A `.distcp` file being appended to.
struct DataFile {
    writer: DirectWriter,
    end: u64,
}

/// A `torch_dist` iteration directory being written.
pub struct DistWriter {
    directory: PathBuf,
    /// Keys in the order they were declared (Megatron's `.metadata` keeps the save order).
    order: Vec<String>,
    entries: BTreeMap<String, Entry>,
    stored: Vec<Stored>,
    files: BTreeMap<String, DataFile>,
}

/// `sink` seen from `base` on: a `torch.save` archive inside a `.distcp` file counts its offsets
/// from its own start, as `torch.load` of the item's bytes reads them.
struct Window<'a, W> {
    sink: &'a mut W,
    base: u64,
}

impl<W: Write> Write for Window<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.sink.write(bytes)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.sink.flush()
    }
}

impl<W: Seek> Seek for Window<'_, W> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let to = match to {
            SeekFrom::Start(at) => SeekFrom::Start(self.base + at),
            other => other,
        };
        let at = self.sink.seek(to)?;
        at.checked_sub(self.base).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "seek before the archive's start",
            )
        })
    }
}

fn size(dims: &[usize]) -> Value {
    Value::Object {
        module: "torch".into(),
        name: "Size".into(),
        args: vec![Value::Tuple(
            dims.iter().map(|&d| Value::Int(d as i64)).collect(),
        )],
        state: None,
    }
}

fn dataclass(module: &str, name: &str, fields: Vec<(&str, Value)>) -> Value {
    Value::Object {
        module: module.into(),
        name: name.into(),
        args: Vec::new(),
        state: Some(Box::new(Value::Dict(
            fields
                .into_iter()
                .map(|(k, v)| (Value::Str(k.into()), v))
                .collect(),
        ))),
    }
}

/// `TensorProperties` pickles its fields as a tuple: dtype, layout, requires_grad, memory
/// format, pin_memory.
fn tensor_properties(dtype: DType) -> Value {
    Value::Object {
        module: METADATA_MODULE.into(),
        name: "TensorProperties".into(),
        args: Vec::new(),
        state: Some(Box::new(Value::Tuple(vec![
            Value::Global {
                module: "torch".into(),
                name: dtype.torch_name().into(),
            },
            Value::Object {
                module: "torch.serialization".into(),
                name: "_get_layout".into(),
                args: vec![Value::Str("torch.strided".into())],
                state: None,
            },
            Value::Bool(false),
            Value::Object {
                module: METADATA_MODULE.into(),
                name: "_MEM_FORMAT_ENCODING".into(),
                args: vec![Value::Int(0)],
                state: None,
            },
            Value::Bool(false),
        ]))),
    }
}

impl DistWriter {
    /// Starts writing into `directory` (created if missing).
    pub fn create(directory: &Path) -> Result<Self> {
        std::fs::create_dir_all(directory)
            .with_context(|| format!("creating {}", directory.display()))?;
        Ok(DistWriter {
            directory: directory.to_path_buf(),
            order: Vec::new(),
            entries: BTreeMap::new(),
            stored: Vec::new(),
            files: BTreeMap::new(),
        })
    }

    /// Declares the global tensor `key` of `dtype` and `shape`, whose chunks follow.
    pub fn declare_tensor(&mut self, key: &str, dtype: DType, shape: Vec<usize>) -> Result<()> {
        ensure!(
            !self.entries.contains_key(key),
            "torch_dist item {key} declared twice"
        );
        self.order.push(key.to_string());
        self.entries.insert(
            key.to_string(),
            Entry::Tensor(GlobalTensor {
                dtype,
                shape,
                chunks: Vec::new(),
            }),
        );
        Ok(())
    }

    /// Appends `root` as a `torch.save` archive to rank `rank`'s data file: its offset and length.
    fn append(
        &mut self,
        rank: usize,
        label: &str,
        root: &Saved,
        tensors: &[TensorSlot],
        bytes: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
    ) -> Result<(String, u64, u64)> {
        let name = format!("__{rank}_0.distcp");
        if !self.files.contains_key(&name) {
            let path = self.directory.join(&name);
            let file =
                File::create(&path).with_context(|| format!("creating {}", path.display()))?;
            self.files.insert(
                name.clone(),
                DataFile {
                    writer: DirectWriter::new(&path, file),
                    end: 0,
                },
            );
        }
        let data = self.files.get_mut(&name).expect("opened above");
        let base = data.end;
        let label = format!("{}: {label}", self.directory.join(&name).display());
        let window = Window {
            sink: &mut data.writer,
            base,
        };
        let window = write_torch_archive(window, "archive", &label, root, tensors, bytes)?;
        let length = window
            .sink
            .seek(SeekFrom::End(0))
            .with_context(|| format!("writing {label}"))?
            - base;
        data.end = base + length;
        Ok((name, base, length))
    }

    /// Writes chunk `place` of tensor `key` into rank `rank`'s file; `bytes` hands the chunk's
    /// C-order little-endian bytes to `emit` in one or more pieces.
    pub fn write_chunk(
        &mut self,
        key: &str,
        rank: usize,
        place: ChunkPlace,
        bytes: impl FnMut(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
    ) -> Result<()> {
        let Some(Entry::Tensor(tensor)) = self.entries.get(key) else {
            anyhow::bail!("torch_dist tensor {key} written before it was declared");
        };
        ensure!(
            place.offsets.len() == tensor.shape.len()
                && place.sizes.len() == tensor.shape.len()
                && (0..tensor.shape.len())
                    .all(|d| place.offsets[d] + place.sizes[d] <= tensor.shape[d]),
            "torch_dist tensor {key}: chunk at {:?} of {:?} lies outside {:?}",
            place.offsets,
            place.sizes,
            tensor.shape
        );
        let slot = TensorSlot {
            dtype: tensor.dtype,
            shape: place.sizes.clone(),
        };
        let mut bytes = bytes;
        let (file, offset, length) =
            self.append(rank, key, &Saved::Tensor(0), &[slot], |_, emit| bytes(emit))?;
        self.stored.push(Stored {
            key: key.to_string(),
            offsets: Some(place.offsets.clone()),
            file,
            offset,
            length,
        });
        let Some(Entry::Tensor(tensor)) = self.entries.get_mut(key) else {
            unreachable!("checked above")
        };
        tensor.chunks.push(place);
        Ok(())
    }

    /// Writes the byte object `key` (a Megatron `ShardedObject`'s unique key, `name/shard_..`),
    /// `torch.save`d from `value`, into rank `rank`'s file.
    pub fn write_object(&mut self, key: &str, rank: usize, value: &Saved) -> Result<()> {
        ensure!(
            !self.entries.contains_key(key),
            "torch_dist item {key} written twice"
        );
        let (file, offset, length) = self.append(rank, key, value, &[], |_, _| Ok(()))?;
        self.order.push(key.to_string());
        self.entries.insert(key.to_string(), Entry::Bytes);
        self.stored.push(Stored {
            key: key.to_string(),
            offsets: None,
            file,
            offset,
            length,
        });
        Ok(())
    }

    /// The `Metadata` object of what was written.
    fn metadata(&self) -> Value {
        let mut state = Vec::new();
        for key in &self.order {
            let entry = match &self.entries[key] {
                Entry::Bytes => dataclass(METADATA_MODULE, "BytesStorageMetadata", Vec::new()),
                Entry::Tensor(tensor) => {
                    let chunks = tensor
                        .chunks
                        .iter()
                        .map(|chunk| {
                            dataclass(
                                METADATA_MODULE,
                                "ChunkStorageMetadata",
                                vec![
                                    ("offsets", size(&chunk.offsets)),
                                    ("sizes", size(&chunk.sizes)),
                                ],
                            )
                        })
                        .collect();
                    dataclass(
                        METADATA_MODULE,
                        "TensorStorageMetadata",
                        vec![
                            ("properties", tensor_properties(tensor.dtype)),
                            ("size", size(&tensor.shape)),
                            ("chunks", Value::List(chunks)),
                        ],
                    )
                }
            };
            state.push((Value::Str(key.clone()), entry));
        }
        let storage = self
            .stored
            .iter()
            .map(|item| {
                let mut index = vec![("fqn", Value::Str(item.key.clone()))];
                if let Some(offsets) = &item.offsets {
                    index.push(("offset", size(offsets)));
                }
                index.push(("index", Value::None));
                let info = dataclass(
                    "torch.distributed.checkpoint.filesystem",
                    "_StorageInfo",
                    vec![
                        ("relative_path", Value::Str(item.file.clone())),
                        ("offset", Value::Int(item.offset as i64)),
                        ("length", Value::Int(item.length as i64)),
                    ],
                );
                (dataclass(METADATA_MODULE, "MetadataIndex", index), info)
            })
            .collect();
        let storage_meta = dataclass(
            "torch.distributed.checkpoint.storage",
            "StorageMeta",
            vec![
                (
                    "checkpoint_id",
                    Value::Str(self.directory.display().to_string()),
                ),
                ("save_id", Value::None),
                ("load_id", Value::None),
                ("modules", Value::List(Vec::new())),
            ],
        );
        dataclass(
            METADATA_MODULE,
            "Metadata",
            vec![
                ("state_dict_metadata", Value::Dict(state)),
                ("planner_data", Value::None),
                ("storage_data", Value::Dict(storage)),
                ("storage_meta", storage_meta),
                ("version", Value::Str("1.0.0".into())),
            ],
        )
    }

    /// Checks that every declared tensor's chunks cover it, then writes `.metadata`,
    /// `common.pt` (`common`, whose tensors are `common_tensors`, their bytes from
    /// `common_bytes`) and `metadata.json`, and syncs the data files.
    pub fn finish(
        self,
        common: &Saved,
        common_tensors: &[TensorSlot],
        common_bytes: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
    ) -> Result<()> {
        for (key, entry) in &self.entries {
            if let Entry::Tensor(tensor) = entry {
                let covered: usize = tensor
                    .chunks
                    .iter()
                    .map(|c| c.sizes.iter().product::<usize>())
                    .sum();
                let numel: usize = tensor.shape.iter().product();
                ensure!(
                    covered == numel,
                    "torch_dist tensor {key}: the chunks written cover {covered} of {numel} elements"
                );
            }
        }
        let metadata = pickle_value(&self.metadata())?;
        for (name, data) in self.files {
            let path = self.directory.join(&name);
            data.writer
                .finish()
                .and_then(|file| file.sync_all())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        write_torch_file(
            &self.directory.join("common.pt"),
            common,
            common_tensors,
            common_bytes,
        )?;
        let path = self.directory.join("metadata.json");
        std::fs::write(&path, MEGATRON_METADATA)
            .with_context(|| format!("writing {}", path.display()))?;
        let path = self.directory.join(".metadata");
        std::fs::write(&path, metadata).with_context(|| format!("writing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_dist::DistCheckpoint;

    /// A tensor written in two row chunks by two ranks and a byte object read back through
    /// the torch_dist reader, bytes and chunking intact.
    #[test]
    fn what_is_written_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = DistWriter::create(dir.path()).unwrap();
        let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        writer.declare_tensor("w", DType::F32, vec![4, 3]).unwrap();
        for (rank, rows) in [(1, 2..4), (0, 0..2)] {
            let piece = bytes[rows.start * 12..rows.end * 12].to_vec();
            let place = ChunkPlace {
                offsets: vec![rows.start, 0],
                sizes: vec![2, 3],
            };
            writer
                .write_chunk("w", rank, place, |emit| emit(&piece))
                .unwrap();
        }
        writer
            .write_object(
                "x._extra_state/shard_0_1",
                0,
                &Saved::List(vec![Saved::Value(Value::None)]),
            )
            .unwrap();
        let common = Saved::Dict(vec![("iteration".into(), Saved::Value(Value::Int(7)))]);
        writer.finish(&common, &[], |_, _| Ok(())).unwrap();
        let read = DistCheckpoint::open(dir.path()).unwrap();
        assert_eq!(read.tensors["w"].shape, vec![4, 3]);
        assert_eq!(read.tensors["w"].chunks.len(), 2);
        assert_eq!(read.read("w").unwrap().2, bytes);
        assert_eq!(
            read.byte_items,
            vec!["x._extra_state/shard_0_1".to_string()]
        );
        assert_eq!(read.common.root.get("iteration"), Some(&Value::Int(7)));
        assert!(dir.path().join("__1_0.distcp").is_file());
    }

    /// Chunks that leave part of a tensor unwritten are refused before any metadata exists.
    #[test]
    fn an_incomplete_tensor_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = DistWriter::create(dir.path()).unwrap();
        writer.declare_tensor("w", DType::F32, vec![4]).unwrap();
        let place = ChunkPlace {
            offsets: vec![0],
            sizes: vec![2],
        };
        writer
            .write_chunk("w", 0, place, |emit| emit(&[0u8; 8]))
            .unwrap();
        let error = writer
            .finish(&Saved::Dict(Vec::new()), &[], |_, _| Ok(()))
            .unwrap_err();
        assert!(format!("{error:#}").contains("cover 2 of 4"), "{error:#}");
        assert!(!dir.path().join(".metadata").exists());
    }
}
