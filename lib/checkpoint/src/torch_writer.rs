//! Writing `torch.save` files without torch: a protocol-2 pickle of a [`Value`] tree whose
//! tensors refer to storage records, and the zip archive around it. Storages are written one
//! tensor at a time, straight from the caller's bytes.

use std::fs::File;
use std::io::{Seek, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use zip::write::FileOptions;
use zip::{CompressionMethod, ZipWriter};

use crate::direct_file::DirectWriter;
use crate::dtype::DType;
use crate::pickle::Value;

/// A tensor to be written: the pickle refers to it by index, its bytes come later.
#[derive(Debug, Clone)]
pub struct TensorSlot {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

/// The values `torch.save` pickles, plus tensors as indices into a list written alongside.
#[derive(Debug, Clone)]
pub enum Saved {
    Value(Value),
    /// `collections.OrderedDict` (what `state_dict()` returns).
    OrderedDict(Vec<(String, Saved)>),
    Dict(Vec<(String, Saved)>),
    /// A `dict` keyed by integers (an optimizer's per-parameter `state`).
    IndexedDict(Vec<(i64, Saved)>),
    /// A `dict` keyed by other values (the distributed optimizer's `(param dtype, grad dtype)`
    /// tuples beside its strings and buffer indices).
    KeyedDict(Vec<(Value, Saved)>),
    List(Vec<Saved>),
    /// `argparse.Namespace` with these attributes.
    Namespace(Vec<(String, Saved)>),
    /// The `index`th tensor handed to [`write_torch_file`].
    Tensor(usize),
}

struct Pickler {
    out: Vec<u8>,
    memo: u32,
}

impl Pickler {
    /// Memoizes the object just pushed (BINPUT / LONG_BINPUT), as Python's pickler does.
    fn put(&mut self) {
        if self.memo < 256 {
            self.out.push(b'q');
            self.out.push(self.memo as u8);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&self.memo.to_le_bytes());
        }
        self.memo += 1;
    }

    fn global(&mut self, module: &str, name: &str) {
        self.out.push(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(b'\n');
        self.put();
    }

    fn string(&mut self, text: &str) {
        self.out.push(b'X');
        self.out
            .extend_from_slice(&(text.len() as u32).to_le_bytes());
        self.out.extend_from_slice(text.as_bytes());
        self.put();
    }

    fn int(&mut self, value: i64) {
        if (0..256).contains(&value) {
            self.out.push(b'K');
            self.out.push(value as u8);
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&value) {
            self.out.push(b'J');
            self.out.extend_from_slice(&(value as i32).to_le_bytes());
        } else {
            self.out.push(0x8a);
            self.out.push(8);
            self.out.extend_from_slice(&value.to_le_bytes());
        }
    }

    fn tuple(&mut self, items: impl FnOnce(&mut Self)) {
        self.out.push(b'(');
        items(self);
        self.out.push(b't');
        self.put();
    }

    fn value(&mut self, value: &Value) -> Result<()> {
        match value {
            Value::None => self.out.push(b'N'),
            Value::Bool(b) => self.out.push(if *b { 0x88 } else { 0x89 }),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.out.push(b'G');
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.string(s),
            Value::List(items) => {
                self.out.push(b']');
                self.put();
                if !items.is_empty() {
                    self.out.push(b'(');
                    for item in items {
                        self.value(item)?;
                    }
                    self.out.push(b'e');
                }
            }
            Value::Tuple(items) => {
                let items = items.clone();
                let mut result = Ok(());
                self.tuple(|p| {
                    for item in &items {
                        if let Err(e) = p.value(item) {
                            result = Err(e);
                        }
                    }
                });
                result?;
            }
            Value::Global { module, name } => self.global(module, name),
            Value::Dict(items) => {
                self.out.push(b'}');
                self.put();
                for (k, v) in items {
                    self.value(k)?;
                    self.value(v)?;
                    self.out.push(b's');
                }
            }
            Value::Object {
                module,
                name,
                args,
                state,
            } => self.object(module, name, args, state.as_deref())?,
            other => bail!("cannot write {} into a torch file", other.describe()),
        }
        Ok(())
    }

    /// An instance: `cls.__new__(cls, *args)` then its state set (BUILD), as pickle saves a
    /// dataclass; without a state, `cls(*args)` (REDUCE), as `torch.Size` and enums are saved.
    fn object(
        &mut self,
        module: &str,
        name: &str,
        args: &[Value],
        state: Option<&Value>,
    ) -> Result<()> {
        self.global(module, name);
        self.value(&Value::Tuple(args.to_vec()))?;
        match state {
            Some(state) => {
                self.out.push(0x81); // NEWOBJ
                self.put();
                self.value(state)?;
                self.out.push(b'b'); // BUILD
            }
            None => {
                self.out.push(b'R');
                self.put();
            }
        }
        Ok(())
    }

    fn entries(&mut self, entries: &[(String, Saved)], tensors: &[TensorSlot]) -> Result<()> {
        for (key, value) in entries {
            self.string(key);
            self.saved(value, tensors)?;
            self.out.push(b's');
        }
        Ok(())
    }

    fn saved(&mut self, saved: &Saved, tensors: &[TensorSlot]) -> Result<()> {
        match saved {
            Saved::Value(v) => self.value(v)?,
            Saved::Dict(entries) => {
                self.out.push(b'}');
                self.put();
                self.entries(entries, tensors)?;
            }
            Saved::IndexedDict(entries) => {
                self.out.push(b'}');
                self.put();
                for (key, value) in entries {
                    self.int(*key);
                    self.saved(value, tensors)?;
                    self.out.push(b's');
                }
            }
            Saved::KeyedDict(entries) => {
                self.out.push(b'}');
                self.put();
                for (key, value) in entries {
                    self.value(key)?;
                    self.saved(value, tensors)?;
                    self.out.push(b's');
                }
            }
            Saved::OrderedDict(entries) => {
                self.global("collections", "OrderedDict");
                self.out.push(b')');
                self.out.push(b'R');
                self.put();
                self.entries(entries, tensors)?;
            }
            Saved::Namespace(entries) => {
                self.global("argparse", "Namespace");
                self.out.push(b')');
                self.out.push(0x81); // NEWOBJ
                self.put();
                self.out.push(b'}');
                self.put();
                self.entries(entries, tensors)?;
                self.out.push(b'b'); // BUILD: the attribute dict
            }
            Saved::List(items) => {
                self.out.push(b']');
                self.put();
                for item in items {
                    self.saved(item, tensors)?;
                    self.out.push(b'a');
                }
            }
            Saved::Tensor(index) => {
                let slot = tensors
                    .get(*index)
                    .with_context(|| format!("tensor {index} of {}", tensors.len()))?;
                let numel: usize = slot.shape.iter().product();
                let mut stride = vec![1usize; slot.shape.len()];
                for d in (0..slot.shape.len().saturating_sub(1)).rev() {
                    stride[d] = stride[d + 1] * slot.shape[d + 1];
                }
                self.global("torch._utils", "_rebuild_tensor_v2");
                self.out.push(b'(');
                // Persistent id: ('storage', torch.<Type>Storage, key, location, numel).
                self.tuple(|p| {
                    p.string("storage");
                    p.global("torch", slot.dtype.storage_class());
                    p.string(&index.to_string());
                    p.string("cpu");
                    p.int(numel as i64);
                });
                self.out.push(b'Q');
                self.int(0);
                self.tuple(|p| slot.shape.iter().for_each(|&d| p.int(d as i64)));
                self.tuple(|p| stride.iter().for_each(|&d| p.int(d as i64)));
                self.out.push(0x89);
                self.global("collections", "OrderedDict");
                self.out.push(b')');
                self.out.push(b'R');
                self.put();
                self.out.push(b't');
                self.put();
                self.out.push(b'R');
                self.put();
            }
        }
        Ok(())
    }
}

/// Writes `root` as `torch.save` would to `path`; `tensors[i]` describes `Saved::Tensor(i)` and
/// `bytes(i, emit)` hands its C-order little-endian bytes to `emit` in one or more pieces, in
/// order, asked for one tensor at a time (so no tensor need be in memory whole).
pub fn write_torch_file(
    path: &Path,
    root: &Saved,
    tensors: &[TensorSlot],
    bytes: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<()> {
    let archive = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "archive".into());
    let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let label = path.display().to_string();
    write_torch_archive(
        DirectWriter::new(path, file),
        &archive,
        &label,
        root,
        tensors,
        bytes,
    )?
    .finish()
    .with_context(|| format!("writing {label}"))?
    .sync_all()
    .with_context(|| format!("writing {label}"))
}

/// The pickle (protocol 2) of `value`, as `pickle.dump` writes it: what `torch.distributed`'s
/// `.metadata` file holds.
pub fn pickle_value(value: &Value) -> Result<Vec<u8>> {
    let mut pickler = Pickler {
        out: vec![0x80, 2],
        memo: 0,
    };
    pickler.value(value)?;
    pickler.out.push(b'.');
    Ok(pickler.out)
}

/// Writes the `torch.save` archive of `root` (named `archive` inside, as `torch.save` names
/// the folder of its records) into `sink` from the sink's position 0, and hands the sink back.
/// `label` names the output in errors.
pub fn write_torch_archive<W: Write + Seek>(
    sink: W,
    archive: &str,
    label: &str,
    root: &Saved,
    tensors: &[TensorSlot],
    mut bytes: impl FnMut(usize, &mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<W> {
    let mut pickler = Pickler {
        out: vec![0x80, 2],
        memo: 0,
    };
    pickler.saved(root, tensors)?;
    pickler.out.push(b'.');
    let mut zip = ZipWriter::new(sink);
    let options = FileOptions::default()
        .compression_method(CompressionMethod::Stored)
        .large_file(true);
    let context = || format!("writing {label}");
    zip.start_file_aligned(format!("{archive}/data.pkl"), options, 64)
        .with_context(context)?;
    zip.write_all(&pickler.out).with_context(context)?;
    zip.start_file_aligned(format!("{archive}/byteorder"), options, 64)
        .with_context(context)?;
    zip.write_all(b"little").with_context(context)?;
    for (index, slot) in tensors.iter().enumerate() {
        let expected = slot.shape.iter().product::<usize>() * slot.dtype.size();
        zip.start_file_aligned(format!("{archive}/data/{index}"), options, 64)
            .with_context(context)?;
        let mut written = 0;
        bytes(index, &mut |data| {
            written += data.len();
            zip.write_all(data).with_context(context)
        })?;
        anyhow::ensure!(
            written == expected,
            "{label}: tensor {index}: {written} bytes, {expected} expected"
        );
    }
    zip.start_file_aligned(format!("{archive}/version"), options, 64)
        .with_context(context)?;
    zip.write_all(b"3\n").with_context(context)?;
    zip.finish().with_context(context)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_file::TorchFile;

    #[test]
    fn what_is_written_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model_optim_rng.pt");
        let root = Saved::Dict(vec![
            ("checkpoint_version".into(), Saved::Value(Value::Float(3.0))),
            (
                "args".into(),
                Saved::Namespace(vec![("num_layers".into(), Saved::Value(Value::Int(2)))]),
            ),
            (
                "model".into(),
                Saved::OrderedDict(vec![
                    ("w".into(), Saved::Tensor(0)),
                    ("x._extra_state".into(), Saved::Value(Value::None)),
                ]),
            ),
        ]);
        let tensors = [TensorSlot {
            dtype: DType::F32,
            shape: vec![2, 3],
        }];
        let data: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        write_torch_file(&path, &root, &tensors, |_, emit| emit(&data)).unwrap();
        let file = TorchFile::open(&path).unwrap();
        assert_eq!(
            file.root.get("checkpoint_version"),
            Some(&Value::Float(3.0))
        );
        assert_eq!(
            file.root.get("args").and_then(|a| a.get("num_layers")),
            Some(&Value::Int(2))
        );
        let model = file.root.get("model").unwrap();
        let Some(Value::Tensor(w)) = model.get("w") else {
            panic!("{model:?}")
        };
        assert_eq!(w.shape, vec![2, 3]);
        assert_eq!(file.tensor_bytes(w).unwrap().as_ref(), data.as_slice());
        assert_eq!(model.get("x._extra_state"), Some(&Value::None));
    }
}
