//! The distributed optimizer's state in Megatron's `dp_zero` layout (`distrib_optim.pt` next to
//! a `--ckpt-format torch` rank file, or `torch_dist`'s `dp_zero_gather_scatter` object) cut
//! into each parameter's main weights and Adam moments, read lazily from the flat tensors.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::distrib_optim::{dp_zero_layout, BufferParam};
use megatron_checkpoint::{TorchFile, Value};

use super::lazy::{tensor_of, InputFile, LazyTensor};
use super::state::RankOptimizer;
use megatron_models::gpt::megatron_names::expert_of;

/// A rank's model chunks: each chunk's parameters (global Megatron-core names and shapes) in
/// registration order.
pub(super) type ChunkParams = [Vec<(String, Vec<usize>)>];

/// The parameters of each model chunk that are routed experts (`experts`) or the others, in
/// their order: Megatron's distributed optimizer keeps the two in buffers of their own once
/// experts are split over expert-parallel ranks.
pub(super) fn expert_params(chunks: &ChunkParams, experts: bool) -> Vec<Vec<(String, Vec<usize>)>> {
    chunks
        .iter()
        .map(|chunk| {
            chunk
                .iter()
                .filter(|(name, _)| expert_of(name).is_some() == experts)
                .cloned()
                .collect()
        })
        .collect()
}

/// How the run that saved a checkpoint bucketed its gradient buffers (its `args`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Bucketing {
    /// The bucket size of a first pipeline stage's first model chunk; other chunks and stages
    /// take one bucket.
    pub first_chunk_bucket: Option<usize>,
    /// Tied embeddings split over pipeline stages: their copies get buckets of their own.
    pub shared_embeddings: bool,
    pub pipeline_rank: usize,
}

impl Bucketing {
    /// Megatron's `DistributedDataParallel` choice: buckets only with `--overlap-grad-reduce`,
    /// of `--ddp-bucket-size` or max(40M, 1M × data-parallel size) elements.
    pub fn from_args(args: &Value, pipeline_rank: usize) -> Self {
        let flag = |key: &str| args.get(key).and_then(Value::as_bool).unwrap_or(false);
        let int = |key: &str| args.get(key).and_then(Value::as_i64);
        Self::new(
            |key| flag(key),
            int("ddp_bucket_size"),
            int("data_parallel_size").unwrap_or(1).max(1) as usize,
            int("pipeline_model_parallel_size").unwrap_or(1),
            pipeline_rank,
        )
    }

    /// The bucketing of a run whose boolean flags `flag` reads, at `data_parallel` ranks.
    pub fn new(
        flag: impl Fn(&str) -> bool,
        ddp_bucket_size: Option<i64>,
        data_parallel: usize,
        pipeline: i64,
        pipeline_rank: usize,
    ) -> Self {
        let first_chunk_bucket = (flag("overlap_grad_reduce")
            && !flag("overlap_param_gather_with_optimizer_step"))
        .then(|| {
            ddp_bucket_size
                .map(|size| size.max(1) as usize)
                .unwrap_or_else(|| 40_000_000.max(1_000_000 * data_parallel))
        });
        Bucketing {
            first_chunk_bucket,
            shared_embeddings: pipeline > 1 && !flag("untie_embeddings_and_output_weights"),
            pipeline_rank,
        }
    }

    pub fn bucket_size(&self, chunk: usize) -> Option<usize> {
        (chunk == 0 && self.pipeline_rank == 0)
            .then_some(self.first_chunk_bucket)
            .flatten()
    }
}

/// The Adam step count Megatron's distributed optimizer keeps in its parameter groups (its
/// `state_dict`'s `optimizer.param_groups[*].step`), given that `state_dict`, or what a chained
/// optimizer saves (dense and expert-parallel parameters, stepped together): a list of them in
/// `torch` checkpoints, a dictionary by index in `torch_dist`'s.
pub(super) fn param_groups_step(optimizer: &Value) -> Option<f64> {
    match optimizer {
        Value::List(optimizers) => return param_groups_step(optimizers.first()?),
        Value::Dict(entries) if optimizer.get("optimizer").is_none() => {
            return param_groups_step(&entries.first()?.1)
        }
        _ => {}
    }
    optimizer
        .get("optimizer")?
        .get("param_groups")?
        .items()?
        .first()?
        .get("step")?
        .as_f64()
}

pub(super) fn is_embedding_copy(name: &str) -> bool {
    name == "embedding.word_embeddings.weight" || name == "output_layer.weight"
}

/// The per-parameter state of `state` (the `dp_zero` dictionary: `buckets_coalesced` and, per
/// model chunk index, one dtype entry of flat `param`, `exp_avg`, `exp_avg_sq` tensors) held in
/// `file` (read through `input`). `step` comes from the optimizer's parameter groups.
pub(super) fn dp_zero_state(
    file: &TorchFile,
    input: &Arc<InputFile>,
    state: &Value,
    chunks: &ChunkParams,
    bucketing: Bucketing,
    step: f64,
) -> Result<RankOptimizer> {
    let path = file.path().display();
    let entries = state
        .entries()
        .with_context(|| format!("{path}: expected the distributed optimizer's dictionary"))?;
    let coalesced = state
        .get("buckets_coalesced")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    ensure!(
        coalesced,
        "{path}: per-bucket distributed optimizer state (saved before Megatron core 0.7) is not read; resave it with a newer Megatron"
    );
    let buffers: Vec<(i64, &Value)> = entries
        .iter()
        .filter_map(|(key, value)| key.as_i64().map(|index| (index, value)))
        .collect();
    ensure!(
        buffers.len() == chunks.len(),
        "{path}: {} gradient buffers, the model has {} chunk(s) on this rank (expert-parallel buffers are not read)",
        buffers.len(),
        chunks.len()
    );
    let mut out = RankOptimizer {
        step,
        ..Default::default()
    };
    for (chunk, params) in chunks.iter().enumerate() {
        let buffer = buffers
            .iter()
            .find(|(index, _)| *index == chunk as i64)
            .map(|(_, value)| *value)
            .with_context(|| format!("{path}: no gradient buffer {chunk}"))?;
        let dtypes = buffer.entries().unwrap_or(&[]);
        let [(_, tensors)] = dtypes else {
            bail!(
                "{path}: gradient buffer {chunk} holds {} dtype groups, one expected",
                dtypes.len()
            );
        };
        let buffer_params: Vec<BufferParam> = params
            .iter()
            .map(|(name, shape)| BufferParam {
                numel: shape.iter().product(),
                shared_embedding: bucketing.shared_embeddings && is_embedding_copy(name),
            })
            .collect();
        let layout = dp_zero_layout(&buffer_params, bucketing.bucket_size(chunk));
        let saved = tensors
            .get("numel_unpadded")
            .and_then(Value::as_i64)
            .with_context(|| format!("{path}: gradient buffer {chunk} has no numel_unpadded"))?;
        ensure!(
            saved as usize == layout.numel_unpadded,
            "{path}: gradient buffer {chunk} holds {saved} elements, the model's parameters lay out as {} (different model or bucketing?)",
            layout.numel_unpadded
        );
        for (key, target) in [
            ("param", &mut out.main),
            ("exp_avg", &mut out.exp_avg),
            ("exp_avg_sq", &mut out.exp_avg_sq),
        ] {
            let flat = match tensors.get(key) {
                Some(Value::Tensor(t)) => t,
                _ => bail!("{path}: gradient buffer {chunk} has no {key} tensor"),
            };
            ensure!(
                flat.shape == [layout.numel_unpadded],
                "{path}: gradient buffer {chunk}: {key} has shape {:?}, expected [{}]",
                flat.shape,
                layout.numel_unpadded
            );
            let flat = tensor_of(file, input, flat)
                .with_context(|| format!("{path}: gradient buffer {chunk}: {key}"))?;
            insert_slices(target, &flat, params, &layout.offsets)
                .with_context(|| format!("{path}: gradient buffer {chunk}: {key}"))?;
        }
    }
    Ok(out)
}

fn insert_slices(
    target: &mut HashMap<String, LazyTensor>,
    flat: &LazyTensor,
    params: &[(String, Vec<usize>)],
    offsets: &[usize],
) -> Result<()> {
    for ((name, shape), &offset) in params.iter().zip(offsets) {
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let numel = shape.iter().product();
        let slice = flat
            .flat_slice(offset as i64, numel, shape)
            .with_context(|| format!("parameter {name}"))?;
        target.insert(name.clone(), slice);
    }
    Ok(())
}
