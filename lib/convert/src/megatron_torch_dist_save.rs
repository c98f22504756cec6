//! Writing Megatron's `--ckpt-format torch_dist` checkpoints (`--saver core --ckpt-format
//! torch_dist`) as core_v0.14.0's `pretrain_gpt.py` saves them with the local transformer
//! implementation: every parameter a global tensor under Megatron's sharded key (a layer's
//! parameters stacked over all layers, `decoder.layers.self_attention.linear_proj.weight`;
//! the norms under the keys the fused TE layers use, `..linear_qkv.layer_norm_weight`), cut
//! into the chunks the tensor-parallel ranks and layers save; the linear layers'
//! `_extra_state` objects; and the distributed optimizer's state in
//! `fully_sharded_model_space` (`optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>` of
//! shape `grid ++ [numel]`, each data-parallel rank's range of a parameter one chunk), or the
//! plain optimizer's, each tensor of its parameter's shape and chunks.
//! No RNG state (`args.no_save_rng` says so, and Megatron then leaves its generators alone).

use std::collections::HashSet;
use std::path::Path;

use anyhow::{ensure, Context, Result};
use megatron_checkpoint::distrib_optim::{BufferParam, ShardedBuffer};
use megatron_checkpoint::torch_dist_writer::{ChunkPlace, DistWriter};
use megatron_checkpoint::torch_writer::{Saved, TensorSlot};
use megatron_checkpoint::{DType, Value};
use megatron_models::gpt::megatron_names::expert_of;
use megatron_models::{Activation, PipelineSplit, TransformerConfig};
use megatron_optim::excluded_from_weight_decay;
use megatron_store::{iteration_directory, tensor_split, write_tracker, TensorSplit};

use super::distrib_optim::{is_embedding_copy, Bucketing};
use super::lazy::{with_bytes, LazyTensor};
use super::megatron_save::{
    args_namespace, chunk_entries, group_hyperparameters, json_to_value, moe_args, run_flag,
    schedule_entries,
};
use super::megatron_torch::param_groups;
use super::ours::TargetLayout;
use super::state::{shard_of, shard_shape, ModelState};
use super::tensors::kind_named;

/// The optimizer state's kinds: the key part and which of the state's tensors holds it.
const OPTIMIZER_KINDS: [&str; 3] = ["fp32_param", "exp_avg", "exp_avg_sq"];

/// A parameter's sharded key and the axes Megatron prepends to it, each as `(index, count)`: a
/// layer's parameter is stacked over the `num_layers` layers, a routed expert's also over the
/// `num_experts` experts (`SequentialMLP` saves `mlp.experts.local_experts.<e>.*` under
/// `mlp.experts.experts.*`).
fn sharded_key(name: &str, num_layers: usize, num_experts: usize) -> (String, Vec<(usize, usize)>) {
    let Some(rest) = name.strip_prefix("decoder.layers.") else {
        return (name.to_string(), Vec::new());
    };
    let (layer, leaf) = rest.split_once('.').expect("a layer's parameter");
    let mut axes = vec![(layer.parse().expect("a layer index"), num_layers)];
    let leaf = match leaf {
        "input_layernorm.weight" => "self_attention.linear_qkv.layer_norm_weight".to_string(),
        "input_layernorm.bias" => "self_attention.linear_qkv.layer_norm_bias".to_string(),
        "pre_mlp_layernorm.weight" => "mlp.linear_fc1.layer_norm_weight".to_string(),
        "pre_mlp_layernorm.bias" => "mlp.linear_fc1.layer_norm_bias".to_string(),
        other => match expert_of(name) {
            Some((expert, _, module)) => {
                axes.push((expert, num_experts));
                format!("mlp.experts.experts.{module}")
            }
            None => other.to_string(),
        },
    };
    (format!("decoder.layers.{leaf}"), axes)
}

/// `dims` with the prepended axes' values (`value` of each `(index, count)`) in front.
fn prepended(
    axes: &[(usize, usize)],
    value: impl Fn(&(usize, usize)) -> usize,
    dims: Vec<usize>,
) -> Vec<usize> {
    axes.iter().map(value).chain(dims).collect()
}

/// How a parameter's chunks cut it: its tensor-parallel split, except that a routed expert's
/// SwiGLU `fc1` (whole on every tensor-parallel rank here) is cut into its gate and up halves
/// too, as Megatron's swiglu sharded factory cuts every gated `fc1`.
fn saved_split(name: &str, config: &TransformerConfig) -> TensorSplit {
    match expert_of(name) {
        Some((_, _, leaf))
            if config.activation == Activation::Swiglu && leaf.starts_with("linear_fc1.") =>
        {
            TensorSplit::Rows { stride: 2 }
        }
        _ => tensor_split(name, config),
    }
}

/// One tensor-parallel rank's chunk of a parameter: its offsets and sizes in the parameter's
/// global (tensor-parallel joined) shape, and which rows of the rank's shard it holds.
struct TpPiece {
    offsets: Vec<usize>,
    sizes: Vec<usize>,
    shard_rows: std::ops::Range<usize>,
}

/// Rank `t`'s pieces of a parameter whose shard on each of `size` ranks has shape `shard`:
/// a SwiGLU `fc1`'s gate and up halves go to the two halves of the global rows, as Megatron's
/// sharded factory for it saves them.
fn tp_pieces(split: TensorSplit, shard: &[usize], t: usize, size: usize) -> Vec<TpPiece> {
    let whole = |offsets: Vec<usize>| TpPiece {
        offsets,
        sizes: shard.to_vec(),
        shard_rows: 0..shard.first().copied().unwrap_or(1),
    };
    let mut zeros = vec![0; shard.len()];
    match split {
        TensorSplit::Replicated => vec![whole(zeros)],
        TensorSplit::Columns => {
            zeros[1] = t * shard[1];
            vec![whole(zeros)]
        }
        TensorSplit::Rows { stride } => {
            let part = shard[0] / stride as usize;
            (0..stride as usize)
                .map(|p| {
                    let mut offsets = zeros.clone();
                    offsets[0] = (p * size + t) * part;
                    let mut sizes = shard.to_vec();
                    sizes[0] = part;
                    TpPiece {
                        offsets,
                        sizes,
                        shard_rows: p * part..(p + 1) * part,
                    }
                })
                .collect()
        }
    }
}

/// The global shape of a parameter whose shards have shape `shard`.
fn joined_shape(split: TensorSplit, shard: &[usize], size: usize) -> Vec<usize> {
    let mut shape = shard.to_vec();
    match split {
        TensorSplit::Replicated => {}
        TensorSplit::Rows { .. } => shape[0] *= size,
        TensorSplit::Columns => shape[1] *= size,
    }
    shape
}

/// The rows `rows` of `tensor` (first dimension), as a lazy view.
fn rows_of(tensor: &LazyTensor, rows: std::ops::Range<usize>) -> Result<LazyTensor> {
    let shape = tensor.shape().to_vec();
    if shape.is_empty() || (rows.start == 0 && rows.end as i64 == shape[0]) {
        return Ok(tensor.clone());
    }
    let row: i64 = shape[1..].iter().product();
    let mut sizes = shape.clone();
    sizes[0] = rows.len() as i64;
    tensor.flat_slice(rows.start as i64 * row, rows.len() as i64 * row, sizes)
}

/// A parameter of one rank's model chunk, as the optimizer's buffers see it.
struct RankParam {
    global: String,
    shard: Vec<usize>,
    /// A copy saved by another rank under the same key (the tied output layer of a last
    /// stage): in the buffers, not in the checkpoint.
    replica: bool,
}

/// Writes `state` as Megatron's torch_dist under `root` in `target`'s layout for `data_parallel`
/// ranks, its optimizer state (if any) as the distributed optimizer's
/// `fully_sharded_model_space` where `distributed_optimizer`, else as the plain optimizer's.
/// A Mixture-of-Experts model's routed experts are over `expert_parallel` ranks: above one,
/// Megatron's optimizer is a chained one (the dense parameters', then the routed experts',
/// reduced over `data_parallel / expert_parallel` ranks), and `common.pt` keeps both parts.
pub fn save_megatron_torch_dist(
    state: &ModelState,
    root: &Path,
    target: TargetLayout,
    data_parallel: usize,
    distributed_optimizer: bool,
    expert_parallel: usize,
) -> Result<()> {
    let config = &state.config;
    config.validate(target.tensor as i64)?;
    let (tp, pp, dp) = (target.tensor, target.pipeline, data_parallel.max(1));
    let num_experts = num_experts(config);
    let expert_parallel = expert_parallel.max(1);
    ensure!(
        expert_parallel == 1
            || (num_experts % expert_parallel == 0 && dp % expert_parallel == 0),
        "{}: {expert_parallel} expert-parallel ranks must divide the model's {num_experts} routed experts and the {dp} data-parallel ranks",
        state.source
    );
    let chained = num_experts > 0 && expert_parallel > 1;
    if config.moe.is_some() {
        ensure!(
            tp == 1,
            "{}: Mixture-of-Experts models are written as torch_dist at tensor-parallel size 1 only (the experts are not split over tensor-parallel ranks here); pass --target-tensor-parallel-size 1",
            state.source
        );
        ensure!(
            state.optimizer.is_none() || distributed_optimizer,
            "{}: the plain optimizer's torch_dist state of a Mixture-of-Experts model is not written here; save with --use-distributed-optimizer or without the optimizer",
            state.source
        );
    }
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: pp,
        chunks: target.virtual_stages,
        first_stage_layers: None,
        last_stage_layers: None,
    };
    let kind = kind_named(&state.params_dtype)?;
    let dtype = DType::from_torch_name(&state.params_dtype).context("params dtype")?;
    let iteration = state.run.iteration;
    let mut writer = DistWriter::create(&iteration_directory(root, iteration))?;
    let mut declared = HashSet::new();
    let rank_of = |t: usize, d: usize, stage: usize| t + tp * (d + dp * stage);
    let flag = |key: &str| {
        run_flag(&state.run.args, key)
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
    };
    let bucket_size = run_flag(&state.run.args, "ddp_bucket_size").and_then(|v| v.as_i64());
    // The optimizer's parts (the dense parameters', then a Mixture-of-Experts model's routed
    // experts', stepped together by Megatron's chained optimizer), each with the parameters of
    // data-parallel rank 0 of the first stage and tensor rank 0, whose `common.pt` Megatron
    // writes: the optimizer's per-parameter entries there.
    let mut parts = vec![OptimizerPart::default(); if chained { 2 } else { 1 }];
    let expert_dp = dp / expert_parallel;
    for stage in 0..pp {
        let bucketing = Bucketing::new(flag, bucket_size, dp, pp as i64, stage);
        let expert_bucketing = Bucketing::new(flag, bucket_size, expert_dp, pp as i64, stage);
        for (c, spec) in split.chunks_of(stage)?.iter().enumerate() {
            let entries = chunk_entries(state, spec);
            for t in 0..tp {
                let rank = rank_of(t, 0, stage);
                let mut params = Vec::new();
                for (local, global) in &entries {
                    let Some(global) = global else {
                        if t == 0 {
                            write_extra_state(
                                &mut writer,
                                local,
                                spec.layers.start,
                                config.num_layers,
                                num_experts,
                                rank,
                            )?;
                        }
                        continue;
                    };
                    // A last stage's output layer tied to the embedding: saved by the first.
                    let replica = local == "output_layer.weight" && global != local;
                    let unsplit = state.tensor(global)?;
                    let shard: Vec<usize> = shard_shape(global, unsplit.shape(), config, tp)
                        .iter()
                        .map(|&d| d as usize)
                        .collect();
                    params.push(RankParam {
                        global: global.clone(),
                        shard: shard.clone(),
                        replica,
                    });
                    if replica {
                        continue;
                    }
                    let tensor_split = saved_split(global, config);
                    if tensor_split == TensorSplit::Replicated && t > 0 {
                        continue;
                    }
                    let (key, axes) = sharded_key(global, config.num_layers, num_experts);
                    if declared.insert(key.clone()) {
                        let shape = joined_shape(tensor_split, &shard, tp);
                        writer.declare_tensor(&key, dtype, prepended(&axes, |a| a.1, shape))?;
                    }
                    // The parameter, and beside it the plain optimizer's state of it, chunked alike.
                    let mut written =
                        vec![(key.clone(), kind, shard_of(global, unsplit, config, t, tp)?)];
                    if let (Some(optimizer), false) = (&state.optimizer, distributed_optimizer) {
                        for (kind_name, source) in OPTIMIZER_KINDS.iter().zip([
                            &optimizer.main,
                            &optimizer.exp_avg,
                            &optimizer.exp_avg_sq,
                        ]) {
                            let name = format!("optimizer.state.{kind_name}.{key}");
                            let value = source.get(global).with_context(|| {
                                format!("{}: no optimizer state for {global}", state.source)
                            })?;
                            if declared.insert(name.clone()) {
                                let shape = joined_shape(tensor_split, &shard, tp);
                                writer.declare_tensor(
                                    &name,
                                    DType::F32,
                                    prepended(&axes, |a| a.1, shape),
                                )?;
                            }
                            written.push((
                                name,
                                tch::Kind::Float,
                                shard_of(global, value, config, t, tp)?,
                            ));
                        }
                    }
                    for (name, kind, value) in &written {
                        for piece in tp_pieces(tensor_split, &shard, t, tp) {
                            let place = ChunkPlace {
                                offsets: prepended(&axes, |a| a.0, piece.offsets),
                                sizes: prepended(&axes, |_| 1, piece.sizes),
                            };
                            let part = rows_of(value, piece.shard_rows)?;
                            writer.write_chunk(name, rank, place, |emit| {
                                part.for_each_chunk(|chunk| {
                                    with_bytes(&chunk.to_kind(*kind), &mut *emit)
                                })
                            })?;
                        }
                    }
                    let bias = global.replace(".mlp.router.weight", ".mlp.router.expert_bias");
                    if let Some(value) = state.expert_biases.get(&bias) {
                        write_expert_bias(&mut writer, &mut declared, &bias, value, config, rank)?;
                    }
                }
                if state.optimizer.is_none() {
                    continue;
                }
                // Expert-parallel routed experts have gradient buffers of their own, behind
                // the dense ones.
                let (experts, dense): (Vec<RankParam>, Vec<RankParam>) = params
                    .into_iter()
                    .partition(|p| chained && expert_of(&p.global).is_some());
                let buffers = [
                    (dense, bucketing, dp),
                    (experts, expert_bucketing, expert_dp),
                ];
                for (part, (params, bucketing, ranks)) in parts.iter_mut().zip(buffers) {
                    let saved = if distributed_optimizer {
                        write_optimizer_chunks(
                            state,
                            &mut writer,
                            &mut declared,
                            &params,
                            bucketing.bucket_size(c),
                            bucketing.shared_embeddings,
                            t,
                            tp,
                            ranks,
                            |d| rank_of(t, d, stage),
                        )?
                    } else {
                        params.len()
                    };
                    if stage == 0 && t == 0 {
                        part.params_on_first_rank += saved;
                        part.params
                            .extend(params.iter().map(|p| (p.global.clone(), p.shard.clone())));
                    }
                }
            }
        }
    }
    let (common, tensors) = common_state(
        state,
        target,
        dp,
        distributed_optimizer,
        expert_parallel,
        &parts,
    )?;
    let step = state.optimizer.as_ref().map_or(0.0, |o| o.step) as f32;
    writer.finish(&common, &tensors, |_, emit| {
        with_bytes(&tch::Tensor::from(step), emit)
    })?;
    write_tracker(root, iteration)
}

/// A router's expert bias (float32 `[experts]`, a buffer Megatron saves like a parameter),
/// stacked over the layers as `decoder.layers.mlp.router.expert_bias`, one chunk per layer
/// saved by `rank`.
fn write_expert_bias(
    writer: &mut DistWriter,
    declared: &mut HashSet<String>,
    name: &str,
    value: &LazyTensor,
    config: &TransformerConfig,
    rank: usize,
) -> Result<()> {
    let (key, axes) = sharded_key(name, config.num_layers, num_experts(config));
    let shape: Vec<usize> = value.shape().iter().map(|&d| d as usize).collect();
    if declared.insert(key.clone()) {
        writer.declare_tensor(&key, DType::F32, prepended(&axes, |a| a.1, shape.clone()))?;
    }
    let place = ChunkPlace {
        offsets: prepended(&axes, |a| a.0, vec![0; shape.len()]),
        sizes: prepended(&axes, |_| 1, shape),
    };
    writer.write_chunk(&key, rank, place, |emit| {
        value.for_each_chunk(|chunk| with_bytes(&chunk.to_kind(tch::Kind::Float), &mut *emit))
    })
}

/// The `_extra_state` object of a local-spec linear layer (`[None]`, one per layer), keyed as
/// Megatron's `ShardedObject` over the layers: `decoder.layers.<module>._extra_state/shard_<layer>_<layers>`,
/// a routed expert's over the layers and the experts:
/// `decoder.layers.mlp.experts.experts.<module>._extra_state/shard_<layer>.<expert>_<layers>.<experts>`.
/// The output layer's is not saved (`GPTModel.sharded_state_dict` drops it).
fn write_extra_state(
    writer: &mut DistWriter,
    local: &str,
    first_layer: usize,
    num_layers: usize,
    num_experts: usize,
    rank: usize,
) -> Result<()> {
    let Some(rest) = local.strip_prefix("decoder.layers.") else {
        return Ok(());
    };
    let (layer, module) = rest.split_once('.').context("a layer's extra state")?;
    let layer = first_layer + layer.parse::<usize>().context("a layer index")?;
    let key = match expert_of(local) {
        Some((expert, _, leaf)) => format!(
            "decoder.layers.mlp.experts.experts.{leaf}/shard_{layer}.{expert}_{num_layers}.{num_experts}"
        ),
        None => format!("decoder.layers.{module}/shard_{layer}_{num_layers}"),
    };
    writer.write_object(&key, rank, &Saved::List(vec![Saved::Value(Value::None)]))
}

/// Writes tensor rank `t`'s chunks of the distributed optimizer's state for `params` (one
/// model chunk's parameters in registration order), each data-parallel rank's part of each
/// parameter into `rank_of(d)`'s file; returns how many parameters data-parallel rank 0 holds.
#[allow(clippy::too_many_arguments)]
fn write_optimizer_chunks(
    state: &ModelState,
    writer: &mut DistWriter,
    declared: &mut HashSet<String>,
    params: &[RankParam],
    bucket_size: Option<usize>,
    shared_embeddings: bool,
    t: usize,
    tp: usize,
    dp: usize,
    rank_of: impl Fn(usize) -> usize,
) -> Result<usize> {
    let optimizer = state.optimizer.as_ref().expect("called with an optimizer");
    let config = &state.config;
    let buffer_params: Vec<BufferParam> = params
        .iter()
        .map(|p| BufferParam {
            numel: p.shard.iter().product(),
            shared_embedding: shared_embeddings && is_embedding_copy(&p.global),
        })
        .collect();
    let buffer = ShardedBuffer::new(&buffer_params, bucket_size, dp);
    let mut first_rank = 0;
    for (index, param) in params.iter().enumerate() {
        let parts = buffer.owned_parts(index);
        if parts.iter().any(|(d, _)| *d == 0) {
            first_rank += 1;
        }
        let split = saved_split(&param.global, config);
        if param.replica || (split == TensorSplit::Replicated && t > 0) {
            continue;
        }
        let (key, axes) = sharded_key(&param.global, config.num_layers, num_experts(config));
        let numel: usize = param.shard.iter().product();
        // A SwiGLU fc1's shard is its gate rows then its up rows, saved (as Megatron's swiglu
        // sharded factory saves them) as two model chunks of the row axis, `tp` cells apart.
        let stride = match split {
            TensorSplit::Rows { stride } => stride as usize,
            _ => 1,
        };
        let piece_numel = numel / stride;
        // The grid of model chunks: the layer, then each dimension's tensor-parallel split.
        let mut grid: Vec<usize> = axes.iter().map(|a| a.1).collect();
        let mut position: Vec<usize> = axes.iter().map(|a| a.0).collect();
        let row_axis = position.len();
        for d in 0..param.shard.len() {
            let split_here = matches!(
                (split, d),
                (TensorSplit::Rows { .. }, 0) | (TensorSplit::Columns, 1)
            );
            let cells = if d == 0 { tp * stride } else { tp };
            grid.push(if split_here { cells } else { 1 });
            position.push(if split_here { t } else { 0 });
        }
        for (k, kind) in OPTIMIZER_KINDS.iter().enumerate() {
            let name = format!("optimizer.state.{kind}.{key}");
            if declared.insert(name.clone()) {
                let mut shape = grid.clone();
                shape.push(piece_numel);
                writer.declare_tensor(&name, DType::F32, shape)?;
            }
            let source = [&optimizer.main, &optimizer.exp_avg, &optimizer.exp_avg_sq][k];
            let value = source.get(&param.global).with_context(|| {
                format!("{}: no optimizer state for {}", state.source, param.global)
            })?;
            let shard = shard_of(&param.global, value, config, t, tp)?;
            for (d, range) in &parts {
                for piece in 0..stride {
                    let within = piece * piece_numel..(piece + 1) * piece_numel;
                    let (start, end) = (range.start.max(within.start), range.end.min(within.end));
                    if start >= end {
                        continue;
                    }
                    let mut offsets = position.clone();
                    offsets[row_axis] += piece * tp;
                    offsets.push(start - within.start);
                    let mut sizes = vec![1; position.len()];
                    sizes.push(end - start);
                    let part = shard.flat_slice(
                        start as i64,
                        (end - start) as i64,
                        vec![(end - start) as i64],
                    )?;
                    writer.write_chunk(
                        &name,
                        rank_of(*d),
                        ChunkPlace { offsets, sizes },
                        |emit| {
                            part.for_each_chunk(|chunk| {
                                with_bytes(&chunk.to_kind(tch::Kind::Float), &mut *emit)
                            })
                        },
                    )?;
                }
            }
        }
    }
    Ok(first_rank)
}

/// The parameters of one of the optimizer's parts (all of them, or the dense ones or the routed
/// experts' of a Mixture-of-Experts model) on tensor rank 0 of the first stage, and how many of
/// them data-parallel rank 0 holds state of.
#[derive(Clone, Default)]
struct OptimizerPart {
    params: Vec<(String, Vec<usize>)>,
    params_on_first_rank: usize,
}

fn num_experts(config: &TransformerConfig) -> usize {
    config.moe.as_ref().map_or(0, |m| m.num_experts as usize)
}

/// `common.pt`: args, iteration, the optimizer's parameter groups (with the step, as apex's
/// Adam keeps it) and per-parameter steps (`params_on_first_rank` of them, as rank 0 writes
/// them) of each of its `parts` (two, by index, for the chained optimizer of an
/// expert-parallel Mixture-of-Experts model), the scheduler, and the content metadata Megatron reads the
/// distributed optimizer's sharding type from. Its tensors (the steps) all hold the
/// optimizer's step.
fn common_state(
    state: &ModelState,
    target: TargetLayout,
    data_parallel: usize,
    distributed_optimizer: bool,
    expert_parallel: usize,
    parts: &[OptimizerPart],
) -> Result<(Saved, Vec<TensorSlot>)> {
    let mut args = args_namespace(state, target)?;
    let has_optimizer = state.optimizer.is_some();
    let world = target.tensor * target.pipeline * data_parallel;
    let flags = [
        ("ckpt_format", Saved::Value(Value::Str("torch_dist".into()))),
        ("use_dist_ckpt", Saved::Value(Value::Bool(true))),
        (
            "use_distributed_optimizer",
            Saved::Value(Value::Bool(has_optimizer && distributed_optimizer)),
        ),
        ("ckpt_fully_parallel_save", Saved::Value(Value::Bool(true))),
        (
            "no_save_optim",
            Saved::Value(if has_optimizer {
                Value::None
            } else {
                Value::Bool(true)
            }),
        ),
        ("no_save_rng", Saved::Value(Value::Bool(true))),
        (
            "data_parallel_size",
            Saved::Value(Value::Int(data_parallel as i64)),
        ),
        ("world_size", Saved::Value(Value::Int(world as i64))),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .chain(moe_args(state, expert_parallel));
    for (key, value) in flags {
        match args.iter_mut().find(|(k, _)| *k == key) {
            Some(entry) => entry.1 = value,
            None => args.push((key, value)),
        }
    }
    let mut entries = vec![
        ("args".to_string(), Saved::Namespace(args)),
        (
            "checkpoint_version".to_string(),
            Saved::Value(Value::Float(3.0)),
        ),
        (
            "iteration".to_string(),
            Saved::Value(Value::Int(state.run.iteration as i64)),
        ),
    ];
    let mut tensors = Vec::new();
    let mut content = vec![
        (
            "chained_optim_avoid_prefix".to_string(),
            Saved::Value(Value::Bool(true)),
        ),
        (
            "singleton_local_shards".to_string(),
            Saved::Value(Value::Bool(false)),
        ),
    ];
    if let Some(optimizer) = &state.optimizer {
        let mut saved_parts = Vec::new();
        for (index, part) in parts.iter().enumerate() {
            let saved = optimizer_part(
                state,
                optimizer.step,
                part,
                index > 0,
                distributed_optimizer,
                &mut tensors,
            );
            saved_parts.push((index as i64, saved));
        }
        let optimizer_entry = match saved_parts.len() {
            1 => saved_parts.pop().expect("one part").1,
            _ => Saved::IndexedDict(saved_parts),
        };
        entries.push(("optimizer".into(), optimizer_entry));
        if distributed_optimizer {
            content.insert(
                0,
                (
                    "distrib_optim_sharding_type".to_string(),
                    Saved::Value(Value::Str("fully_sharded_model_space".into())),
                ),
            );
        }
    }
    entries.extend(schedule_entries(state));
    entries.push(("content_metadata".into(), Saved::Dict(content)));
    Ok((Saved::Dict(entries), tensors))
}

/// One optimizer's `common.pt` entry: its parameter groups, with the routed experts' marked
/// `is_expert_parallel` where `experts`, and a step tensor (appended to `tensors`) per parameter
/// data-parallel rank 0 holds: the distributed optimizer's `param_state` in
/// `fully_sharded_model_space`, or the plain optimizer's own state dictionary.
fn optimizer_part(
    state: &ModelState,
    step: f64,
    part: &OptimizerPart,
    experts: bool,
    distributed_optimizer: bool,
    tensors: &mut Vec<TensorSlot>,
) -> Saved {
    let members_of_groups = param_groups(&part.params);
    let groups = members_of_groups
        .iter()
        .map(|members| {
            let (name, shape) = &part.params[members[0]];
            let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let decayed = !excluded_from_weight_decay(name, &shape);
            let mut group = group_hyperparameters(state, decayed);
            for (key, value) in &mut group {
                if *key == "is_expert_parallel" {
                    *value = Value::Bool(experts);
                }
            }
            group.push(("step", Value::Float(step)));
            group
        })
        .collect::<Vec<_>>();
    let mut per_param = Vec::new();
    for index in 0..part.params_on_first_rank {
        tensors.push(TensorSlot {
            dtype: DType::F32,
            shape: Vec::new(),
        });
        per_param.push((
            index as i64,
            Saved::Dict(vec![("step".into(), Saved::Tensor(tensors.len() - 1))]),
        ));
    }
    let as_dict = |group: Vec<(&str, Value)>| {
        Saved::Dict(
            group
                .into_iter()
                .map(|(k, v)| (k.to_string(), Saved::Value(v)))
                .collect(),
        )
    };
    let scaler = (state.params_dtype == "float16")
        .then(|| state.run.grad_scaler.as_ref().and_then(json_to_value))
        .flatten()
        .map(|scaler| ("grad_scaler".to_string(), Saved::Value(scaler)));
    if !distributed_optimizer {
        // The plain optimizer's own state dictionary: its per-parameter state (the moments
        // are sharded tensors, saved beside the model's), its groups with their members,
        // and, for 16-bit models, the fp32 copies (sharded too).
        let mut first = 0;
        let groups = groups
            .into_iter()
            .zip(&members_of_groups)
            .map(|(mut group, members)| {
                let ids = (first..first + members.len())
                    .map(|i| Value::Int(i as i64))
                    .collect();
                first += members.len();
                group.push(("params", Value::List(ids)));
                as_dict(group)
            })
            .collect::<Vec<_>>();
        let group_count = groups.len();
        let mut wrapped = vec![(
            "optimizer".to_string(),
            Saved::Dict(vec![
                ("state".to_string(), Saved::IndexedDict(per_param)),
                ("param_groups".to_string(), Saved::List(groups)),
            ]),
        )];
        if state.params_dtype != "float32" {
            wrapped.push((
                "fp32_from_fp16_params".into(),
                Saved::List(vec![Saved::List(Vec::new()); group_count]),
            ));
        }
        wrapped.extend(scaler);
        return Saved::Dict(wrapped);
    }
    let groups = groups.into_iter().map(as_dict).collect();
    let mut wrapped = vec![(
        "optimizer".to_string(),
        Saved::Dict(vec![("param_groups".to_string(), Saved::List(groups))]),
    )];
    wrapped.extend(scaler);
    wrapped.push(("param_state".into(), Saved::IndexedDict(per_param)));
    wrapped.push((
        "param_state_sharding_type".into(),
        Saved::Value(Value::Str("fully_sharded_model_space".into())),
    ));
    Saved::Dict(wrapped)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column-parallel rows, row-parallel columns and SwiGLU's two halves land where Megatron's
    /// sharded tensors put them.
    #[test]
    fn tensor_parallel_pieces_sit_at_megatrons_offsets() {
        let rows = tp_pieces(TensorSplit::Rows { stride: 1 }, &[4, 3], 1, 2);
        assert_eq!(
            (rows[0].offsets.clone(), rows[0].sizes.clone()),
            (vec![4, 0], vec![4, 3])
        );
        let columns = tp_pieces(TensorSplit::Columns, &[4, 3], 1, 2);
        assert_eq!(columns[0].offsets, vec![0, 3]);
        let swiglu = tp_pieces(TensorSplit::Rows { stride: 2 }, &[4, 3], 1, 2);
        let places: Vec<_> = swiglu
            .iter()
            .map(|p| (p.offsets[0], p.sizes[0], p.shard_rows.clone()))
            .collect();
        assert_eq!(places, vec![(2, 2, 0..2), (6, 2, 2..4)]);
        assert_eq!(joined_shape(TensorSplit::Columns, &[4, 3], 2), vec![4, 6]);
        assert_eq!(
            sharded_key("decoder.layers.3.input_layernorm.weight", 4, 0),
            (
                "decoder.layers.self_attention.linear_qkv.layer_norm_weight".to_string(),
                vec![(3, 4)]
            )
        );
        assert_eq!(
            sharded_key(
                "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
                4,
                8
            ),
            (
                "decoder.layers.mlp.experts.experts.linear_fc2.weight".to_string(),
                vec![(1, 4), (2, 8)]
            )
        );
    }
}
