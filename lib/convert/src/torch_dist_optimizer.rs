//! The optimizer's state in a `torch_dist` checkpoint: for model tensor `K`,
//! `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.K`. The plain optimizer saves them in the
//! model tensor's shape; the distributed optimizer's `fully_sharded_model_space` (core_v0.14.0's
//! default with `--ckpt-fully-parallel-save`) in shape `F ++ [n]`: `F` the grid of the model
//! tensor's chunks (the layer axis of a stacked tensor, tensor-parallel splits), each chunk
//! flattened into `n` elements and saved in the data-parallel ranks' ranges of it. Its
//! `dp_zero_gather_scatter` (core_v0.14.0 without `--ckpt-fully-parallel-save`) saves each
//! model-parallel rank's `get_parameter_state_dp_zero` dictionary as one object, the layout of
//! `distrib_optim.pt` ([`super::distrib_optim`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::{DistCheckpoint, Value};
use tch::{Device, Kind, Tensor};

use super::dist_tensors::{dist_chunks, Placement};
use super::distrib_optim::{dp_zero_state, param_groups_step, Bucketing};
use super::lazy::{InputFile, LazyTensor};
use super::megatron_save::rank_chunk_params;
use super::ours::join_parts;
use super::state::{ModelState, OptimizerState};
use megatron_models::PipelineSplit;

/// How a torch_dist checkpoint (its `common.pt` is `root`) saved the distributed optimizer's
/// state: Megatron's `distrib_optim_sharding_type`, `None` without one.
pub(super) fn sharding_type(root: &Value) -> Option<&str> {
    root.get("content_metadata")
        .and_then(|m| m.get("distrib_optim_sharding_type"))
        .or_else(|| root.get("optimizer")?.get("param_state_sharding_type"))
        .and_then(Value::as_str)
}

/// Megatron's `dp_zero_gather_scatter` sharding.
pub(super) const DP_ZERO_GATHER_SCATTER: &str = "dp_zero_gather_scatter";

/// `optimizer.state.<kind>` names and where their tensors go.
const KINDS: [&str; 3] = ["fp32_param", "exp_avg", "exp_avg_sq"];

/// The optimizer state of `checkpoint` (its `common.pt` is `root`), unsplit by Megatron-core
/// name; `None` where it was saved without one.
pub(super) fn optimizer_state(
    checkpoint: &DistCheckpoint,
    root: &Value,
    placement: &Placement,
    inputs: &mut HashMap<String, Arc<InputFile>>,
) -> Result<Option<OptimizerState>> {
    let common = checkpoint.common.path().display().to_string();
    let Some(optimizer) = root.get("optimizer") else {
        return Ok(None);
    };
    match sharding_type(root) {
        None | Some("fully_sharded_model_space") => {}
        Some(other) => bail!(
            "{common}: distributed optimizer state saved as {other} is not read (fully_sharded_model_space and {DP_ZERO_GATHER_SCATTER} are)"
        ),
    }
    let step = param_groups_step(optimizer)
        .with_context(|| format!("{common}: the optimizer's parameter groups carry no step"))?;
    let mut state = OptimizerState {
        step,
        ..Default::default()
    };
    let mut found = 0;
    for (model_name, model) in &checkpoint.tensors {
        for kind in KINDS {
            let name = format!("optimizer.state.{kind}.{model_name}");
            let Some(saved) = checkpoint.tensors.get(&name) else {
                continue;
            };
            found += 1;
            let context = || format!("{}: tensor {name}", placement.directory.display());
            let chunks = dist_chunks(checkpoint, &name, inputs).with_context(context)?;
            let chunks = model_shaped(&model.shape, &saved.shape, chunks).with_context(context)?;
            let model_shape: Vec<i64> = model.shape.iter().map(|&d| d as i64).collect();
            let eager = |rows: std::ops::Range<usize>| {
                Ok(assembled(&model_shape, &chunks)?.narrow(
                    0,
                    rows.start as i64,
                    rows.len() as i64,
                ))
            };
            let target = match kind {
                "fp32_param" => &mut state.main,
                "exp_avg" => &mut state.exp_avg,
                _ => &mut state.exp_avg_sq,
            };
            placement.place(target, model_name, &model.shape, chunks.clone(), &eager)?;
        }
    }
    if found == 0 {
        return Ok(None);
    }
    for (kind, tensors) in [
        ("fp32_param", &state.main),
        ("exp_avg", &state.exp_avg),
        ("exp_avg_sq", &state.exp_avg_sq),
    ] {
        ensure!(
            tensors.len() == state.main.len(),
            "{}: optimizer.state.{kind} covers {} parameters, fp32_param {}",
            placement.directory.display(),
            tensors.len(),
            state.main.len()
        );
    }
    Ok(Some(state))
}

/// The distributed optimizer's state saved as `dp_zero_gather_scatter` in `checkpoint` (its
/// `common.pt` is `root`) for the model `state` read from it: per model-parallel rank (tensor
/// rank fastest, as Megatron numbers the data-parallel groups) the object
/// `optimizer.distributed.dp_group_idx_<rank>.param_state` holding the rank's flat buffers,
/// gathered over the data-parallel ranks, and `….optimizer` its parameter groups (the step).
pub(super) fn dp_zero_gather_scatter_state(
    checkpoint: &DistCheckpoint,
    directory: &std::path::Path,
    root: &Value,
    state: &ModelState,
) -> Result<OptimizerState> {
    let where_ = directory.display();
    let args = root.get("args").context("common.pt has no args")?;
    let int = |key: &str| args.get(key).and_then(Value::as_i64).unwrap_or(1).max(1) as usize;
    let (tp, pp) = (
        int("tensor_model_parallel_size"),
        int("pipeline_model_parallel_size"),
    );
    ensure!(
        int("expert_model_parallel_size") == 1,
        "{where_}: the {DP_ZERO_GATHER_SCATTER} optimizer state of an expert-parallel run (Megatron's chained optimizer) is not read; save it with --ckpt-fully-parallel-save (fully_sharded_model_space)"
    );
    let split = PipelineSplit {
        num_layers: state.config.num_layers,
        stages: pp,
        chunks: int("virtual_pipeline_model_parallel_size"),
        first_stage_layers: None,
        last_stage_layers: None,
    };
    let experts = state
        .config
        .moe
        .as_ref()
        .map_or(0, |m| m.num_experts as usize);
    let tied = !state.config.untie_embeddings_and_output_weights;
    let mut parts: [BTreeMap<String, Vec<LazyTensor>>; 3] = Default::default();
    let mut step = 0.0;
    for stage in 0..pp {
        for t in 0..tp {
            let prefix = format!("optimizer.distributed.dp_group_idx_{}", t + tp * stage);
            let object = |name: &str| -> Result<(megatron_checkpoint::TorchFile, String, Value)> {
                let key = format!("{prefix}.{name}/shard_0_1");
                let (archive, file) = checkpoint.object(&key)?;
                let data = match &archive.root {
                    Value::List(items) if items.len() == 1 => items[0].clone(),
                    other => bail!(
                        "{where_}: object {key} holds {}, a list of one dictionary expected",
                        other.describe()
                    ),
                };
                Ok((archive, file, data))
            };
            let (_, _, groups) = object("optimizer")?;
            let wrapped = Value::Dict(vec![(Value::Str("optimizer".into()), groups)]);
            step = param_groups_step(&wrapped).with_context(|| {
                format!("{where_}: {prefix}.optimizer: the parameter groups carry no step")
            })?;
            let (archive, file, param_state) = object("param_state")?;
            let input = InputFile::open(&checkpoint.data_path(&file))?;
            let chunks = rank_chunk_params(state, &split, stage, tp, 0..experts)?;
            let rank = dp_zero_state(
                &archive,
                &input,
                &param_state,
                &chunks,
                Bucketing::from_args(args, stage),
                step,
            )
            .with_context(|| format!("{where_}: {prefix}.param_state"))?;
            for (target, map) in parts
                .iter_mut()
                .zip([rank.main, rank.exp_avg, rank.exp_avg_sq])
            {
                for (name, tensor) in map {
                    // The head's copy of tied embeddings is the embedding's state.
                    if tied && name == "output_layer.weight" {
                        continue;
                    }
                    target.entry(name).or_default().push(tensor);
                }
            }
        }
    }
    let [main, exp_avg, exp_avg_sq] = parts.map(|part| {
        join_parts(part, &state.config, tp, "optimizer state of")
            .with_context(|| where_.to_string())
    });
    Ok(OptimizerState {
        step,
        main: main?,
        exp_avg: exp_avg?,
        exp_avg_sq: exp_avg_sq?,
    })
}

/// The saved chunks of an optimizer tensor of shape `saved` as chunks of the model tensor's
/// `shape`: as they are where the shapes agree, else each grid cell's flat ranges joined and
/// viewed as the model's chunk.
fn model_shaped(
    shape: &[usize],
    saved: &[usize],
    chunks: Vec<(Vec<usize>, LazyTensor)>,
) -> Result<Vec<(Vec<usize>, LazyTensor)>> {
    if saved == shape {
        return Ok(chunks);
    }
    let rank = shape.len();
    ensure!(
        saved.len() == rank + 1,
        "shape {saved:?} fits neither the parameter's {shape:?} nor its flattened chunks"
    );
    let grid = &saved[..rank];
    let numel = saved[rank];
    let mut cell = Vec::with_capacity(rank);
    for (d, (&whole, &parts)) in shape.iter().zip(grid).enumerate() {
        ensure!(
            parts > 0 && whole % parts == 0,
            "dimension {d} of the parameter ({whole}) is not split into {parts} equal chunks"
        );
        cell.push(whole / parts);
    }
    ensure!(
        cell.iter().product::<usize>() == numel,
        "chunks of shape {cell:?} do not flatten to {numel} elements"
    );
    // Grid cell → its (flat start, piece) ranges.
    let mut cells: BTreeMap<Vec<usize>, Vec<(usize, LazyTensor)>> = BTreeMap::new();
    for (offsets, chunk) in chunks {
        let sizes = chunk.shape();
        ensure!(
            sizes[..rank].iter().all(|&s| s == 1),
            "a saved chunk of shape {sizes:?} spans more than one model chunk"
        );
        let flat = chunk.numel();
        let piece = chunk.flat_slice(0, flat, vec![flat])?;
        cells
            .entry(offsets[..rank].to_vec())
            .or_default()
            .push((offsets[rank], piece));
    }
    let cell_shape: Vec<i64> = cell.iter().map(|&d| d as i64).collect();
    let mut out = Vec::with_capacity(cells.len());
    for (position, mut pieces) in cells {
        pieces.sort_by_key(|(start, _)| *start);
        let mut at = 0;
        for (start, piece) in &pieces {
            ensure!(
                *start == at,
                "model chunk {position:?}: the saved ranges leave elements {at}..{start} out"
            );
            at += piece.numel() as usize;
        }
        ensure!(
            at == numel,
            "model chunk {position:?}: the saved ranges cover {at} of {numel} elements"
        );
        let offsets = position.iter().zip(&cell).map(|(i, n)| i * n).collect();
        let pieces = pieces.into_iter().map(|(_, piece)| piece).collect();
        out.push((offsets, LazyTensor::concat(pieces, cell_shape.clone())?));
    }
    Ok(out)
}

/// The whole tensor of `shape` that `chunks` tile, read now (tilings the lazy reader does not
/// follow: tensor-parallel grids of row and column blocks).
fn assembled(shape: &[i64], chunks: &[(Vec<usize>, LazyTensor)]) -> Result<Tensor> {
    let kind = chunks.first().map_or(Kind::Float, |(_, c)| c.kind());
    let whole = Tensor::zeros(shape, (kind, Device::Cpu));
    let mut covered = 0;
    for (offsets, chunk) in chunks {
        let mut view = whole.shallow_clone();
        for (d, (&start, &len)) in offsets.iter().zip(chunk.shape()).enumerate() {
            view = view.narrow(d as i64, start as i64, len);
        }
        view.copy_(&chunk.read()?);
        covered += chunk.numel();
    }
    ensure!(
        covered == shape.iter().product::<i64>(),
        "the chunks cover {covered} of {} elements",
        shape.iter().product::<i64>()
    );
    Ok(whole)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stacked [2 layers, 4, 3] parameter saved as [2, 2, 1, 6]: tensor-parallel row halves,
    /// each flattened and cut into two data-parallel ranges, rebuilt as the parameter.
    #[test]
    fn flattened_chunks_become_the_parameter() {
        let whole = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([2, 4, 3]);
        let mut saved = Vec::new();
        for layer in 0..2 {
            for half in 0..2 {
                let flat = whole.get(layer).narrow(0, half * 2, 2).reshape([-1]);
                for (start, len) in [(0, 4), (4, 2)] {
                    let piece = flat.narrow(0, start, len).reshape([1, 1, 1, len]);
                    let offsets = vec![layer as usize, half as usize, 0, start as usize];
                    saved.push((offsets, LazyTensor::from(piece)));
                }
            }
        }
        let chunks = model_shaped(&[2, 4, 3], &[2, 2, 1, 6], saved).unwrap();
        assert_eq!(chunks.len(), 4);
        let read = assembled(&[2, 4, 3], &chunks).unwrap();
        assert!(read.equal(&whole));
        let mut gap = chunks.clone();
        gap.pop();
        assert!(assembled(&[2, 4, 3], &gap).is_err());
        let short = vec![(
            vec![0, 0, 0, 0],
            LazyTensor::from(Tensor::zeros([1, 1, 1, 4], (Kind::Float, Device::Cpu))),
        )];
        let error = model_shaped(&[1, 2, 3], &[1, 1, 1, 6], short).unwrap_err();
        assert!(format!("{error:#}").contains("cover 4 of 6"), "{error:#}");
    }
}
