//! Our own checkpoints (safetensors + `metadata.json`) in and out of a [`ModelState`], through
//! the checkpoint module's writer and reader, in any TP/PP (interleaved too) layout, with the
//! optimizer's float32 main parameters and Adam moments laid out in each rank's flat buffer
//! exactly as `MixedPrecisionOptimizer` keeps them.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::state::{ModelState, OptimizerState, RunState};
use crate::checkpoint::{
    begin_save, finish_save, has_vocab_rows, join_shards, merge_model_parallel_ranks,
    optimizer_file, rank_directory_name, split_for_tensor_parallel, staging_directory, take_shard,
    tensor_split, write_rank_file, CheckpointDirectory, CheckpointMetadata, CHECKPOINT_FORMAT,
    MODEL_FILE,
};
use crate::model::ParamAttributes;
use crate::model::{ChunkSpec, GptConfig, GptModel, ModelOptions, PipelineSplit, Recompute};
use crate::optim::{BufferLayout, ParamShape};
use crate::parallel::ParallelState;

/// The model-parallel layout to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetLayout {
    pub tensor: usize,
    pub pipeline: usize,
    /// Model chunks per pipeline stage (1 without interleaving).
    pub virtual_stages: usize,
}

/// The order of one transformer layer's parameters in `GptModel::named_parameters` (read from
/// a one-layer model of the same architecture, so it follows the model's code).
fn layer_parameter_order(config: &GptConfig) -> Result<Vec<String>> {
    let probe = GptConfig {
        num_layers: 1,
        vocab_size: 1,
        make_vocab_size_divisible_by: 1,
        ..config.clone()
    };
    let options = ModelOptions {
        params_dtype: Kind::BFloat16,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 0,
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
        .filter_map(|p| p.name.strip_prefix("decoder.layers.0.").map(str::to_string))
        .collect())
}

/// `(chunk-local name, global name)` of every parameter of chunk `spec`, in parameter order.
fn chunk_parameters(
    config: &GptConfig,
    spec: &ChunkSpec,
    layer_order: &[String],
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let same = |name: &str| (name.to_string(), name.to_string());
    if spec.pre_process {
        out.push(same("embedding.word_embeddings.weight"));
        if config.position_embedding_type == crate::model::PositionEmbeddingType::LearnedAbsolute {
            out.push(same("embedding.position_embeddings.weight"));
        }
    }
    for (local, global) in spec.layers.clone().enumerate() {
        for leaf in layer_order {
            out.push((
                format!("decoder.layers.{local}.{leaf}"),
                format!("decoder.layers.{global}.{leaf}"),
            ));
        }
    }
    if spec.post_process {
        for leaf in layer_order
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

/// Every rank's `(rank file name, global name)` parameters in optimizer order.
fn rank_parameters(
    config: &GptConfig,
    split: &PipelineSplit,
    stage: usize,
    layer_order: &[String],
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

/// Writes one rank's model file and, with `optimizer` (the Adam step and this rank's shards of
/// the main parameters and both moments), its flat optimizer buffer laid out as
/// `MixedPrecisionOptimizer` keeps it (one data-parallel rank). `params` are the rank's
/// `(file name, global name)` parameters in model order; `shard` holds them by global name.
pub(crate) fn write_rank(
    staging: &Path,
    rank_dir: &str,
    params: &[(String, String)],
    shard: &HashMap<String, Tensor>,
    optimizer: Option<(f64, &[HashMap<String, Tensor>; 3])>,
    kind: Kind,
    source: &str,
) -> Result<()> {
    let mut tensors = Vec::with_capacity(params.len());
    for (local, global) in params {
        let tensor = shard
            .get(global)
            .with_context(|| format!("{source}: no tensor {global} for this architecture"))?;
        tensors.push((local.clone(), tensor.to_kind(kind)));
    }
    write_rank_file(staging, rank_dir, MODEL_FILE, &tensors)?;
    let Some((step, shards)) = optimizer else {
        return Ok(());
    };
    let shapes: Vec<(String, Vec<i64>)> =
        tensors.iter().map(|(n, t)| (n.clone(), t.size())).collect();
    let layout = flat_layout(&shapes);
    let flat = |map: &HashMap<String, Tensor>| -> Result<Tensor> {
        let buffer = Tensor::zeros([layout.len as i64], (Kind::Float, Device::Cpu));
        for (slot, (_, global)) in layout.slots.iter().zip(params.iter().rev()) {
            let value = map
                .get(global)
                .with_context(|| format!("{source}: no optimizer state for {global}"))?;
            buffer
                .narrow(0, slot.range.start as i64, slot.range.len() as i64)
                .copy_(&value.to_kind(Kind::Float).reshape([-1]));
        }
        Ok(buffer)
    };
    let file = vec![
        ("main".to_string(), flat(&shards[0])?),
        ("exp_avg".to_string(), flat(&shards[1])?),
        ("exp_avg_sq".to_string(), flat(&shards[2])?),
        ("step".to_string(), Tensor::from(step as f32)),
    ];
    write_rank_file(staging, rank_dir, &optimizer_file(None), &file)
}

/// Writes `state` as our checkpoint under `root` (which must not hold another checkpoint) in
/// `target`'s layout.
pub fn save_megatron_rs(state: &ModelState, root: &Path, target: TargetLayout) -> Result<()> {
    let config = &state.config;
    config.validate(target.tensor as i64)?;
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: target.pipeline,
        chunks: target.virtual_stages,
        first_stage_layers: None,
        last_stage_layers: None,
    };
    let layer_order = layer_parameter_order(config)?;
    let kind = super::state::kind_named(&state.params_dtype)?;
    let iteration = state.run.iteration;
    begin_save(root, iteration)?;
    let staging = staging_directory(root, iteration);
    let weights: HashMap<String, Tensor> = state
        .weights
        .iter()
        .map(|(k, v)| (k.clone(), v.shallow_clone()))
        .collect();
    for t in 0..target.tensor {
        let shard = split_for_tensor_parallel(&weights, config, t, target.tensor);
        let optimizer_shards = state.optimizer.as_ref().map(|o| {
            [&o.main, &o.exp_avg, &o.exp_avg_sq].map(|map| {
                let map: HashMap<String, Tensor> = map
                    .iter()
                    .map(|(k, v)| (k.clone(), v.shallow_clone()))
                    .collect();
                split_for_tensor_parallel(&map, config, t, target.tensor)
            })
        });
        for stage in 0..target.pipeline {
            let params = rank_parameters(config, &split, stage, &layer_order)?;
            let rank_dir = rank_directory_name(t, stage, target.pipeline);
            let optimizer = state.optimizer.as_ref().zip(optimizer_shards.as_ref());
            write_rank(
                &staging,
                &rank_dir,
                &params,
                &shard,
                optimizer.map(|(o, shards)| (o.step, shards)),
                kind,
                &state.source,
            )?;
        }
    }
    let metadata = CheckpointMetadata {
        format: CHECKPOINT_FORMAT.to_string(),
        checkpoint_version: 3.0,
        iteration,
        model_type: "GPT".to_string(),
        model: serde_json::to_value(config)?,
        params_dtype: state.params_dtype.clone(),
        tensor_model_parallel_size: target.tensor,
        pipeline_model_parallel_size: target.pipeline,
        virtual_pipeline_stages: target.virtual_stages,
        decoder_first_pipeline_num_layers: None,
        decoder_last_pipeline_num_layers: None,
        data_parallel_size: 1,
        distributed_optimizer: false,
        consumed_train_samples: state.run.consumed_train_samples,
        consumed_valid_samples: state.run.consumed_valid_samples,
        num_floating_point_operations_so_far: state.run.num_floating_point_operations_so_far,
        opt_param_scheduler: state.run.opt_param_scheduler.clone(),
        grad_scaler: state.run.grad_scaler.clone(),
        optimizer: state.optimizer.as_ref().map(|_| "adam".to_string()),
        has_rng_state: false,
        args: state.run.args.clone(),
    };
    finish_save(root, &metadata)?;
    Ok(())
}

/// Reads our checkpoint `checkpoint` (any layout) into a [`ModelState`]; with `optimizer`, the
/// float32 main parameters and Adam moments too.
pub fn load_megatron_rs(checkpoint: &CheckpointDirectory, optimizer: bool) -> Result<ModelState> {
    let metadata = &checkpoint.metadata;
    if metadata.model_type == "T5" {
        bail!(
            "{}: a T5 checkpoint; convert it with --model-type T5",
            checkpoint.directory.display()
        );
    }
    if metadata.model_type != "GPT" {
        bail!(
            "{}: converting {} checkpoints is not supported",
            checkpoint.directory.display(),
            metadata.model_type
        );
    }
    let config: GptConfig = serde_json::from_value(metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
    let weights: BTreeMap<String, Tensor> = merge_model_parallel_ranks(checkpoint, Device::Cpu)?
        .into_iter()
        .collect();
    let optimizer = match (optimizer, metadata.optimizer.as_deref()) {
        (true, Some("adam")) => {
            let metadata = &checkpoint.metadata;
            let split = PipelineSplit {
                num_layers: config.num_layers,
                stages: metadata.pipeline_model_parallel_size,
                chunks: metadata.virtual_pipeline_stages.max(1),
                first_stage_layers: metadata.decoder_first_pipeline_num_layers,
                last_stage_layers: metadata.decoder_last_pipeline_num_layers,
            };
            let layer_order = layer_parameter_order(&config)?;
            Some(load_optimizer(checkpoint, &config, &|stage| {
                rank_parameters(&config, &split, stage, &layer_order)
            })?)
        }
        _ => None,
    };
    Ok(ModelState {
        config,
        params_dtype: metadata.params_dtype.clone(),
        weights,
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

/// The per-parameter optimizer state of `checkpoint` (any TP/PP layout, distributed-optimizer
/// shards included), unsplit. `rank_params(stage)` lists a pipeline stage's `(file name,
/// global name)` parameters in model order; `config` is the trunk's (tensor splits, vocabulary).
pub(crate) fn load_optimizer(
    checkpoint: &CheckpointDirectory,
    config: &GptConfig,
    rank_params: &dyn Fn(usize) -> Result<Vec<(String, String)>>,
) -> Result<OptimizerState> {
    let metadata = &checkpoint.metadata;
    let sharded = metadata.distributed_optimizer && metadata.data_parallel_size > 1;
    let tied = !config.untie_embeddings_and_output_weights;
    let (tp, pp) = (
        metadata.tensor_model_parallel_size,
        metadata.pipeline_model_parallel_size,
    );
    let mut shards: [BTreeMap<String, Vec<Tensor>>; 3] = Default::default();
    let mut step = 0.0;
    for t in 0..tp {
        for stage in 0..pp {
            let rank_dir = rank_directory_name(t, stage, pp);
            let params = rank_params(stage)?;
            let model = checkpoint
                .read(&rank_dir, MODEL_FILE, Device::Cpu)?
                .with_context(|| {
                    format!(
                        "{}/{rank_dir}: no {MODEL_FILE}",
                        checkpoint.directory.display()
                    )
                })?;
            let mut shapes = Vec::with_capacity(params.len());
            for (local, _) in &params {
                let tensor = model.get(local).with_context(|| {
                    format!(
                        "{}/{rank_dir}: no tensor {local}",
                        checkpoint.directory.display()
                    )
                })?;
                shapes.push((local.clone(), tensor.size()));
            }
            let ranks = if sharded {
                metadata.data_parallel_size
            } else {
                1
            };
            let param_shapes: Vec<ParamShape> = shapes
                .iter()
                .map(|(n, s)| ParamShape {
                    name: n,
                    shape: s.clone(),
                    attributes: ParamAttributes::default(),
                })
                .collect();
            // pretrain_gpt's --ddp-bucket-size default: max(40M, 1M × data-parallel size).
            let bucket = metadata
                .args
                .get("ddp_bucket_size")
                .and_then(|v| v.as_u64())
                .map_or(
                    crate::optim::DEFAULT_BUCKET_SIZE.max(1_000_000 * ranks),
                    |v| v as usize,
                );
            let layout = if sharded {
                BufferLayout::new(&param_shapes, bucket, 0, ranks, true)
            } else {
                flat_layout(&shapes)
            };
            let mut flat: [Option<Tensor>; 3] = Default::default();
            for d in 0..ranks {
                let file = optimizer_file(sharded.then_some(d));
                let state = checkpoint
                    .read(&rank_dir, &file, Device::Cpu)?
                    .with_context(|| {
                        format!(
                            "{}/{rank_dir}: no {file} (saved with --no-save-optim?)",
                            checkpoint.directory.display()
                        )
                    })?;
                if let Some(s) = state.get("step") {
                    step = s.double_value(&[]);
                }
                let rank_layout =
                    sharded.then(|| BufferLayout::new(&param_shapes, bucket, d, ranks, true));
                for (i, key) in ["main", "exp_avg", "exp_avg_sq"].iter().enumerate() {
                    let part = state.get(*key).with_context(|| {
                        format!(
                            "{}/{rank_dir}/{file}: no tensor {key}",
                            checkpoint.directory.display()
                        )
                    })?;
                    match &rank_layout {
                        None => flat[i] = Some(part.shallow_clone()),
                        Some(rank_layout) => {
                            ensure!(
                                part.size()[0] as usize == rank_layout.shard_len,
                                "{}/{rank_dir}/{file}: {key} holds {} elements, the layout {}",
                                checkpoint.directory.display(),
                                part.size()[0],
                                rank_layout.shard_len
                            );
                            let full = flat[i].get_or_insert_with(|| {
                                Tensor::zeros([layout.len as i64], (Kind::Float, Device::Cpu))
                            });
                            for segment in &rank_layout.segments {
                                full.narrow(
                                    0,
                                    segment.buffer.start as i64,
                                    segment.buffer.len() as i64,
                                )
                                .copy_(&part.narrow(
                                    0,
                                    segment.shard.start as i64,
                                    segment.shard.len() as i64,
                                ));
                            }
                        }
                    }
                }
            }
            for (i, buffer) in flat.iter().enumerate() {
                let buffer = buffer.as_ref().expect("read above");
                for slot in &layout.slots {
                    let global = &params
                        .iter()
                        .find(|(local, _)| *local == slot.name)
                        .expect("listed")
                        .1;
                    if tied && slot.name.ends_with("output_layer.weight") {
                        continue;
                    }
                    ensure!(
                        slot.range.end <= buffer.size()[0] as usize,
                        "{}/{rank_dir}: the optimizer buffer holds {} elements, the model needs {}",
                        checkpoint.directory.display(),
                        buffer.size()[0],
                        layout.len
                    );
                    let value = buffer
                        .narrow(0, slot.range.start as i64, slot.range.len() as i64)
                        .view(slot.shape.as_slice());
                    shards[i].entry(global.clone()).or_default().push(value);
                }
            }
        }
    }
    let padded = config.padded_vocab_size(1);
    let mut out = OptimizerState {
        step,
        ..Default::default()
    };
    for (i, map) in shards.into_iter().enumerate() {
        let target = match i {
            0 => &mut out.main,
            1 => &mut out.exp_avg,
            _ => &mut out.exp_avg_sq,
        };
        for (name, parts) in map {
            ensure!(
                parts.len() == tp,
                "optimizer state of {name} found in {} of {tp} tensor-parallel ranks",
                parts.len()
            );
            let mut joined = join_shards(&parts, tensor_split(&name, config));
            if has_vocab_rows(&name) {
                joined = joined.narrow(0, 0, padded);
            }
            target.insert(name, joined);
        }
    }
    Ok(out)
}

/// Cuts `tensor` (unsplit) for tensor-parallel rank `rank` of `size`.
pub fn shard_of(
    name: &str,
    tensor: &Tensor,
    config: &GptConfig,
    rank: usize,
    size: usize,
) -> Tensor {
    take_shard(tensor, tensor_split(name, config), rank, size)
}

impl ModelState {
    /// Checks every weight against the architecture — each tensor the model has, with its
    /// shape, and nothing else — so a corrupt or foreign input fails here, naming the tensor,
    /// instead of producing a checkpoint that cannot load.
    pub fn validate(&self) -> Result<()> {
        let config = &self.config;
        let probe = GptConfig {
            num_layers: 1,
            ..config.clone()
        };
        let options = ModelOptions {
            params_dtype: Kind::BFloat16,
            device: Device::Cpu,
            recompute: Recompute::None,
            seed: 0,
        };
        let model = GptModel::new_chunk(
            probe,
            options,
            &ParallelState::single(),
            ChunkSpec::whole(1),
        )?;
        let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for parameter in model.named_parameters() {
            let shape = parameter.tensor.size();
            match parameter.name.strip_prefix("decoder.layers.0.") {
                Some(leaf) => {
                    for layer in 0..config.num_layers {
                        expected.insert(format!("decoder.layers.{layer}.{leaf}"), shape.clone());
                    }
                }
                None => {
                    expected.insert(parameter.name, shape);
                }
            }
        }
        for (name, shape) in &expected {
            let tensor = self
                .weights
                .get(name)
                .with_context(|| format!("{}: missing tensor {name}", self.source))?;
            ensure!(
                &tensor.size() == shape,
                "{}: tensor {name} has shape {:?}, the architecture needs {shape:?}",
                self.source,
                tensor.size()
            );
        }
        if let Some(name) = self.weights.keys().find(|k| !expected.contains_key(*k)) {
            bail!(
                "{}: unexpected tensor {name} for this architecture",
                self.source
            );
        }
        Ok(())
    }
}
