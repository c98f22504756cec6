//! Writing the distributed optimizer's state as core_v0.14.0's `--ckpt-format torch` saves it
//! beside a rank file: `distrib_optim.pt`, `get_parameter_state_dp_zero`'s dictionary
//! (`buckets_coalesced`, then per model chunk one `(param dtype, grad dtype)` entry of flat
//! float32 `param`, `exp_avg` and `exp_avg_sq` tensors and their `numel_unpadded`), each
//! parameter's state at the place `megatron_checkpoint::distrib_optim::dp_zero_layout` gives it
//! and zeros between; a Mixture-of-Experts run's chained optimizer saves a list of two such
//! dictionaries, the dense parameters' buffers and the routed experts'.

use std::path::Path;

use anyhow::{Context, Result};
use megatron_checkpoint::distrib_optim::{dp_zero_layout, BufferParam};
use megatron_checkpoint::torch_writer::{write_torch_file, Saved, TensorSlot};
use megatron_checkpoint::{DType, Value};

use super::distrib_optim::{is_embedding_copy, Bucketing};
use super::lazy::with_bytes;
use super::state::{shard_of, ModelState};

/// One optimizer's gradient buffers: per model chunk its parameters (global names and shard
/// shapes, registration order), and how the run bucketed them.
pub(super) struct OptimizerBuffers {
    pub chunks: Vec<Vec<(String, Vec<usize>)>>,
    pub bucketing: Bucketing,
}

/// A flat tensor of the file: one of the state's kinds (main parameters, `exp_avg`,
/// `exp_avg_sq`) of one buffer, each parameter at its offset.
struct FlatTensor {
    kind: usize,
    params: Vec<(String, usize)>,
    numel: usize,
}

/// Writes `distrib_optim.pt` at `path` for tensor rank `t` of `tp`: one dictionary for a single
/// optimizer, a list of them for the chained one; `grad_dtype` is the torch name of the dtype
/// the run reduced gradients in.
pub(super) fn write_distrib_optim(
    path: &Path,
    state: &ModelState,
    optimizers: &[OptimizerBuffers],
    grad_dtype: &str,
    t: usize,
    tp: usize,
) -> Result<()> {
    let optimizer = state
        .optimizer
        .as_ref()
        .context("no optimizer state to write")?;
    let mut slots = Vec::new();
    let mut flats = Vec::new();
    let mut dictionaries: Vec<Saved> = optimizers
        .iter()
        .map(|buffers| dp_zero_dictionary(state, buffers, grad_dtype, &mut slots, &mut flats))
        .collect();
    let root = match dictionaries.len() {
        1 => dictionaries.pop().expect("one optimizer"),
        _ => Saved::List(dictionaries),
    };
    let config = &state.config;
    let sources = [&optimizer.main, &optimizer.exp_avg, &optimizer.exp_avg_sq];
    write_torch_file(path, &root, &slots, |index, emit| {
        let flat = &flats[index];
        let mut at = 0;
        for (name, offset) in &flat.params {
            emit(&vec![0u8; (offset - at) * 4])?;
            let value = sources[flat.kind]
                .get(name)
                .with_context(|| format!("{}: no optimizer state for {name}", state.source))?;
            let shard = shard_of(name, value, config, t, tp)?;
            shard
                .for_each_chunk(|chunk| with_bytes(&chunk.to_kind(tch::Kind::Float), &mut *emit))?;
            at = offset + shard.numel() as usize;
        }
        emit(&vec![0u8; (flat.numel - at) * 4])
    })
}

/// `get_parameter_state_dp_zero`'s dictionary of one optimizer, its tensors appended to
/// `slots` and described in `flats`.
fn dp_zero_dictionary(
    state: &ModelState,
    buffers: &OptimizerBuffers,
    grad_dtype: &str,
    slots: &mut Vec<TensorSlot>,
    flats: &mut Vec<FlatTensor>,
) -> Saved {
    let torch_dtype = |name: &str| Value::Global {
        module: "torch".into(),
        name: name.into(),
    };
    let dtypes = Value::Tuple(vec![
        torch_dtype(state.params_dtype.as_str()),
        torch_dtype(grad_dtype),
    ]);
    let mut entries = vec![(
        Value::Str("buckets_coalesced".into()),
        Saved::Value(Value::Bool(true)),
    )];
    for (chunk, params) in buffers.chunks.iter().enumerate() {
        let buffer_params: Vec<BufferParam> = params
            .iter()
            .map(|(name, shape)| BufferParam {
                numel: shape.iter().product(),
                shared_embedding: buffers.bucketing.shared_embeddings && is_embedding_copy(name),
            })
            .collect();
        let layout = dp_zero_layout(&buffer_params, buffers.bucketing.bucket_size(chunk));
        let mut placed: Vec<(String, usize)> = params
            .iter()
            .zip(&layout.offsets)
            .map(|((name, _), &offset)| (name.clone(), offset))
            .collect();
        placed.sort_by_key(|(_, offset)| *offset);
        let mut tensors = Vec::new();
        for (kind, key) in ["param", "exp_avg", "exp_avg_sq"].into_iter().enumerate() {
            slots.push(TensorSlot {
                dtype: DType::F32,
                shape: vec![layout.numel_unpadded],
            });
            flats.push(FlatTensor {
                kind,
                params: placed.clone(),
                numel: layout.numel_unpadded,
            });
            tensors.push((key.to_string(), Saved::Tensor(slots.len() - 1)));
        }
        tensors.push((
            "numel_unpadded".into(),
            Saved::Value(Value::Int(layout.numel_unpadded as i64)),
        ));
        entries.push((
            Value::Int(chunk as i64),
            Saved::KeyedDict(vec![(dtypes.clone(), Saved::Dict(tensors))]),
        ));
    }
    Saved::KeyedDict(entries)
}
