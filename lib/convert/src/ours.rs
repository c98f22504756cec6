//! Our own checkpoints (safetensors + `metadata.json`) in and out of a [`ModelState`], through
//! the checkpoint module's writer and reader, in any TP/PP (interleaved too) layout, with the
//! optimizer's float32 main parameters and Adam moments laid out in each rank's flat buffer
//! exactly as `MixedPrecisionOptimizer` keeps them.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::lazy::{safetensors_tensors, LazyTensor};
use super::sizes::{check_layers, layers_found};
use super::state::{shard_of, shard_shape, ModelState, OptimizerState, RunState, Tensors};
use megatron_models::gpt::megatron_names::expert_of;
use megatron_models::layers::moe::config::MoeConfig;
use megatron_models::ParamAttributes;
use megatron_models::{
    ChunkSpec, FamilyModel, GptModel, ModelOptions, PipelineSplit, Recompute, T5Model,
    TransformerConfig,
};
use megatron_optim::{BufferLayout, ParamShape, ShardGroup, Slot};
use megatron_parallel::ParallelState;
use megatron_store::{
    begin_save, finish_save, has_vocab_rows, optimizer_file, rank_directory_name,
    staging_directory, tensor_split, write_rank_file_streamed, CheckpointDirectory,
    CheckpointMetadata, TensorEntry, CHECKPOINT_FORMAT, EXPERT_BIAS_FILE, MODEL_FILE,
};

/// The model-parallel layout to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetLayout {
    pub tensor: usize,
    pub pipeline: usize,
    /// Model chunks per pipeline stage (1 without interleaving).
    pub virtual_stages: usize,
}

/// The names of a whole model of `config`'s structure (one layer, an MoE layer where
/// `moe_layer` and the model has them), in `GptModel::named_parameters` order, read from a model
/// of the same structure but tiny sizes (names and order follow the model's code; a full-size
/// probe would hold a layer and the embeddings of a possibly huge model).
fn probe_parameter_names(config: &TransformerConfig, moe_layer: bool) -> Result<Vec<String>> {
    let heads = config.num_attention_heads;
    let probe = TransformerConfig {
        num_layers: 1,
        hidden_size: 2,
        num_attention_heads: heads / config.num_query_groups,
        num_query_groups: 1,
        kv_channels: 2,
        ffn_hidden_size: 2,
        max_position_embeddings: 1,
        vocab_size: 1,
        make_vocab_size_divisible_by: 1,
        rotary_percent: 1.0,
        moe: config.moe.clone().map(|moe| MoeConfig {
            ffn_hidden_size: 2,
            layer_pattern: vec![moe_layer],
            shared_expert_intermediate_size: moe.shared_expert_intermediate_size.map(|_| 2),
            ..moe
        }),
        ..config.clone()
    };
    let options = ModelOptions {
        params_dtype: Kind::BFloat16,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 0,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = GptModel::new_chunk(
        probe,
        options,
        &ParallelState::single(),
        ChunkSpec::whole(1),
    )?;
    Ok(model
        .named_parameters()
        .into_iter()
        .map(|p| p.name)
        .collect())
}

/// The order of a transformer layer's parameters in `GptModel::named_parameters`: a dense
/// layer's, and an MoE layer's where the model has them.
struct LayerOrders {
    dense: Vec<String>,
    moe: Vec<String>,
}

impl LayerOrders {
    fn of(config: &TransformerConfig) -> Result<LayerOrders> {
        let order = |moe_layer| -> Result<Vec<String>> {
            Ok(probe_parameter_names(config, moe_layer)?
                .into_iter()
                .filter_map(|name| name.strip_prefix("decoder.layers.0.").map(str::to_string))
                .collect())
        };
        Ok(LayerOrders {
            dense: order(false)?,
            moe: if config.moe.is_some() {
                order(true)?
            } else {
                Vec::new()
            },
        })
    }

    /// Layer `layer`'s (global index) parameters.
    fn layer(&self, config: &TransformerConfig, layer: usize) -> &[String] {
        match &config.moe {
            Some(moe) if moe.is_moe_layer(layer) => &self.moe,
            _ => &self.dense,
        }
    }
}

/// The unsplit shape (the vocabulary padded for one rank) of the parameter `name` of a model
/// of `config`.
fn parameter_shape(config: &TransformerConfig, name: &str) -> Result<Vec<i64>> {
    let h = config.hidden_size;
    let leaf = name
        .strip_prefix("decoder.layers.")
        .and_then(|rest| rest.split_once('.'))
        .map_or(name, |(_, leaf)| leaf);
    Ok(match leaf {
        "embedding.word_embeddings.weight" | "output_layer.weight" => {
            vec![config.padded_vocab_size(1), h]
        }
        "embedding.position_embeddings.weight" => vec![config.max_position_embeddings, h],
        "self_attention.linear_qkv.weight" => vec![config.qkv_width(), h],
        "self_attention.linear_qkv.bias" => vec![config.qkv_width()],
        "self_attention.linear_proj.weight" => {
            vec![h, config.num_attention_heads * config.kv_channels]
        }
        "mlp.linear_fc1.weight" => vec![config.fc1_width(), h],
        "mlp.linear_fc1.bias" => vec![config.fc1_width()],
        "mlp.linear_fc2.weight" => vec![h, config.ffn_hidden_size],
        "self_attention.linear_proj.bias" | "mlp.linear_fc2.bias" => vec![h],
        "self_attention.q_layernorm.weight"
        | "self_attention.q_layernorm.bias"
        | "self_attention.k_layernorm.weight"
        | "self_attention.k_layernorm.bias" => vec![config.kv_channels],
        norm if norm.contains("layernorm.") => vec![h],
        "mlp.shared_experts.gate_weight" => vec![1, h],
        "mlp.router.weight" => vec![moe_of(config, name)?.num_experts, h],
        expert
            if expert.starts_with("mlp.experts.local_experts.")
                || expert.starts_with("mlp.shared_experts.") =>
        {
            let moe = moe_of(config, name)?;
            let width = match expert.starts_with("mlp.shared_experts.") {
                true => moe
                    .shared_expert_intermediate_size
                    .with_context(|| format!("{name}: the model has no shared expert"))?,
                false => moe.ffn_hidden_size,
            };
            let gated = if config.activation == megatron_models::Activation::Swiglu {
                2
            } else {
                1
            };
            match expert.rsplit_once('.').map_or("", |(module, _)| module) {
                module if module.ends_with("linear_fc1") => vec![gated * width, h],
                module if module.ends_with("linear_fc2") => vec![h, width],
                _ => bail!("no shape known for parameter {name}"),
            }
        }
        _ => bail!("no shape known for parameter {name}"),
    })
}

fn moe_of<'a>(config: &'a TransformerConfig, name: &str) -> Result<&'a MoeConfig> {
    config
        .moe
        .as_ref()
        .with_context(|| format!("{name}: the model has no Mixture-of-Experts layers"))
}

/// `(chunk-local name, global name)` of every parameter of chunk `spec`, in parameter order.
fn chunk_parameters(
    config: &TransformerConfig,
    spec: &ChunkSpec,
    layer_order: &LayerOrders,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let same = |name: &str| (name.to_string(), name.to_string());
    if spec.pre_process {
        out.push(same("embedding.word_embeddings.weight"));
        if config.position_embedding_type == megatron_models::PositionEmbeddingType::LearnedAbsolute
        {
            out.push(same("embedding.position_embeddings.weight"));
        }
    }
    for (local, global) in spec.layers.clone().enumerate() {
        for leaf in layer_order.layer(config, global) {
            out.push((
                format!("decoder.layers.{local}.{leaf}"),
                format!("decoder.layers.{global}.{leaf}"),
            ));
        }
    }
    if spec.post_process {
        for leaf in layer_order
            .dense
            .iter()
            .filter_map(|l| l.strip_prefix("input_layernorm."))
        {
            let name = format!("decoder.final_layernorm.{leaf}");
            out.push(same(&name));
        }
        if config.untie_embeddings_and_output_weights {
            out.push(same("output_layer.weight"));
        } else if !spec.pre_process {
            // The last stage's copy of the tied word embeddings.
            out.push((
                "output_layer.weight".into(),
                "embedding.word_embeddings.weight".into(),
            ));
        }
    }
    out
}

fn chunk_prefix(chunk: usize, chunks: usize) -> String {
    if chunks == 1 {
        String::new()
    } else {
        format!("model{chunk}.")
    }
}

/// `(rank file name, global name)` of the routers' expert biases of pipeline stage `stage`
/// (layers counted within each chunk, as the parameters are); none without
/// `--moe-router-enable-expert-bias`.
fn rank_expert_biases(
    config: &TransformerConfig,
    split: &PipelineSplit,
    stage: usize,
) -> Result<Vec<(String, String)>> {
    let Some(moe) = config
        .moe
        .as_ref()
        .filter(|moe| moe.expert_bias_update_rate.is_some())
    else {
        return Ok(Vec::new());
    };
    let chunks = split.chunks_of(stage)?;
    let count = chunks.len();
    Ok(chunks
        .iter()
        .enumerate()
        .flat_map(|(c, spec)| {
            let prefix = chunk_prefix(c, count);
            spec.layers
                .clone()
                .enumerate()
                .filter(|(_, global)| moe.is_moe_layer(*global))
                .map(move |(local, global)| {
                    (
                        format!("{prefix}decoder.layers.{local}.mlp.router.expert_bias"),
                        format!("decoder.layers.{global}.mlp.router.expert_bias"),
                    )
                })
        })
        .collect())
}

/// Reads the routers' expert biases of `checkpoint` (every pipeline stage's file, tensor rank
/// 0's), by global name; a checkpoint saved without them (before the flag was given) gives
/// zeros, as training starts them, and a note.
fn read_expert_biases(
    checkpoint: &CheckpointDirectory,
    config: &TransformerConfig,
    split: &PipelineSplit,
) -> Result<Tensors> {
    let mut out = Tensors::new();
    for stage in 0..split.stages {
        let names = rank_expert_biases(config, split, stage)?;
        if names.is_empty() {
            continue;
        }
        let rank_dir = rank_directory_name(0, stage, split.stages);
        let saved = rank_file(checkpoint, &rank_dir, EXPERT_BIAS_FILE)?;
        if saved.is_none() {
            eprintln!(
                "note: {}/{rank_dir} has no {EXPERT_BIAS_FILE}; its routers' expert biases start at zero",
                checkpoint.directory.display()
            );
        }
        for (local, global) in names {
            let bias = match &saved {
                Some(saved) => saved.get(&local).cloned().with_context(|| {
                    format!(
                        "{}/{rank_dir}/{EXPERT_BIAS_FILE}: no tensor {local}",
                        checkpoint.directory.display()
                    )
                })?,
                None => LazyTensor::from(Tensor::zeros(
                    [config.moe.as_ref().map_or(0, |m| m.num_experts)],
                    (Kind::Float, Device::Cpu),
                )),
            };
            out.insert(global, bias);
        }
    }
    Ok(out)
}

/// Writes the expert biases of `state` that pipeline stage `stage` holds into `rank_dir`.
fn write_expert_biases(
    staging: &Path,
    rank_dir: &str,
    state: &ModelState,
    split: &PipelineSplit,
    stage: usize,
) -> Result<()> {
    let names = rank_expert_biases(&state.config, split, stage)?;
    if names.is_empty() {
        return Ok(());
    }
    let biases = names
        .iter()
        .map(|(_, global)| {
            state
                .expert_biases
                .get(global)
                .with_context(|| format!("{}: no expert bias {global}", state.source))
        })
        .collect::<Result<Vec<_>>>()?;
    let entries: Vec<TensorEntry> = names
        .iter()
        .zip(&biases)
        .map(|((local, _), bias)| TensorEntry {
            name: local.clone(),
            kind: Kind::Float,
            shape: bias.shape().to_vec(),
        })
        .collect();
    write_rank_file_streamed(staging, rank_dir, EXPERT_BIAS_FILE, &entries, |i, emit| {
        emit(&biases[i].read()?.to_kind(Kind::Float))
    })
}

/// Every rank's `(rank file name, global name)` parameters in optimizer order.
fn rank_parameters(
    config: &TransformerConfig,
    split: &PipelineSplit,
    stage: usize,
    layer_order: &LayerOrders,
) -> Result<Vec<(String, String)>> {
    let chunks = split.chunks_of(stage)?;
    let count = chunks.len();
    Ok(chunks
        .iter()
        .enumerate()
        .flat_map(|(c, spec)| {
            let prefix = chunk_prefix(c, count);
            chunk_parameters(config, spec, layer_order)
                .into_iter()
                .map(move |(local, global)| (format!("{prefix}{local}"), global))
        })
        .collect())
}

/// The rank's flat optimizer buffer layout (one data-parallel rank, not sharded).
fn flat_layout(names: &[(String, Vec<i64>)]) -> BufferLayout {
    let shapes: Vec<ParamShape> = names
        .iter()
        .map(|(name, shape)| ParamShape {
            name,
            shape: shape.clone(),
            attributes: ParamAttributes::default(),
        })
        .collect();
    BufferLayout::new(&shapes, usize::MAX, 0, 1, false)
}

/// The distributed optimizer's sharding of a saved optimizer state over data-parallel ranks, as
/// the run that resumes from it lays its buffers out (`--ddp-bucket-size`, or its default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerShards {
    pub data_parallel: usize,
    pub bucket_size: usize,
}

/// A rank's parameters (file names and shapes, with their global names) as the distributed
/// optimizer's buffer sees them: embeddings tied across pipeline stages get a bucket of their own
/// (as GptModel marks them).
fn sharded_param_shapes<'a>(
    shapes: &'a [(String, Vec<i64>)],
    params: &[(String, String)],
    tied_across_stages: bool,
) -> Vec<ParamShape<'a>> {
    shapes
        .iter()
        .zip(params)
        .map(|((name, shape), (_, global))| ParamShape {
            name,
            shape: shape.clone(),
            attributes: ParamAttributes {
                tied_across_stages: tied_across_stages
                    && global == "embedding.word_embeddings.weight",
                // Routed experts sit in buckets of their own, as the engine lays them out.
                expert: global.contains(".mlp.experts."),
                ..ParamAttributes::default()
            },
        })
        .collect()
}

/// Which tensor-parallel shard a rank file holds, and in which dtype.
#[derive(Clone, Copy)]
pub(crate) struct RankShard<'a> {
    /// The (trunk) configuration that decides tensor splits and vocabulary padding.
    pub config: &'a TransformerConfig,
    pub rank: usize,
    pub size: usize,
    pub kind: Kind,
}

/// Writes one rank's model file and, with `optimizer`, its flat optimizer buffer laid out as
/// `MixedPrecisionOptimizer` keeps it (one data-parallel rank, or with `shards` each
/// data-parallel rank's shard of the distributed optimizer), one tensor at a time: each tensor
/// is read from `weights` (unsplit, by global name) and cut for `shard` as it is written.
/// `params` are the rank's `(file name, global name)` parameters in model order;
/// `tied_across_stages` says the word embeddings are tied to a later pipeline stage's head.
#[allow(clippy::too_many_arguments)]
pub(crate) fn write_rank(
    staging: &Path,
    rank_dir: &str,
    params: &[(String, String)],
    weights: &Tensors,
    optimizer: Option<&OptimizerState>,
    shard: RankShard,
    shards: Option<OptimizerShards>,
    tied_across_stages: bool,
    source: &str,
) -> Result<()> {
    let tensor = |name: &str| {
        weights
            .get(name)
            .with_context(|| format!("{source}: no tensor {name} for this architecture"))
    };
    let entries = params
        .iter()
        .map(|(local, global)| {
            Ok(TensorEntry {
                name: local.clone(),
                kind: shard.kind,
                shape: shard_shape(global, tensor(global)?.shape(), shard.config, shard.size),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    write_rank_file_streamed(staging, rank_dir, MODEL_FILE, &entries, |i, emit| {
        let global = &params[i].1;
        shard_of(
            global,
            tensor(global)?,
            shard.config,
            shard.rank,
            shard.size,
        )?
        .for_each_chunk(|chunk| emit(&chunk.to_kind(shard.kind)))
    })?;
    let Some(optimizer) = optimizer else {
        return Ok(());
    };
    let shapes: Vec<(String, Vec<i64>)> = entries
        .iter()
        .map(|e| (e.name.clone(), e.shape.clone()))
        .collect();
    let globals: HashMap<&str, &str> = params
        .iter()
        .map(|(l, g)| (l.as_str(), g.as_str()))
        .collect();
    let buffers = [&optimizer.main, &optimizer.exp_avg, &optimizer.exp_avg_sq];
    let ranks = shards.map_or(1, |s| s.data_parallel);
    for d in 0..ranks {
        let layout = match shards {
            Some(shards) if ranks > 1 => BufferLayout::new(
                &sharded_param_shapes(&shapes, params, tied_across_stages),
                shards.bucket_size,
                d,
                ranks,
                true,
            ),
            _ => flat_layout(&shapes),
        };
        // This rank's pieces in its buffer's order: (where in the buffer, slot, elements of
        // the slot's parameter).
        let mut pieces: Vec<(Range<usize>, &Slot, Range<usize>)> = if ranks > 1 {
            layout
                .segments
                .iter()
                .map(|segment| {
                    let slot = &layout.slots[segment.slot];
                    let start = segment.buffer.start - slot.range.start;
                    (
                        segment.shard.clone(),
                        slot,
                        start..start + segment.buffer.len(),
                    )
                })
                .collect()
        } else {
            layout
                .slots
                .iter()
                .map(|slot| (slot.range.clone(), slot, 0..slot.range.len()))
                .collect()
        };
        pieces.sort_by_key(|(at, _, _)| at.start);
        let length = if ranks > 1 {
            layout.shard_len
        } else {
            layout.len
        };
        let mut entries: Vec<TensorEntry> = ["main", "exp_avg", "exp_avg_sq"]
            .iter()
            .map(|name| TensorEntry {
                name: name.to_string(),
                kind: Kind::Float,
                shape: vec![length as i64],
            })
            .collect();
        entries.push(TensorEntry {
            name: "step".into(),
            kind: Kind::Float,
            shape: vec![],
        });
        let zeros = |n: usize| Tensor::zeros([n as i64], (Kind::Float, Device::Cpu));
        write_rank_file_streamed(
            staging,
            rank_dir,
            &optimizer_file((ranks > 1).then_some(d)),
            &entries,
            |i, emit| {
                let Some(map) = buffers.get(i) else {
                    return emit(&Tensor::from(optimizer.step as f32));
                };
                let mut at = 0;
                for (place, slot, elements) in &pieces {
                    if place.start > at {
                        emit(&zeros(place.start - at))?;
                    }
                    let global = globals[slot.name.as_str()];
                    let value = map
                        .get(global)
                        .with_context(|| format!("{}: no optimizer state for {global}", source))?;
                    let whole = shard_of(global, value, shard.config, shard.rank, shard.size)?;
                    ensure!(
                        whole.numel() as usize == slot.range.len(),
                        "{}: optimizer state of {global} has {} elements for a parameter of {}",
                        source,
                        whole.numel(),
                        slot.range.len()
                    );
                    // A whole parameter streams as it is: a slice of a tensor-parallel shard
                    // would be read into memory first.
                    let piece = if elements.len() == slot.range.len() {
                        whole
                    } else {
                        whole.flat_slice(
                            elements.start as i64,
                            elements.len() as i64,
                            vec![elements.len() as i64],
                        )?
                    };
                    piece.for_each_chunk(|chunk| emit(&chunk.to_kind(Kind::Float)))?;
                    at = place.end;
                }
                if length > at {
                    emit(&zeros(length - at))?;
                }
                Ok(())
            },
        )?;
    }
    Ok(())
}

/// Writes `state` as our checkpoint under `root` (which must not hold another checkpoint) in
/// `target`'s layout, one tensor at a time: each rank file's tensors are read from `state`
/// and cut as they are written.
pub fn save_megatron_rs(state: &ModelState, root: &Path, target: TargetLayout) -> Result<()> {
    save_megatron_rs_sharded(state, root, target, None)
}

/// [`save_megatron_rs`] with the optimizer state sharded over data-parallel ranks as the
/// distributed optimizer of a run with `shards` keeps it (one file per rank), so that run
/// resumes from it.
pub fn save_megatron_rs_sharded(
    state: &ModelState,
    root: &Path,
    target: TargetLayout,
    shards: Option<OptimizerShards>,
) -> Result<()> {
    let config = &state.config;
    config.validate(target.tensor as i64)?;
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: target.pipeline,
        chunks: target.virtual_stages,
        first_stage_layers: None,
        last_stage_layers: None,
    };
    let layer_order = LayerOrders::of(config)?;
    let kind = super::tensors::kind_named(&state.params_dtype)?;
    let iteration = state.run.iteration;
    begin_save(root, iteration)?;
    let staging = staging_directory(root, iteration);
    for t in 0..target.tensor {
        for stage in 0..target.pipeline {
            let params = rank_parameters(config, &split, stage, &layer_order)?;
            let rank_dir = rank_directory_name(t, stage, target.pipeline);
            write_expert_biases(&staging, &rank_dir, state, &split, stage)?;
            write_rank(
                &staging,
                &rank_dir,
                &params,
                &state.weights,
                state.optimizer.as_ref(),
                RankShard {
                    config,
                    rank: t,
                    size: target.tensor,
                    kind,
                },
                shards,
                !config.untie_embeddings_and_output_weights && target.pipeline > 1,
                &state.source,
            )?;
        }
    }
    let metadata = CheckpointMetadata {
        format: CHECKPOINT_FORMAT.to_string(),
        checkpoint_version: 3.0,
        iteration,
        model_type: GptModel::MODEL_TYPE.to_string(),
        model: serde_json::to_value(config)?,
        params_dtype: state.params_dtype.clone(),
        tensor_model_parallel_size: target.tensor,
        pipeline_model_parallel_size: target.pipeline,
        virtual_pipeline_stages: target.virtual_stages,
        decoder_first_pipeline_num_layers: None,
        decoder_last_pipeline_num_layers: None,
        data_parallel_size: shards.map_or(1, |s| s.data_parallel),
        distributed_optimizer: shards.is_some_and(|s| s.data_parallel > 1),
        consumed_train_samples: state.run.consumed_train_samples,
        consumed_valid_samples: state.run.consumed_valid_samples,
        num_floating_point_operations_so_far: state.run.num_floating_point_operations_so_far,
        opt_param_scheduler: state.run.opt_param_scheduler.clone(),
        grad_scaler: state.run.grad_scaler.clone(),
        optimizer: state.optimizer.as_ref().map(|_| "adam".to_string()),
        has_rng_state: false,
        args: state.run.args.clone(),
        data: None,
    };
    finish_save(root, &metadata)?;
    Ok(())
}

/// The tensors of `rank_dir/file` of `checkpoint`, read lazily (after checking the file's
/// checksum where the checkpoint has them); `None` when the file is absent.
fn rank_file(
    checkpoint: &CheckpointDirectory,
    rank_dir: &str,
    file: &str,
) -> Result<Option<BTreeMap<String, LazyTensor>>> {
    let directory = checkpoint.directory.join(rank_dir);
    ensure!(
        directory.is_dir(),
        "{} has no {rank_dir} (saved with {})",
        checkpoint.directory.display(),
        checkpoint.metadata.describe_layout()
    );
    let path = directory.join(file);
    if !path.exists() {
        return Ok(None);
    }
    checkpoint
        .checksums
        .verify(&format!("{rank_dir}/{file}"), &path)?;
    safetensors_tensors(&path).map(Some)
}

/// The pipeline split `metadata` was saved with.
fn saved_split(metadata: &CheckpointMetadata, config: &TransformerConfig) -> PipelineSplit {
    PipelineSplit {
        num_layers: config.num_layers,
        stages: metadata.pipeline_model_parallel_size,
        chunks: metadata.virtual_pipeline_stages.max(1),
        first_stage_layers: metadata.decoder_first_pipeline_num_layers,
        last_stage_layers: metadata.decoder_last_pipeline_num_layers,
    }
}

/// Tensor-parallel parts (rank order) of each unsplit tensor joined lazily, the vocabulary
/// padded for one rank.
pub(super) fn join_parts(
    parts: BTreeMap<String, Vec<LazyTensor>>,
    config: &TransformerConfig,
    tp: usize,
    what: &str,
) -> Result<Tensors> {
    let padded = config.padded_vocab_size(1);
    parts
        .into_iter()
        .map(|(name, parts)| {
            ensure!(
                parts.len() == tp,
                "{what} {name} found in {} of {tp} tensor-parallel ranks",
                parts.len()
            );
            let mut joined = LazyTensor::joined(parts, tensor_split(&name, config))
                .with_context(|| format!("{what} {name}"))?;
            if has_vocab_rows(&name) {
                joined = joined.with_rows(padded);
            }
            Ok((name, joined))
        })
        .collect()
}

/// Reads our checkpoint `checkpoint` (any layout) into a [`ModelState`] whose tensors are read
/// from the files when a saver asks; with `optimizer`, the float32 main parameters and Adam
/// moments too.
pub fn load_megatron_rs(checkpoint: &CheckpointDirectory, optimizer: bool) -> Result<ModelState> {
    let metadata = &checkpoint.metadata;
    if metadata.model_type == T5Model::MODEL_TYPE {
        bail!(
            "{}: a T5 checkpoint; convert it with --model-type T5",
            checkpoint.directory.display()
        );
    }
    if metadata.model_type != GptModel::MODEL_TYPE {
        bail!(
            "{}: converting {} checkpoints is not supported",
            checkpoint.directory.display(),
            metadata.model_type
        );
    }
    let config: TransformerConfig = serde_json::from_value(metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
    let split = saved_split(metadata, &config);
    let layer_order = LayerOrders::of(&config)?;
    let (weights, files) = read_model_files(checkpoint, &config, &|stage| {
        rank_parameters(&config, &split, stage, &layer_order)
    })?;
    let optimizer = match (optimizer, metadata.optimizer.as_deref()) {
        (true, Some("adam")) => Some(load_optimizer(checkpoint, &config, &files)?),
        _ => None,
    };
    let expert_biases = read_expert_biases(checkpoint, &config, &split)?;
    Ok(ModelState {
        config,
        params_dtype: metadata.params_dtype.clone(),
        weights,
        expert_biases,
        optimizer,
        run: RunState {
            iteration: metadata.iteration,
            consumed_train_samples: metadata.consumed_train_samples,
            consumed_valid_samples: metadata.consumed_valid_samples,
            num_floating_point_operations_so_far: metadata.num_floating_point_operations_so_far,
            opt_param_scheduler: metadata.opt_param_scheduler.clone(),
            grad_scaler: metadata.grad_scaler.clone(),
            args: metadata.args.clone(),
        },
        source_parallel: (
            metadata.tensor_model_parallel_size,
            metadata.pipeline_model_parallel_size,
        ),
        source: format!("megatron-rs checkpoint {}", checkpoint.directory.display()),
    })
}

/// The model files of `checkpoint` (any TP/PP layout) read lazily: the unsplit weights (tensor
/// parallel parts joined, the vocabulary padded for one rank) and every rank file.
/// `rank_params(stage)` lists a pipeline stage's `(file name, global name)` parameters in
/// model order; `config` is the trunk's (tensor splits, vocabulary).
pub(crate) fn read_model_files(
    checkpoint: &CheckpointDirectory,
    config: &TransformerConfig,
    rank_params: &dyn Fn(usize) -> Result<Vec<(String, String)>>,
) -> Result<(Tensors, Vec<RankFile>)> {
    let metadata = &checkpoint.metadata;
    let (tp, pp) = (
        metadata.tensor_model_parallel_size,
        metadata.pipeline_model_parallel_size,
    );
    let mut parts: BTreeMap<String, Vec<LazyTensor>> = BTreeMap::new();
    let mut files = Vec::new();
    for t in 0..tp {
        for stage in 0..pp {
            let rank_dir = rank_directory_name(t, stage, pp);
            let tensors = rank_file(checkpoint, &rank_dir, MODEL_FILE)?.with_context(|| {
                format!(
                    "{}/{rank_dir}: no {MODEL_FILE}",
                    checkpoint.directory.display()
                )
            })?;
            let params = rank_params(stage)?;
            for (local, global) in &params {
                let tensor = tensors.get(local).with_context(|| {
                    format!(
                        "{}/{rank_dir}/{MODEL_FILE}: no tensor {local}",
                        checkpoint.directory.display()
                    )
                })?;
                // The last stage's copy of tied embeddings equals the first stage's.
                if is_tied_copy(local, global) {
                    continue;
                }
                parts
                    .entry(global.clone())
                    .or_default()
                    .push(tensor.clone());
            }
            files.push((t, stage, rank_dir, params, tensors));
        }
    }
    let weights = join_parts(parts, config, tp, "tensor")
        .with_context(|| checkpoint.directory.display().to_string())?;
    Ok((weights, files))
}

/// Is the rank file's `local` tensor the last pipeline stage's copy of the tied word
/// embeddings (GPT's `output_layer.weight` read as `global` embeddings)? T5's untied
/// `lm_head.output_layer.weight` is a parameter of its own.
fn is_tied_copy(local: &str, global: &str) -> bool {
    local.ends_with("output_layer.weight") && global == "embedding.word_embeddings.weight"
}

/// A rank's model file as `read_model_files` read it: `(t, stage, rank directory, (local,
/// global) parameters, tensors)`.
pub(crate) type RankFile = (
    usize,
    usize,
    String,
    Vec<(String, String)>,
    BTreeMap<String, LazyTensor>,
);

/// The `--ddp-bucket-size` of the run that saved `metadata` over `ranks` data-parallel ranks:
/// its flag, or pretrain_gpt's default, max(40M, 1M × data-parallel size). Our runs record
/// their flags by group, conversions of Megatron's flat.
fn bucket_size_of(metadata: &CheckpointMetadata, ranks: usize) -> usize {
    metadata
        .args
        .get("parallel")
        .unwrap_or(&metadata.args)
        .get("ddp_bucket_size")
        .and_then(|v| v.as_u64())
        .map_or(
            megatron_optim::DEFAULT_BUCKET_SIZE.max(1_000_000 * ranks),
            |v| v as usize,
        )
}

/// How the optimizer state of the checkpoint `metadata` describes is sharded over
/// data-parallel ranks; `None` where it is whole (one file per model-parallel rank).
pub(crate) fn saved_optimizer_shards(metadata: &CheckpointMetadata) -> Option<OptimizerShards> {
    let ranks = metadata.data_parallel_size;
    (metadata.distributed_optimizer && ranks > 1).then(|| OptimizerShards {
        data_parallel: ranks,
        bucket_size: bucket_size_of(metadata, ranks),
    })
}

/// How a saved run split its routed experts: each data-parallel rank holds the state of its
/// expert-parallel rank's experts (the run's `--expert-model-parallel-size`), sharded over the
/// expert-data-parallel ranks holding the same experts, as the engine lays its buffers out.
#[derive(Debug, Clone, Copy)]
struct SavedExperts {
    parallel: usize,
    per_rank: usize,
}

impl SavedExperts {
    fn of(metadata: &CheckpointMetadata, config: &TransformerConfig) -> Self {
        let parallel = metadata
            .args
            .pointer("/model/expert_model_parallel_size")
            .and_then(|v| v.as_u64())
            .map_or(1, |e| e.max(1) as usize);
        let experts = config
            .moe
            .as_ref()
            .map_or(0, |moe| moe.num_experts as usize);
        SavedExperts {
            parallel,
            per_rank: experts / parallel,
        }
    }

    /// Whether data-parallel rank `data_rank` (tensor parallelism 1: its place in its stage)
    /// holds the parameter `global`: every rank holds the dense parameters.
    fn holds(&self, data_rank: usize, global: &str) -> bool {
        expert_of(global)
            .is_none_or(|(expert, _, _)| expert / self.per_rank.max(1) == data_rank % self.parallel)
    }
}

/// The per-parameter optimizer state (unsplit) of `checkpoint`'s rank `files` (any TP/PP
/// layout, distributed-optimizer shards and expert-parallel ranks included); `config` is the
/// trunk's. Each data-parallel rank's file is read through the layout its run gave its buffers
/// (its experts, its shards), and each parameter joined from the pieces that cover it.
pub(crate) fn load_optimizer(
    checkpoint: &CheckpointDirectory,
    config: &TransformerConfig,
    files: &[RankFile],
) -> Result<OptimizerState> {
    let metadata = &checkpoint.metadata;
    let data_parallel = metadata.data_parallel_size.max(1);
    let sharded = metadata.distributed_optimizer && data_parallel > 1;
    let experts = SavedExperts::of(metadata, config);
    ensure!(
        experts.parallel == 1 || metadata.tensor_model_parallel_size == 1,
        "{}: the optimizer state of a run with --expert-model-parallel-size {} and \
         --tensor-model-parallel-size {} is not read yet; convert it with --no-optimizer",
        checkpoint.directory.display(),
        experts.parallel,
        metadata.tensor_model_parallel_size
    );
    // As the training run decides whether each data-parallel rank writes a file of its own.
    let per_rank_files = (sharded || experts.parallel > 1) && data_parallel > 1;
    let tied = !config.untie_embeddings_and_output_weights;
    let bucket = bucket_size_of(metadata, data_parallel);
    let mut parts: [BTreeMap<String, Vec<LazyTensor>>; 3] = Default::default();
    let mut step = 0.0;
    for (_, _, rank_dir, params, tensors) in files {
        let where_ = |file: &str| format!("{}/{rank_dir}/{file}", checkpoint.directory.display());
        // Per buffer kind and global name: the pieces found, by their first element.
        let mut pieces: [HashMap<String, BTreeMap<usize, LazyTensor>>; 3] = Default::default();
        for d in 0..if per_rank_files { data_parallel } else { 1 } {
            let held: Vec<(String, String)> = params
                .iter()
                .filter(|(_, global)| experts.holds(d, global))
                .cloned()
                .collect();
            let shapes: Vec<(String, Vec<i64>)> = held
                .iter()
                .map(|(local, _)| (local.clone(), tensors[local].shape().to_vec()))
                .collect();
            let param_shapes = sharded_param_shapes(
                &shapes,
                &held,
                tied && metadata.pipeline_model_parallel_size > 1,
            );
            let group = |rank, size| ShardGroup { rank, size };
            let layout = BufferLayout::with_experts(
                &param_shapes,
                bucket,
                group(d, data_parallel),
                group(d / experts.parallel, data_parallel / experts.parallel),
                sharded,
            );
            let file = optimizer_file(per_rank_files.then_some(d));
            let state = rank_file(checkpoint, rank_dir, &file)?.with_context(|| {
                format!("{}: missing (saved with --no-save-optim?)", where_(&file))
            })?;
            if let Some(s) = state.get("step") {
                step = s.read()?.double_value(&[]);
            }
            for (i, key) in ["main", "exp_avg", "exp_avg_sq"].iter().enumerate() {
                let part = state
                    .get(*key)
                    .with_context(|| format!("{}: no tensor {key}", where_(&file)))?;
                let length = part.numel() as usize;
                ensure!(
                    length == layout.shard_len || (!sharded && length >= layout.shard_len),
                    "{}: the optimizer buffer {key} holds {length} elements, the model's layout {}",
                    where_(&file),
                    layout.shard_len
                );
                for segment in &layout.segments {
                    let slot = &layout.slots[segment.slot];
                    let global = &held[param_index(&held, &slot.name)].1;
                    let piece = part.flat_slice(
                        segment.shard.start as i64,
                        segment.shard.len() as i64,
                        vec![segment.shard.len() as i64],
                    )?;
                    // A parameter every rank holds whole (no sharding) is read once.
                    pieces[i]
                        .entry(global.clone())
                        .or_default()
                        .entry(segment.buffer.start - slot.range.start)
                        .or_insert(piece);
                }
            }
        }
        for (i, mut found) in pieces.into_iter().enumerate() {
            for (local, global) in params {
                if is_tied_copy(local, global) {
                    continue;
                }
                let shape = tensors[local].shape().to_vec();
                let numel = shape.iter().product::<i64>() as usize;
                let slot_pieces = found.remove(global).unwrap_or_default();
                let mut at = 0;
                for (start, piece) in &slot_pieces {
                    ensure!(
                        *start == at,
                        "{}/{rank_dir}: the optimizer shards do not cover {local}",
                        checkpoint.directory.display(),
                    );
                    at += piece.numel() as usize;
                }
                ensure!(
                    at == numel,
                    "{}/{rank_dir}: the optimizer shards do not cover {local}",
                    checkpoint.directory.display(),
                );
                let value = LazyTensor::concat(slot_pieces.into_values().collect(), shape)?;
                parts[i].entry(global.clone()).or_default().push(value);
            }
        }
    }
    let [main, exp_avg, exp_avg_sq] = parts;
    let join = |parts| {
        join_parts(
            parts,
            config,
            metadata.tensor_model_parallel_size,
            "optimizer state of",
        )
    };
    Ok(OptimizerState {
        step,
        main: join(main)?,
        exp_avg: join(exp_avg)?,
        exp_avg_sq: join(exp_avg_sq)?,
    })
}

/// Where the parameter a buffer slot names (its rank-file name) is in `params`.
fn param_index(params: &[(String, String)], local: &str) -> usize {
    params
        .iter()
        .position(|(name, _)| name == local)
        .expect("every slot is one of the parameters laid out")
}

impl ModelState {
    /// Checks every weight against the architecture — each tensor the model has, with its
    /// shape, and nothing else — so a corrupt or foreign input fails here, naming the tensor,
    /// instead of producing a checkpoint that cannot load.
    pub fn validate(&self) -> Result<()> {
        let config = &self.config;
        // Before the expected names are listed, so a wrong layer count is not materialised.
        let found = layers_found(
            self.weights.keys().map(String::as_str),
            &["decoder.layers."],
        );
        check_layers(&self.source, "num_layers", config.num_layers, found)?;
        let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for name in probe_parameter_names(config, false)? {
            if !name.starts_with("decoder.layers.0.") {
                let shape = parameter_shape(config, &name)?;
                expected.insert(name, shape);
            }
        }
        let orders = LayerOrders::of(config)?;
        for layer in 0..config.num_layers {
            for leaf in orders.layer(config, layer) {
                let name = format!("decoder.layers.{layer}.{leaf}");
                expected.insert(name.clone(), parameter_shape(config, &name)?);
            }
        }
        for (name, shape) in &expected {
            let tensor = self
                .weights
                .get(name)
                .with_context(|| format!("{}: missing tensor {name}", self.source))?;
            ensure!(
                tensor.shape() == shape.as_slice(),
                "{}: tensor {name} has shape {:?}, the architecture needs {shape:?}",
                self.source,
                tensor.shape()
            );
        }
        if let Some(name) = self.weights.keys().find(|k| !expected.contains_key(*k)) {
            bail!(
                "{}: unexpected tensor {name} for this architecture",
                self.source
            );
        }
        let whole = PipelineSplit {
            num_layers: config.num_layers,
            stages: 1,
            chunks: 1,
            first_stage_layers: None,
            last_stage_layers: None,
        };
        let biases = rank_expert_biases(config, &whole, 0)?;
        for (name, _) in &biases {
            let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
            let bias = self.expert_biases.get(name).with_context(|| {
                format!(
                    "{}: missing expert bias {name} (the model has --moe-router-enable-expert-bias)",
                    self.source
                )
            })?;
            ensure!(
                bias.shape() == [experts],
                "{}: expert bias {name} has shape {:?}, the model has {experts} experts",
                self.source,
                bias.shape()
            );
        }
        if let Some(name) = self
            .expert_biases
            .keys()
            .find(|k| !biases.iter().any(|(name, _)| name == *k))
        {
            bail!(
                "{}: unexpected expert bias {name}: the model has no --moe-router-enable-expert-bias router there",
                self.source
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_models::{Activation, Normalization, PositionEmbeddingType};

    /// The shape rules and the tiny probe's names agree with a real model of each structure
    /// (an MoE layer's router, routed and shared experts included).
    #[test]
    fn shape_rules_match_the_model() {
        let base = TransformerConfig::gpt_345m();
        let small = TransformerConfig {
            num_layers: 2,
            hidden_size: 32,
            num_attention_heads: 4,
            num_query_groups: 4,
            kv_channels: 8,
            ffn_hidden_size: 48,
            max_position_embeddings: 16,
            vocab_size: 100,
            ..base
        };
        let llama = TransformerConfig {
            num_query_groups: 2,
            kv_channels: 12,
            position_embedding_type: PositionEmbeddingType::Rope,
            normalization: Normalization::RMSNorm,
            activation: Activation::Swiglu,
            add_bias_linear: false,
            add_qkv_bias: true,
            untie_embeddings_and_output_weights: true,
            ..small.clone()
        };
        let mixtral = TransformerConfig {
            add_qkv_bias: false,
            qk_layernorm: true,
            moe: Some(MoeConfig {
                num_experts: 3,
                ffn_hidden_size: 40,
                layer_pattern: vec![true; 2],
                topk: 2,
                score_function: megatron_models::layers::moe::config::ScoreFunction::Softmax,
                pre_softmax: false,
                topk_scaling_factor: None,
                router_dtype: None,
                load_balancing: megatron_models::layers::moe::config::LoadBalancing::AuxLoss,
                aux_loss_coeff: 0.0,
                z_loss_coeff: None,
                shared_expert_intermediate_size: Some(24),
                shared_expert_gate: true,
                token_dispatcher: Default::default(),
                grouped_gemm: false,
                capacity: None,
                expert_bias_update_rate: None,
            }),
            ..llama.clone()
        };
        for config in [small, llama, mixtral] {
            let options = ModelOptions {
                params_dtype: Kind::Float,
                device: Device::Cpu,
                recompute: Recompute::None,
                seed: 0,
                bias_dropout_fusion: true,
                rope_fusion: false,
            };
            let moe_layer = config.moe.is_some();
            let model = GptModel::new_chunk(
                TransformerConfig {
                    num_layers: 1,
                    moe: config.moe.clone().map(|moe| MoeConfig {
                        layer_pattern: vec![true],
                        ..moe
                    }),
                    ..config.clone()
                },
                options,
                &ParallelState::single(),
                ChunkSpec::whole(1),
            )
            .unwrap();
            let real: Vec<(String, Vec<i64>)> = model
                .named_parameters()
                .into_iter()
                .map(|p| (p.name, p.tensor.size()))
                .collect();
            let names = probe_parameter_names(&config, moe_layer).unwrap();
            assert_eq!(
                names,
                real.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()
            );
            for (name, shape) in real {
                assert_eq!(parameter_shape(&config, &name).unwrap(), shape, "{name}");
            }
        }
    }
}
