//! safetensors files read in place through a memory map (HuggingFace weights, our shards).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors};

use crate::dtype::DType;
use crate::torch_file::map_file;

/// A tensor's place in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

pub struct SafetensorsFile {
    path: PathBuf,
    map: Arc<Mmap>,
}

fn dtype_of(dtype: Dtype) -> Result<DType> {
    Ok(match dtype {
        Dtype::F64 => DType::F64,
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I16 => DType::I16,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        other => bail!("safetensors dtype {other:?} is not supported"),
    })
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let map = map_file(path)?;
        SafeTensors::deserialize(&map).with_context(|| {
            format!(
                "{}: not a valid safetensors file (truncated?)",
                path.display()
            )
        })?;
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            map,
        })
    }

    fn view(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.map).expect("validated at open")
    }

    /// Tensor names, dtypes and shapes, sorted by name.
    pub fn tensors(&self) -> Vec<(String, TensorInfo)> {
        let mut out: Vec<(String, TensorInfo)> = self
            .view()
            .tensors()
            .into_iter()
            .filter_map(|(name, view)| {
                let dtype = dtype_of(view.dtype()).ok()?;
                Some((
                    name,
                    TensorInfo {
                        dtype,
                        shape: view.shape().to_vec(),
                    },
                ))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// The bytes of tensor `name`, borrowed from the map.
    pub fn tensor(&self, name: &str) -> Result<(TensorInfo, &[u8])> {
        let tensors = self.view();
        let view = tensors
            .tensor(name)
            .with_context(|| format!("{}: no tensor {name}", self.path.display()))?;
        let dtype =
            dtype_of(view.dtype()).with_context(|| format!("{}: {name}", self.path.display()))?;
        let shape = view.shape().to_vec();
        let data = view.data();
        // The view borrows from the map that `self` owns.
        let start = data.as_ptr() as usize - self.map.as_ptr() as usize;
        Ok((
            TensorInfo { dtype, shape },
            &self.map[start..start + data.len()],
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
