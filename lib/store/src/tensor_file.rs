//! Tensors to and from safetensors files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use std::io::Write;

use anyhow::{bail, ensure, Context, Result};

use megatron_checkpoint::direct_file::DirectWriter;
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, View};
use tch::{Device, Kind, Tensor};

fn dtype_of(kind: Kind) -> Result<Dtype> {
    Ok(match kind {
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        other => bail!("tensors of kind {other:?} cannot be stored"),
    })
}

fn kind_of(dtype: Dtype) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        other => bail!("safetensors dtype {other:?} is not supported"),
    })
}

/// The safetensors crate displays its errors as their `Debug` form
/// (`IoError(Os { code: 28, kind: StorageFull, .. })`): this says them for people.
fn explain(error: SafeTensorError) -> anyhow::Error {
    let text = match error {
        SafeTensorError::IoError(e) => return anyhow::Error::new(e),
        SafeTensorError::JsonError(e) => format!("invalid header: {e}"),
        SafeTensorError::InvalidHeader => "the header is not UTF-8".into(),
        SafeTensorError::InvalidHeaderStart => "the header does not start with '{'".into(),
        SafeTensorError::InvalidHeaderDeserialization => "the header is not valid JSON".into(),
        SafeTensorError::HeaderTooLarge => "the header is larger than 100 MB".into(),
        SafeTensorError::HeaderTooSmall => "the file is shorter than its 8-byte header".into(),
        SafeTensorError::InvalidHeaderLength => {
            "the header length runs past the end of the file".into()
        }
        SafeTensorError::TensorNotFound(name) => format!("no tensor {name}"),
        SafeTensorError::TensorInvalidInfo => {
            "a tensor's shape and dtype do not match its offsets".into()
        }
        SafeTensorError::InvalidOffset(name) => format!("tensor {name} has invalid offsets"),
        SafeTensorError::InvalidTensorView(dtype, shape, bytes) => {
            format!("a {dtype:?} tensor of shape {shape:?} cannot hold {bytes} bytes")
        }
        SafeTensorError::MetadataIncompleteBuffer => {
            "the tensors do not cover the file's data (truncated or padded file)".into()
        }
        SafeTensorError::ValidationOverflow => "a tensor's size overflows".into(),
    };
    anyhow::anyhow!(text)
}

/// A contiguous CPU tensor viewed as bytes for the writer.
struct HostTensor {
    tensor: Tensor,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl HostTensor {
    fn new(tensor: &Tensor) -> Result<Self> {
        let dtype = dtype_of(tensor.kind())?;
        let tensor = tensor.detach().to_device(Device::Cpu).contiguous();
        let shape = tensor.size().iter().map(|&d| d as usize).collect();
        Ok(HostTensor {
            tensor,
            dtype,
            shape,
        })
    }
}

impl View for &HostTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(cpu_bytes(&self.tensor))
    }

    fn data_len(&self) -> usize {
        self.tensor.numel() * self.dtype.size()
    }
}

/// Writes `tensors` with string `metadata` in the safetensors header.
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let host: Vec<(String, HostTensor)> = tensors
        .iter()
        .map(|(name, t)| {
            Ok((
                name.clone(),
                HostTensor::new(t).with_context(|| format!("tensor {name}"))?,
            ))
        })
        .collect::<Result<_>>()?;
    let views = host.iter().map(|(name, t)| (name.as_str(), t));
    safetensors::tensor::serialize_to_file(views, &Some(metadata), path)
        .map_err(explain)
        .with_context(|| format!("writing {}", path.display()))?;
    File::open(path)
        .and_then(|file| file.sync_all())
        .with_context(|| format!("syncing {}", path.display()))
}

/// One tensor of a file written by [`write_tensors_streamed`]: its data arrives later.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
}

impl TensorEntry {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<i64>() as usize * self.kind.elt_size_in_bytes()
    }
}

/// Writes a safetensors file whose tensors are produced one after another: the header is made
/// from `entries`, then `produce(i, emit)` hands entry `i`'s data to `emit` as one or more
/// tensors of its kind whose elements, in order, make it (so a flat buffer can be written
/// parameter by parameter). Only the tensor being written is in memory.
pub fn write_tensors_streamed(
    path: &Path,
    entries: &[TensorEntry],
    metadata: HashMap<String, String>,
    mut produce: impl FnMut(usize, &mut dyn FnMut(&Tensor) -> Result<()>) -> Result<()>,
) -> Result<()> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::to_value(&metadata)?);
    let mut offset = 0;
    for entry in entries {
        let dtype = dtype_of(entry.kind).with_context(|| format!("tensor {}", entry.name))?;
        let end = offset + entry.bytes();
        header.insert(
            entry.name.clone(),
            serde_json::json!({"dtype": dtype, "shape": entry.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut header = serde_json::to_vec(&header)?;
    // Data starts 8-byte aligned, as the safetensors crate writes it.
    header.resize(header.len().next_multiple_of(8), b' ');
    let context = || format!("writing {}", path.display());
    let file = File::create(path).with_context(context)?;
    let mut out = BackgroundWriter::new(path, file);
    out.send(Piece::Bytes((header.len() as u64).to_le_bytes().to_vec()))?;
    out.send(Piece::Bytes(header))?;
    for (i, entry) in entries.iter().enumerate() {
        let mut written = 0usize;
        let mut emit = |tensor: &Tensor| -> Result<()> {
            ensure!(
                tensor.kind() == entry.kind,
                "tensor {}: {:?} data for a {:?} tensor",
                entry.name,
                tensor.kind(),
                entry.kind
            );
            let tensor = tensor.to_device(Device::Cpu).contiguous();
            written += tensor.numel() * entry.kind.elt_size_in_bytes();
            out.send(Piece::Tensor(tensor))
        };
        produce(i, &mut emit)
            .with_context(|| format!("{}: tensor {}", path.display(), entry.name))?;
        ensure!(
            written == entry.bytes(),
            "{}: tensor {} got {written} bytes of data, its shape {:?} needs {}",
            path.display(),
            entry.name,
            entry.shape,
            entry.bytes()
        );
    }
    let (length, crc) = out.finish()?;
    super::checksum::remember_written(path, length, crc);
    Ok(())
}

/// Data on its way to a file.
enum Piece {
    Bytes(Vec<u8>),
    /// A contiguous CPU tensor.
    Tensor(Tensor),
}

impl Piece {
    fn bytes(&self) -> &[u8] {
        match self {
            Piece::Bytes(bytes) => bytes,
            Piece::Tensor(tensor) => cpu_bytes(tensor),
        }
    }
}

/// The C-order little-endian bytes of a contiguous CPU tensor, borrowed from it.
pub fn cpu_bytes(tensor: &Tensor) -> &[u8] {
    assert!(
        tensor.device() == Device::Cpu && tensor.is_contiguous(),
        "the bytes of a tensor that is not contiguous on the CPU"
    );
    let len = tensor.numel() * tensor.kind().elt_size_in_bytes();
    if len == 0 {
        return &[];
    }
    // SAFETY: a contiguous CPU tensor of `len` bytes, alive for the borrow.
    unsafe { std::slice::from_raw_parts(tensor.data_ptr() as *const u8, len) }
}

/// Pieces in flight to a [`BackgroundWriter`]: enough to keep it busy, few enough to bound
/// memory to a few of them.
const PIECES_IN_FLIGHT: usize = 2;

/// Writes a file from a thread of its own — the write (bypassing the page cache where it can,
/// [`DirectWriter`]), the checksum and the final `fsync` — so that they overlap with reading
/// and converting the next pieces.
struct BackgroundWriter {
    path: std::path::PathBuf,
    sender: Option<std::sync::mpsc::SyncSender<Piece>>,
    thread: Option<std::thread::JoinHandle<Result<(u64, u32)>>>,
}

impl BackgroundWriter {
    fn new(path: &Path, file: File) -> Self {
        let (sender, receiver) = std::sync::mpsc::sync_channel::<Piece>(PIECES_IN_FLIGHT);
        let context = path.display().to_string();
        let target = path.to_path_buf();
        let thread = std::thread::spawn(move || -> Result<(u64, u32)> {
            let mut out = DirectWriter::new(&target, file);
            let (mut length, mut crc) = (0u64, 0u32);
            for piece in receiver {
                let bytes = piece.bytes();
                crc = crc32c::crc32c_append(crc, bytes);
                length += bytes.len() as u64;
                out.write_all(bytes)
                    .with_context(|| format!("writing {context}"))?;
            }
            let file = out.finish().with_context(|| format!("writing {context}"))?;
            file.sync_all()
                .with_context(|| format!("syncing {context}"))?;
            Ok((length, crc))
        });
        BackgroundWriter {
            path: path.to_path_buf(),
            sender: Some(sender),
            thread: Some(thread),
        }
    }

    fn send(&mut self, piece: Piece) -> Result<()> {
        let sender = self.sender.as_ref().context("the writer has finished")?;
        if sender.send(piece).is_ok() {
            return Ok(());
        }
        // The writer stopped on an error: report it.
        self.finish()?;
        bail!("{}: the writer stopped early", self.path.display())
    }

    /// Waits until every piece is written and the file synced: its length and CRC-32C.
    fn finish(&mut self) -> Result<(u64, u32)> {
        self.sender = None;
        let thread = self.thread.take().context("the writer has finished")?;
        match thread.join() {
            Ok(result) => result,
            Err(_) => bail!("{}: the writer thread panicked", self.path.display()),
        }
    }
}

impl Drop for BackgroundWriter {
    /// A write abandoned on an error still waits for its thread, so that nothing writes into
    /// a staging directory after it is removed.
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}

/// Reads every tensor of a safetensors file onto `device`, with the header's metadata.
pub fn read_tensors(
    path: &Path,
    device: Device,
) -> Result<(HashMap<String, Tensor>, HashMap<String, String>)> {
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    // SAFETY: checkpoint files are not modified while a run reads them.
    let bytes = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("mapping {}", path.display()))?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(explain)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let file_tensors = SafeTensors::deserialize(&bytes)
        .map_err(explain)
        .with_context(|| format!("{}: corrupt safetensors file", path.display()))?;
    let mut out = HashMap::new();
    for (name, view) in file_tensors.tensors() {
        let kind =
            kind_of(view.dtype()).with_context(|| format!("{}: tensor {name}", path.display()))?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let tensor = Tensor::from_data_size(view.data(), &shape, kind).to_device(device);
        out.insert(name, tensor);
    }
    Ok((out, metadata))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_files_read_back_like_written_ones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        let a = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[1.5f32, -2.0, 4.0]).to_kind(Kind::BFloat16);
        let entries = [
            TensorEntry {
                name: "b".into(),
                kind: Kind::BFloat16,
                shape: vec![3],
            },
            TensorEntry {
                name: "a".into(),
                kind: Kind::Float,
                shape: vec![2, 3],
            },
        ];
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        write_tensors_streamed(&path, &entries, metadata, |i, emit| match i {
            0 => emit(&b),
            // In two pieces, the second one a transposed (non-contiguous) view.
            _ => {
                emit(&a.narrow(0, 0, 1))?;
                emit(&a.narrow(0, 1, 1).transpose(0, 1))
            }
        })
        .unwrap();
        let (read, meta) = read_tensors(&path, Device::Cpu).unwrap();
        assert_eq!(meta["format"], "pt");
        assert!(read["a"].equal(&a));
        assert!(read["b"].equal(&b));
        let error = format!(
            "{:#}",
            write_tensors_streamed(&path, &entries, HashMap::new(), |_, emit| emit(&b))
                .unwrap_err()
        );
        assert!(
            error.contains("tensor a: BFloat16 data for a Float tensor"),
            "{error}"
        );
    }

    #[test]
    fn round_trip_keeps_values_kinds_and_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = Tensor::arange(6, (Kind::Float, Device::Cpu)).view([2, 3]);
        let b = Tensor::from_slice(&[1.5f32, -2.0]).to_kind(Kind::BFloat16);
        let c = Tensor::from_slice(&[7i64]);
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        write_tensors(
            &path,
            &[
                ("a".into(), a.transpose(0, 1)),
                ("b".into(), b.shallow_clone()),
                ("c".into(), c),
            ],
            metadata,
        )
        .unwrap();
        let (read, meta) = read_tensors(&path, Device::Cpu).unwrap();
        assert_eq!(meta["format"], "pt");
        assert!(read["a"].equal(&a.transpose(0, 1).contiguous()));
        assert_eq!(read["b"].kind(), Kind::BFloat16);
        assert!(read["b"].equal(&b));
        assert_eq!(read["c"].int64_value(&[0]), 7);
        std::fs::write(&path, b"garbage").unwrap();
        let error = format!("{:#}", read_tensors(&path, Device::Cpu).unwrap_err());
        assert!(error.contains("t.safetensors"), "{error}");
        assert!(
            error.ends_with("the file is shorter than its 8-byte header"),
            "{error}"
        );
        let error = format!(
            "{:#}",
            write_tensors(
                &dir.path().join("missing/t.safetensors"),
                &[],
                HashMap::new()
            )
            .unwrap_err()
        );
        assert!(
            error.ends_with("t.safetensors: No such file or directory (os error 2)"),
            "{error}"
        );
    }
}
