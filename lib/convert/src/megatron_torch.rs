//! Loading Megatron's own checkpoints: `--ckpt-format torch` (`mp_rank_XX[_YYY]/model_optim_rng.pt`,
//! any TP/PP, virtual stages, legacy nested or core flat names) and `torch_dist`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::layout::{rank_directories, rank_file};
use megatron_checkpoint::{TensorRef, TorchFile, Value};
use tch::Kind;

use super::distrib_optim::{dp_zero_state, param_groups_step, Bucketing, ChunkParams};
use super::lazy::{tensor_of, InputFile, LazyTensor};
use super::megatron_args::{gpt_config, params_dtype};
use super::sizes::{check_layers, megatron_vocabulary};
use super::state::{ModelState, OptimizerState, RankOptimizer, RunState};
use megatron_models::gpt::megatron_names::{core_name, layer_of};
use megatron_models::TransformerConfig;
use megatron_optim::excluded_from_weight_decay;
use megatron_store::{has_vocab_rows, tensor_split};

/// What a loader needs beyond the checkpoint.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// `--true-vocab-size` (or the size of `--vocab-file`).
    pub true_vocab_size: Option<i64>,
    /// Read the optimizer state too, where the checkpoint has one.
    pub optimizer: bool,
    /// `--make-vocab-size-divisible-by`: imports pad the vocabulary to a multiple of this (× TP)
    /// [default: Megatron checkpoints' own, 128 for HuggingFace's].
    pub make_vocab_size_divisible_by: Option<i64>,
}

/// Model tensors of one model chunk entry, flattened to dotted names in file order.
fn flatten<'a>(value: &'a Value, prefix: &str, out: &mut Vec<(String, &'a TensorRef)>) {
    if let Some(entries) = value.entries() {
        for (key, v) in entries {
            let key = match key {
                Value::Str(s) => s.clone(),
                other => other.describe(),
            };
            let name = if prefix.is_empty() {
                key
            } else {
                format!("{prefix}.{key}")
            };
            match v {
                Value::Tensor(t) => out.push((name, t)),
                other => flatten(other, &name, out),
            }
        }
    }
}

/// The `model` entries of a rank file: `model`, or `model0`, `model1`, … with virtual stages.
fn model_chunks(root: &Value, path: &Path) -> Result<Vec<Vec<(String, TensorRef)>>> {
    let mut chunks = Vec::new();
    if let Some(model) = root.get("model") {
        chunks.push(model);
    } else {
        while let Some(model) = root.get(&format!("model{}", chunks.len())) {
            chunks.push(model);
        }
    }
    ensure!(
        !chunks.is_empty(),
        "{}: no model state (saved with --no-save-model?)",
        path.display()
    );
    Ok(chunks
        .into_iter()
        .map(|chunk| {
            let mut out = Vec::new();
            flatten(chunk, "", &mut out);
            out.into_iter()
                .filter_map(|(name, t)| core_name(&name).map(|n| (n, t.clone())))
                .collect()
        })
        .collect())
}

pub(super) fn run_state(root: &Value) -> RunState {
    let args = root.get("args").cloned().unwrap_or(Value::None);
    let get = |key: &str| args.get(key).and_then(Value::as_i64).unwrap_or(0).max(0) as u64;
    RunState {
        iteration: root
            .get("iteration")
            .or_else(|| root.get("total_iters"))
            .and_then(Value::as_i64)
            .unwrap_or(0)
            .max(0) as u64,
        consumed_train_samples: get("consumed_train_samples"),
        consumed_valid_samples: get("consumed_valid_samples"),
        num_floating_point_operations_so_far: root
            .get("num_floating_point_operations_so_far")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        opt_param_scheduler: root
            .get("opt_param_scheduler")
            .or_else(|| root.get("lr_scheduler"))
            .map(Value::to_json),
        grad_scaler: root
            .get("optimizer")
            .and_then(|o| o.get("grad_scaler"))
            .map(Value::to_json),
        args: args.to_json(),
    }
}

pub(super) fn check_version(root: &Value, path: &Path) -> Result<()> {
    let version = root
        .get("checkpoint_version")
        .and_then(Value::as_f64)
        .unwrap_or(0.0);
    ensure!(
        version >= 2.0,
        "{}: checkpoint_version {version} stores QKV in a layout older than 2.0; load and re-save it with a Megatron of that era first",
        path.display()
    );
    Ok(())
}

/// Megatron's parameter groups of one rank: weight-decayed and not, each in model order, the
/// groups ordered by first appearance (as `_get_param_groups` builds them).
pub(super) fn param_groups(names: &[(String, Vec<usize>)]) -> Vec<Vec<usize>> {
    let mut order: Vec<bool> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, (name, shape)) in names.iter().enumerate() {
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let no_wd = excluded_from_weight_decay(name, &shape);
        match order.iter().position(|&g| g == no_wd) {
            Some(g) => groups[g].push(i),
            None => {
                order.push(no_wd);
                groups.push(vec![i]);
            }
        }
    }
    groups
}

/// The distributed optimizer's state of a rank (`distrib_optim.pt` beside its rank file), or
/// `None` where the rank has no such file.
fn rank_distributed_optimizer(
    file: &TorchFile,
    chunks: &ChunkParams,
    pipeline_rank: usize,
) -> Result<Option<RankOptimizer>> {
    let path = file.path().with_file_name("distrib_optim.pt");
    if !path.is_file() {
        return Ok(None);
    }
    let args = file.root.get("args").cloned().unwrap_or(Value::None);
    let step = file
        .root
        .get("optimizer")
        .and_then(param_groups_step)
        .with_context(|| {
            format!(
                "{}: the distributed optimizer's parameter groups carry no step",
                file.path().display()
            )
        })?;
    let state_file = TorchFile::open(&path)?;
    let input = InputFile::open(&path)?;
    dp_zero_state(
        &state_file,
        &input,
        &state_file.root,
        chunks,
        Bucketing::from_args(&args, pipeline_rank),
        step,
    )
    .map(Some)
}

fn rank_optimizer(
    file: &TorchFile,
    input: &Arc<InputFile>,
    params: &[(String, Vec<usize>)],
    weights: &HashMap<String, LazyTensor>,
) -> Result<Option<RankOptimizer>> {
    let path = file.path();
    let Some(optimizer) = file.root.get("optimizer") else {
        return Ok(None);
    };
    let (inner, fp32) = match optimizer.get("optimizer") {
        Some(inner) => (inner, optimizer.get("fp32_from_fp16_params")),
        None => (optimizer, None),
    };
    let (Some(state), Some(groups)) = (
        inner.get("state"),
        inner.get("param_groups").and_then(Value::items),
    ) else {
        bail!("{}: optimizer state without state/param_groups (a distributed optimizer's, whose distrib_optim.pt is missing beside it?)", path.display());
    };
    let ours = param_groups(params);
    ensure!(
        groups.len() == ours.len(),
        "{}: {} optimizer parameter groups, {} expected from the model",
        path.display(),
        groups.len(),
        ours.len()
    );
    let mut out = RankOptimizer::default();
    for (g, (group, members)) in groups.iter().zip(&ours).enumerate() {
        let indices = group
            .get("params")
            .and_then(Value::items)
            .context("param group without params")?;
        ensure!(
            indices.len() == members.len(),
            "{}: optimizer group {g} has {} parameters, the model {}",
            path.display(),
            indices.len(),
            members.len()
        );
        for (j, (index, &member)) in indices.iter().zip(members).enumerate() {
            let (name, shape) = &params[member];
            let entry = state
                .entries()
                .and_then(|e| e.iter().find(|(k, _)| k == index))
                .map(|(_, v)| v)
                .with_context(|| format!("{}: no optimizer state for {name}", path.display()))?;
            let moment = |key: &str| -> Result<LazyTensor> {
                match entry.get(key) {
                    Some(Value::Tensor(t)) => {
                        ensure!(
                            &t.shape == shape,
                            "{}: optimizer {key} of {name} has shape {:?}, the parameter {shape:?}",
                            path.display(),
                            t.shape
                        );
                        tensor_of(file, input, t)
                    }
                    _ => bail!("{}: optimizer state of {name} has no {key}", path.display()),
                }
            };
            out.exp_avg.insert(name.clone(), moment("exp_avg")?);
            out.exp_avg_sq.insert(name.clone(), moment("exp_avg_sq")?);
            out.step = match entry.get("step") {
                Some(Value::Tensor(t)) => tensor_of(file, input, t)?.read()?.double_value(&[]),
                Some(v) => v.as_f64().unwrap_or(0.0),
                None => 0.0,
            };
            let main = match fp32.and_then(Value::items) {
                Some(groups) => {
                    match groups.get(g).and_then(Value::items).and_then(|p| p.get(j)) {
                        Some(Value::Tensor(t)) => {
                            ensure!(&t.shape == shape, "{}: main parameter of {name} has shape {:?}, the parameter {shape:?}", path.display(), t.shape);
                            tensor_of(file, input, t)?
                        }
                        _ => bail!("{}: no fp32 main parameter for {name}", path.display()),
                    }
                }
                // A float32 run's main parameters are its weights.
                None if weights[name].kind() == Kind::Float => weights[name].clone(),
                None => weights[name].read()?.to_kind(Kind::Float).into(),
            };
            out.main.insert(name.clone(), main);
        }
    }
    Ok(Some(out))
}

/// Loads a `--ckpt-format torch` iteration directory.
pub fn load_megatron_torch(directory: &Path, options: &LoadOptions) -> Result<ModelState> {
    let ranks = rank_directories(directory)?;
    ensure!(
        !ranks.is_empty(),
        "{}: no mp_rank_* directories",
        directory.display()
    );
    let tp = ranks.iter().map(|r| r.tensor_rank).max().unwrap() + 1;
    let pp = ranks.iter().map(|r| r.pipeline_rank).max().unwrap() + 1;
    let mut files: BTreeMap<(usize, usize), TorchFile> = BTreeMap::new();
    let mut inputs: BTreeMap<(usize, usize), Arc<InputFile>> = BTreeMap::new();
    for t in 0..tp {
        for p in 0..pp {
            let rank = ranks
                .iter()
                .find(|r| r.tensor_rank == t && r.pipeline_rank == p)
                .with_context(|| {
                    format!(
                        "{}: missing shard {} of a TP={tp} PP={pp} checkpoint",
                        directory.display(),
                        megatron_store::rank_directory_name(t, p, pp)
                    )
                })?;
            let path = rank_file(rank)?;
            files.insert((t, p), TorchFile::open(&path)?);
            inputs.insert((t, p), InputFile::open(&path)?);
        }
    }
    let first = &files[&(0, 0)];
    check_version(&first.root, first.path())?;
    let args = first
        .root
        .get("args")
        .with_context(|| format!("{}: no args", first.path().display()))?;
    // Chunk c of stage p: its local layers, in Megatron's global order (chunk-major).
    let mut per_rank: BTreeMap<(usize, usize), Vec<Vec<(String, TensorRef)>>> = BTreeMap::new();
    for (&key, file) in &files {
        per_rank.insert(key, model_chunks(&file.root, file.path())?);
    }
    let chunks = per_rank[&(0, 0)].len();
    let mut offsets: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut next = 0;
    for c in 0..chunks {
        for p in 0..pp {
            offsets.insert((c, p), next);
            let layers = per_rank[&(0, p)]
                .get(c)
                .with_context(|| format!("pipeline stage {p} has fewer model chunks than stage 0"))?
                .iter()
                .filter_map(|(name, _)| layer_of(name).map(|(i, _)| i + 1))
                .max()
                .unwrap_or(0);
            next += layers;
        }
    }
    let origin = first.path().display().to_string();
    let embedding = "embedding.word_embeddings.weight";
    let rows = per_rank[&(0, 0)][0]
        .iter()
        .find(|(n, _)| n == embedding)
        .map(|(_, t)| t.shape[0] as i64 * tp as i64)
        .with_context(|| format!("{origin}: no {embedding} on the first stage"))?;
    let config = checkpoint_config(&origin, args, embedding, rows, options)?;
    check_layers(&origin, "args num_layers", config.num_layers, next)?;
    let tied = !config.untie_embeddings_and_output_weights;
    // Global names and shards, in the order of tensor-parallel rank.
    let mut shards: BTreeMap<String, Vec<LazyTensor>> = BTreeMap::new();
    let mut rank_params: BTreeMap<(usize, usize), Vec<Vec<(String, Vec<usize>)>>> = BTreeMap::new();
    for ((t, p), chunk_list) in &per_rank {
        let file = &files[&(*t, *p)];
        let mut params = Vec::new();
        for (c, tensors) in chunk_list.iter().enumerate() {
            let mut chunk_params = Vec::new();
            for (name, tensor) in tensors {
                let global = match layer_of(name) {
                    Some((i, leaf)) => format!("decoder.layers.{}.{leaf}", i + offsets[&(c, *p)]),
                    None => name.clone(),
                };
                chunk_params.push((global.clone(), tensor.shape.clone()));
                let is_head_copy = tied && global == "output_layer.weight";
                if is_head_copy {
                    continue;
                }
                let value = tensor_of(file, &inputs[&(*t, *p)], tensor)
                    .with_context(|| format!("{}: tensor {name}", file.path().display()))?;
                shards.entry(global).or_default().push(value);
            }
            params.push(chunk_params);
        }
        rank_params.insert((*t, *p), params);
    }
    let padded = config.padded_vocab_size(1);
    let mut weights = BTreeMap::new();
    let join = |name: &str, parts: &[LazyTensor]| -> Result<LazyTensor> {
        ensure!(
            parts.len() == tp,
            "{}: tensor {name} found in {} of {tp} tensor-parallel ranks",
            directory.display(),
            parts.len()
        );
        let joined = LazyTensor::joined(parts.to_vec(), tensor_split(name, &config))
            .with_context(|| format!("{}: tensor {name}", directory.display()))?;
        Ok(if has_vocab_rows(name) {
            joined.with_rows(padded)
        } else {
            joined
        })
    };
    for (name, parts) in &shards {
        weights.insert(name.clone(), join(name, parts)?);
    }
    let optimizer = if options.optimizer {
        let mut merged: BTreeMap<&str, BTreeMap<String, Vec<LazyTensor>>> = BTreeMap::new();
        let mut step = 0.0;
        let mut complete = true;
        for (key, params) in &rank_params {
            let file = &files[key];
            let state = match rank_distributed_optimizer(file, params, key.1)? {
                Some(state) => Some(state),
                None => {
                    // Pure float32 runs keep no separate main parameters: they are the model's own.
                    let mut weights_for_fp32 = HashMap::new();
                    if file
                        .root
                        .get("optimizer")
                        .and_then(|o| o.get("fp32_from_fp16_params"))
                        .is_none()
                    {
                        for (c, chunk) in per_rank[key].iter().enumerate() {
                            for (name, tensor) in chunk {
                                let global = match layer_of(name) {
                                    Some((i, leaf)) => format!(
                                        "decoder.layers.{}.{leaf}",
                                        i + offsets[&(c, key.1)]
                                    ),
                                    None => name.clone(),
                                };
                                weights_for_fp32
                                    .insert(global, tensor_of(file, &inputs[key], tensor)?);
                            }
                        }
                    }
                    rank_optimizer(file, &inputs[key], &params.concat(), &weights_for_fp32)?
                }
            };
            match state {
                None => {
                    complete = false;
                    break;
                }
                Some(state) => {
                    step = state.step;
                    for (kind, map) in [
                        ("main", state.main),
                        ("exp_avg", state.exp_avg),
                        ("exp_avg_sq", state.exp_avg_sq),
                    ] {
                        for (name, tensor) in map {
                            if tied && name == "output_layer.weight" {
                                continue;
                            }
                            merged
                                .entry(kind)
                                .or_default()
                                .entry(name)
                                .or_default()
                                .push(tensor);
                        }
                    }
                }
            }
        }
        if complete && !merged.is_empty() {
            let mut state = OptimizerState {
                step,
                ..Default::default()
            };
            for (kind, map) in merged {
                let target = match kind {
                    "main" => &mut state.main,
                    "exp_avg" => &mut state.exp_avg,
                    _ => &mut state.exp_avg_sq,
                };
                for (name, parts) in map {
                    target.insert(name.clone(), join(&name, &parts)?);
                }
            }
            Some(state)
        } else {
            None
        }
    } else {
        None
    };
    Ok(ModelState {
        config,
        params_dtype: params_dtype(args),
        weights,
        optimizer,
        run: run_state(&first.root),
        source_parallel: (tp, pp),
        source: format!("Megatron torch checkpoint {}", directory.display()),
    })
}

/// The architecture a Megatron checkpoint's `args` describe, its vocabulary checked against
/// `rows`, the rows of its word embeddings (`embedding`), and the padding flags in `options`.
pub(super) fn checkpoint_config(
    origin: &str,
    args: &Value,
    embedding: &str,
    rows: i64,
    options: &LoadOptions,
) -> Result<TransformerConfig> {
    let (vocab, multiple) = megatron_vocabulary(
        origin,
        args,
        embedding,
        rows,
        options.true_vocab_size,
        options.make_vocab_size_divisible_by,
    )?;
    Ok(TransformerConfig {
        make_vocab_size_divisible_by: multiple,
        ..gpt_config(args, vocab).with_context(|| origin.to_string())?
    })
}
