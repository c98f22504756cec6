//! `torch_dist` global tensors as unsplit lazy tensors by Megatron-core name: each read from
//! its `.distcp` chunks where they tile it by row slabs or column blocks, a stacked
//! `decoder.layers.*` tensor cut per layer, the rest read whole.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use megatron_checkpoint::DistCheckpoint;

use super::lazy::{tensor_of, InputFile, LazyTensor};
use super::state::Tensors;
use megatron_models::gpt::megatron_names::core_name;
use megatron_models::TransformerConfig;
use megatron_store::has_vocab_rows;

/// A `torch_dist` global tensor's saved chunks as lazy tensors, with their offsets, each read
/// from its `.distcp` file when a saver asks.
pub(super) fn dist_chunks(
    checkpoint: &DistCheckpoint,
    name: &str,
    inputs: &mut HashMap<String, Arc<InputFile>>,
) -> Result<Vec<(Vec<usize>, LazyTensor)>> {
    let tensor = &checkpoint.tensors[name];
    tensor
        .chunks
        .iter()
        .map(|chunk| {
            let input = match inputs.get(&chunk.file) {
                Some(input) => input.clone(),
                None => {
                    let input = InputFile::open(&checkpoint.data_path(&chunk.file))?;
                    inputs.insert(chunk.file.clone(), input.clone());
                    input
                }
            };
            let (archive, stored) = checkpoint.chunk_archive(name, chunk)?;
            let mut offsets = chunk.offsets.clone();
            offsets.resize(tensor.shape.len(), 0);
            Ok((offsets, tensor_of(&archive, &input, &stored)?))
        })
        .collect()
}

/// The tensor of `shape` that `chunks` (each at its offsets) tile, read lazily where they are
/// slabs of whole rows or (2-D) equal column blocks; `None` for other tilings.
fn tiled(shape: &[usize], mut chunks: Vec<(Vec<usize>, LazyTensor)>) -> Result<Option<LazyTensor>> {
    let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    chunks.sort_by(|a, b| a.0.cmp(&b.0));
    if let [(_, only)] = chunks.as_slice() {
        return Ok((only.shape() == shape.as_slice()).then(|| only.clone()));
    }
    let whole_from = |dim: usize| {
        chunks.iter().all(|(_, c)| {
            c.shape().len() == shape.len()
                && (0..shape.len()).all(|d| d == dim || c.shape()[d] == shape[d])
        })
    };
    if !shape.is_empty() && whole_from(0) {
        let mut at = 0;
        for (offsets, c) in &chunks {
            if offsets[0] as i64 != at {
                return Ok(None);
            }
            at += c.shape()[0];
        }
        if at != shape[0] {
            return Ok(None);
        }
        let pieces = chunks
            .iter()
            .map(|(_, c)| c.flat_slice(0, c.numel(), vec![c.numel()]))
            .collect::<Result<Vec<_>>>()?;
        return LazyTensor::concat(pieces, shape).map(Some);
    }
    if shape.len() == 2 && whole_from(1) {
        let width = chunks[0].1.shape()[1];
        let tiles = chunks.iter().enumerate().all(|(i, (offsets, c))| {
            c.shape()[1] == width && offsets[1] as i64 == i as i64 * width
        });
        if tiles && width * chunks.len() as i64 == shape[1] {
            let blocks = chunks.into_iter().map(|(_, c)| c).collect();
            return LazyTensor::joined(blocks, megatron_store::TensorSplit::Columns).map(Some);
        }
    }
    Ok(None)
}

/// The leaf of a layer stack's routed experts in `torch_dist` (Megatron's `SequentialMLP` and
/// grouped experts save them under `…mlp.experts.experts.*` with an expert axis).
const STACKED_EXPERTS: &str = "mlp.experts.experts.";

/// Turns a checkpoint's global tensors into unsplit tensors by Megatron-core name.
pub(super) struct Placement<'a> {
    pub directory: &'a Path,
    pub config: &'a TransformerConfig,
}

impl Placement<'_> {
    /// Puts the global tensor `name` of `shape`, saved as `chunks` (each at its offsets), into
    /// `out`: one tensor per layer for a stacked `decoder.layers.*` tensor, the vocabulary
    /// padded for one rank. `eager` reads a range of the first dimension at once where the
    /// chunks do not tile a tensor lazily.
    pub fn place(
        &self,
        out: &mut Tensors,
        name: &str,
        shape: &[usize],
        chunks: Vec<(Vec<usize>, LazyTensor)>,
        eager: &dyn Fn(std::ops::Range<usize>) -> Result<tch::Tensor>,
    ) -> Result<()> {
        let context = || format!("{}: tensor {name}", self.directory.display());
        let config = self.config;
        // Homogeneous layer stacks are saved with a leading layer axis.
        if let Some(leaf) = name.strip_prefix("decoder.layers.").filter(|rest| {
            !rest
                .split('.')
                .next()
                .is_some_and(|i| i.parse::<usize>().is_ok())
        }) {
            ensure!(
                shape.first() == Some(&config.num_layers),
                "{}: stacked tensor {name} has shape {shape:?} for {} layers",
                self.directory.display(),
                config.num_layers
            );
            // Routed experts are saved with an expert axis after the layer axis.
            let experts = match leaf.strip_prefix(STACKED_EXPERTS) {
                Some(_) => {
                    let moe = config.moe.as_ref().with_context(|| {
                        format!("{}: tensor {name} holds routed experts, but the args describe a dense model", self.directory.display())
                    })?;
                    ensure!(
                        shape.get(1) == Some(&(moe.num_experts as usize)),
                        "{}: tensor {name} has shape {shape:?}: {} experts, the args' num_experts is {}",
                        self.directory.display(),
                        shape.get(1).copied().unwrap_or(0),
                        moe.num_experts
                    );
                    Some(moe.num_experts as usize)
                }
                None => None,
            };
            let stacked_axes = 1 + usize::from(experts.is_some());
            let item_shape = &shape[stacked_axes..];
            for layer in 0..config.num_layers {
                for expert in 0..experts.unwrap_or(1) {
                    let index: Vec<usize> = match experts {
                        Some(_) => vec![layer, expert],
                        None => vec![layer],
                    };
                    let item = match (experts, leaf.strip_prefix(STACKED_EXPERTS)) {
                        (Some(_), Some(rest)) => {
                            format!(
                                "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{rest}"
                            )
                        }
                        _ => format!("decoder.layers.{layer}.{leaf}"),
                    };
                    let Some(global) = core_name(&item) else {
                        continue;
                    };
                    let mut pieces = Vec::new();
                    for (offsets, chunk) in &chunks {
                        let sizes = chunk.shape();
                        let inside = (0..stacked_axes).all(|d| {
                            (offsets[d]..offsets[d] + sizes[d] as usize).contains(&index[d])
                        });
                        if !inside {
                            continue;
                        }
                        let inner: Vec<i64> = sizes[stacked_axes..].to_vec();
                        let len = inner.iter().product::<i64>();
                        let position = match experts {
                            Some(_) => {
                                (index[0] - offsets[0]) * sizes[1] as usize + index[1] - offsets[1]
                            }
                            None => index[0] - offsets[0],
                        };
                        let piece = chunk.flat_slice(position as i64 * len, len, inner)?;
                        pieces.push((offsets[stacked_axes..].to_vec(), piece));
                    }
                    let value = match tiled(item_shape, pieces).with_context(context)? {
                        Some(value) => value,
                        None => {
                            let layers = eager(layer..layer + 1)
                                .with_context(context)?
                                .squeeze_dim(0);
                            match experts {
                                Some(_) => layers.get(expert as i64),
                                None => layers,
                            }
                            .into()
                        }
                    };
                    out.insert(global, value);
                }
            }
            return Ok(());
        }
        let Some(global) = core_name(name) else {
            return Ok(());
        };
        let mut value = match tiled(shape, chunks).with_context(context)? {
            Some(value) => value,
            None => eager(0..shape.first().copied().unwrap_or(1))
                .with_context(context)?
                .into(),
        };
        if has_vocab_rows(&global) {
            value = value.with_rows(config.padded_vocab_size(1));
        }
        out.insert(global, value);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// `torch_dist` chunks tiling a tensor by row slabs (in any order) or by equal column
    /// blocks read as the tensor; other tilings are left to the eager reader.
    #[test]
    fn chunks_tile_by_rows_or_column_blocks() {
        let whole = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([6, 4]);
        let piece = |rows: (i64, i64), columns: (i64, i64)| {
            let offsets = vec![rows.0 as usize, columns.0 as usize];
            let block = whole
                .narrow(0, rows.0, rows.1)
                .narrow(1, columns.0, columns.1)
                .contiguous();
            (offsets, LazyTensor::from(block))
        };
        let slabs = vec![piece((2, 4), (0, 4)), piece((0, 2), (0, 4))];
        let read = tiled(&[6, 4], slabs).unwrap().unwrap().read().unwrap();
        assert!(read.equal(&whole));
        let blocks = vec![piece((0, 6), (2, 2)), piece((0, 6), (0, 2))];
        let read = tiled(&[6, 4], blocks).unwrap().unwrap().read().unwrap();
        assert!(read.equal(&whole));
        let grid = vec![
            piece((0, 3), (0, 2)),
            piece((0, 3), (2, 2)),
            piece((3, 3), (0, 2)),
            piece((3, 3), (2, 2)),
        ];
        assert!(tiled(&[6, 4], grid).unwrap().is_none());
        let gap = vec![piece((0, 2), (0, 4)), piece((3, 3), (0, 4))];
        assert!(tiled(&[6, 4], gap).unwrap().is_none());
        // One layer of a stacked [layers, rows, columns] tensor, cut from a slab of layers.
        let stacked = whole.view([3, 2, 4]);
        let layers = LazyTensor::from(stacked.narrow(0, 1, 2).contiguous());
        let second = layers.flat_slice(8, 8, vec![2, 4]).unwrap();
        assert!(second.read().unwrap().equal(&stacked.get(2)));
    }
}
