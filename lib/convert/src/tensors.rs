//! CPU tensors from the raw bytes the checkpoint formats hand out, and the vocabulary rows of
//! an embedding fitted to a padded size: what both the lazy tensors and the model state use.

use anyhow::{bail, ensure, Result};
use megatron_checkpoint::DType;
use tch::{Kind, Tensor};

/// The libtorch kind of a checkpoint dtype.
pub fn kind_of(dtype: DType) -> Result<Kind> {
    Ok(match dtype {
        DType::F64 => Kind::Double,
        DType::F32 => Kind::Float,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::I16 => Kind::Int16,
        DType::I8 => Kind::Int8,
        DType::U8 => Kind::Uint8,
        DType::Bool => Kind::Bool,
    })
}

pub fn kind_named(name: &str) -> Result<Kind> {
    match DType::from_torch_name(name) {
        Some(dtype) => kind_of(dtype),
        None => bail!("unknown dtype {name}"),
    }
}

/// A CPU tensor holding a copy of `bytes` (C order, little-endian).
pub fn tensor_from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    ensure!(
        bytes.len() == numel * dtype.size(),
        "{} bytes for a {dtype} tensor of shape {shape:?}",
        bytes.len()
    );
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Ok(Tensor::from_data_size(bytes, &shape, kind_of(dtype)?))
}

/// The word embedding or output layer cut or padded (with zero rows) to `rows`.
pub fn fit_vocab_rows(tensor: &Tensor, rows: i64) -> Tensor {
    let have = tensor.size()[0];
    if have >= rows {
        tensor.narrow(0, 0, rows)
    } else {
        let mut shape = tensor.size();
        shape[0] = rows - have;
        Tensor::cat(
            &[
                tensor,
                &tensor.new_zeros(shape.as_slice(), (tensor.kind(), tensor.device())),
            ],
            0,
        )
    }
}
