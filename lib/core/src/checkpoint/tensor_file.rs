//! Tensors to and from safetensors files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use anyhow::{bail, Context, Result};
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
        // SAFETY: the tensor is contiguous on the CPU and outlives the borrow.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(self.tensor.data_ptr() as *const u8, self.data_len())
        })
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
    File::open(path)?
        .sync_all()
        .with_context(|| format!("syncing {}", path.display()))
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
