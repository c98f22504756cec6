//! Loading Megatron's own checkpoints: `--ckpt-format torch` (`mp_rank_XX[_YYY]/model_optim_rng.pt`,
//! any TP/PP, virtual stages, legacy nested or core flat names) and `torch_dist`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use megatron_checkpoint::layout::{rank_directories, rank_file};
use megatron_checkpoint::{TensorRef, TorchFile, Value};
use tch::Kind;

use super::distrib_optim::{
    dp_zero_state, expert_params, param_groups_step, Bucketing, ChunkParams,
};
use super::lazy::{tensor_of, InputFile, LazyTensor};
use super::megatron_args::{gpt_config, params_dtype};
use super::sizes::{check_layers, megatron_vocabulary};
use super::state::{is_expert_bias, ModelState, OptimizerState, RankOptimizer, RunState};
use megatron_models::gpt::megatron_names::{core_name, expert_moved, expert_of, layer_of};
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
/// `None` where the rank has no such file. An expert-parallel run's chained optimizer saves a
/// list: the dense parameters' buffers (held by expert-parallel rank 0 only: the other ranks'
/// copies are the same), then the routed experts' own buffers.
fn rank_distributed_optimizer(
    file: &TorchFile,
    chunks: &ChunkParams,
    key: RankKey,
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
    let bucketing = Bucketing::from_args(&args, key.1);
    let read = |state: &Value, chunks: &ChunkParams, bucketing: Bucketing| {
        dp_zero_state(&state_file, &input, state, chunks, bucketing, step)
    };
    let (dense, experts) = match &state_file.root {
        Value::List(states) if states.len() == 2 => (&states[0], Some(&states[1])),
        Value::List(states) if states.len() == 1 => (&states[0], None),
        Value::List(states) => bail!(
            "{}: {} optimizer states, one or two (dense, experts) expected",
            path.display(),
            states.len()
        ),
        state => (state, None),
    };
    let Some(experts) = experts else {
        return read(dense, chunks, bucketing).map(Some);
    };
    let expert_data_parallel = (int_arg(&args, "data_parallel_size")
        / int_arg(&args, "expert_model_parallel_size"))
    .max(1) as usize;
    let flag = |key: &str| args.get(key).and_then(Value::as_bool).unwrap_or(false);
    let expert_bucketing = Bucketing::new(
        flag,
        args.get("ddp_bucket_size").and_then(Value::as_i64),
        expert_data_parallel,
        int_arg(&args, "pipeline_model_parallel_size"),
        key.1,
    );
    let mut state = read(experts, &expert_params(chunks, true), expert_bucketing)
        .with_context(|| format!("{}: the routed experts' buffers", path.display()))?;
    if key.2 == 0 {
        let dense = read(dense, &expert_params(chunks, false), bucketing)
            .with_context(|| format!("{}: the dense parameters' buffers", path.display()))?;
        state.main.extend(dense.main);
        state.exp_avg.extend(dense.exp_avg);
        state.exp_avg_sq.extend(dense.exp_avg_sq);
    }
    Ok(Some(state))
}

fn int_arg(args: &Value, key: &str) -> i64 {
    args.get(key).and_then(Value::as_i64).unwrap_or(1).max(1)
}

/// The plain (non-distributed) optimizer's state of a rank file; `params` are the rank's
/// parameters (global names) in model order. An expert-parallel run's chained optimizer saves a
/// list: the dense parameters' state (read from expert rank 0, `key.2`), then the routed
/// experts'.
fn rank_optimizer(
    file: &TorchFile,
    input: &Arc<InputFile>,
    params: &[(String, Vec<usize>)],
    weights: &HashMap<String, LazyTensor>,
    key: RankKey,
) -> Result<Option<RankOptimizer>> {
    let optimizers = match file.root.get("optimizer") {
        None => return Ok(None),
        Some(Value::List(optimizers)) if optimizers.len() == 1 => {
            vec![(&optimizers[0], params.to_vec())]
        }
        Some(Value::List(optimizers)) if optimizers.len() == 2 => {
            let (experts, dense): (Vec<_>, Vec<_>) = params
                .iter()
                .cloned()
                .partition(|(name, _)| expert_of(name).is_some());
            let mut parts = vec![(&optimizers[1], experts)];
            if key.2 == 0 {
                parts.push((&optimizers[0], dense));
            }
            parts
        }
        Some(Value::List(optimizers)) => bail!(
            "{}: {} optimizer states, one or two (dense, experts) expected",
            file.path().display(),
            optimizers.len()
        ),
        Some(optimizer) => vec![(optimizer, params.to_vec())],
    };
    let mut out = RankOptimizer::default();
    for (optimizer, params) in optimizers {
        let part = adam_state(file, input, optimizer, &params, weights)?;
        out.step = part.step;
        out.main.extend(part.main);
        out.exp_avg.extend(part.exp_avg);
        out.exp_avg_sq.extend(part.exp_avg_sq);
    }
    Ok(Some(out))
}

/// One optimizer's `state_dict` (torch Adam's, wrapped with `fp32_from_fp16_params` in half
/// precision) over `params`.
fn adam_state(
    file: &TorchFile,
    input: &Arc<InputFile>,
    optimizer: &Value,
    params: &[(String, Vec<usize>)],
    weights: &HashMap<String, LazyTensor>,
) -> Result<RankOptimizer> {
    let path = file.path();
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
    Ok(out)
}

/// A rank file's place: (tensor, pipeline, expert) parallel rank.
type RankKey = (usize, usize, usize);

type ChunkParamsOwned = Vec<Vec<(String, Vec<usize>)>>;

/// The rank directories of a torch checkpoint opened, keyed by their place; a two-number
/// `mp_rank_TT_NNN` read as an expert-parallel rank where the args say so.
fn open_ranks(directory: &Path) -> Result<BTreeMap<RankKey, (TorchFile, Arc<InputFile>)>> {
    let mut ranks = rank_directories(directory)?;
    ensure!(
        !ranks.is_empty(),
        "{}: no mp_rank_* directories",
        directory.display()
    );
    let mut files = BTreeMap::new();
    for rank in &ranks {
        let path = rank_file(rank)?;
        files.insert(
            (rank.tensor_rank, rank.pipeline_rank, rank.expert_rank),
            (TorchFile::open(&path)?, InputFile::open(&path)?),
        );
    }
    let first = &files.values().next().unwrap().0;
    let args = first.root.get("args").cloned().unwrap_or(Value::None);
    let experts = int_arg(&args, "expert_model_parallel_size") as usize;
    if experts > 1 && int_arg(&args, "pipeline_model_parallel_size") == 1 {
        let mut keyed = BTreeMap::new();
        for (rank, (_, file)) in ranks.iter_mut().zip(std::mem::take(&mut files)) {
            rank.second_number_as_expert_rank();
            keyed.insert(
                (rank.tensor_rank, rank.pipeline_rank, rank.expert_rank),
                file,
            );
        }
        files = keyed;
    }
    let found = files.keys().map(|k| k.2).max().unwrap() + 1;
    ensure!(
        found == experts,
        "{}: {found} expert-parallel rank(s) of mp_rank_* directories, the args' expert_model_parallel_size is {experts}",
        directory.display()
    );
    let tp = files.keys().map(|k| k.0).max().unwrap() + 1;
    let pp = files.keys().map(|k| k.1).max().unwrap() + 1;
    for t in 0..tp {
        for p in 0..pp {
            for e in 0..experts {
                ensure!(
                    files.contains_key(&(t, p, e)),
                    "{}: missing shard {}{} of a TP={tp} PP={pp} EP={experts} checkpoint",
                    directory.display(),
                    megatron_store::rank_directory_name(t, p, pp),
                    if experts > 1 {
                        format!("_{e:03}")
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
    Ok(files)
}

/// Loads a `--ckpt-format torch` iteration directory (expert-parallel ones included: each
/// `mp_rank_*_EEE` holds its own routed experts, numbered from 0, and a copy of the rest).
pub fn load_megatron_torch(directory: &Path, options: &LoadOptions) -> Result<ModelState> {
    let opened = open_ranks(directory)?;
    let tp = opened.keys().map(|k| k.0).max().unwrap() + 1;
    let pp = opened.keys().map(|k| k.1).max().unwrap() + 1;
    let ep = opened.keys().map(|k| k.2).max().unwrap() + 1;
    let mut files: BTreeMap<RankKey, TorchFile> = BTreeMap::new();
    let mut inputs: BTreeMap<RankKey, Arc<InputFile>> = BTreeMap::new();
    for (key, (file, input)) in opened {
        files.insert(key, file);
        inputs.insert(key, input);
    }
    let first = &files[&(0, 0, 0)];
    check_version(&first.root, first.path())?;
    let args = first
        .root
        .get("args")
        .with_context(|| format!("{}: no args", first.path().display()))?;
    // Chunk c of stage p: its local layers, in Megatron's global order (chunk-major).
    let mut per_rank: BTreeMap<RankKey, Vec<Vec<(String, TensorRef)>>> = BTreeMap::new();
    for (&key, file) in &files {
        per_rank.insert(key, model_chunks(&file.root, file.path())?);
    }
    let chunks = per_rank[&(0, 0, 0)].len();
    let mut offsets: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    let mut next = 0;
    for c in 0..chunks {
        for p in 0..pp {
            offsets.insert((c, p), next);
            let layers = per_rank[&(0, p, 0)]
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
    let rows = per_rank[&(0, 0, 0)][0]
        .iter()
        .find(|(n, _)| n == embedding)
        .map(|(_, t)| t.shape[0] as i64 * tp as i64)
        .with_context(|| format!("{origin}: no {embedding} on the first stage"))?;
    let config = checkpoint_config(&origin, args, embedding, rows, options)?;
    check_layers(&origin, "args num_layers", config.num_layers, next)?;
    let local_experts = match &config.moe {
        Some(moe) => {
            ensure!(
                tp == 1 || ep == 1,
                "{}: Mixture-of-Experts checkpoints with both tensor (TP={tp}) and expert (EP={ep}) parallelism are not imported yet",
                directory.display()
            );
            ensure!(
                moe.num_experts % ep as i64 == 0,
                "{origin}: the args' num_experts {} is not divisible by the {ep} expert-parallel ranks",
                moe.num_experts
            );
            moe.num_experts as usize / ep
        }
        None => 0,
    };
    let tied = !config.untie_embeddings_and_output_weights;
    // The global name of a rank's tensor: its layer counted over the pipeline stages and model
    // chunks, its routed expert over the expert-parallel ranks. Tensors other than routed
    // experts are the same on every expert-parallel rank: rank 0's are read.
    let global_name = |key: RankKey, chunk: usize, name: &str| -> Option<String> {
        let layered = match layer_of(name) {
            Some((i, leaf)) => format!("decoder.layers.{}.{leaf}", i + offsets[&(chunk, key.1)]),
            None => name.to_string(),
        };
        match expert_of(&layered) {
            Some(_) => Some(expert_moved(&layered, key.2 * local_experts)),
            None => (key.2 == 0).then_some(layered),
        }
    };
    // Global names and shards, in the order of tensor-parallel rank.
    let mut shards: BTreeMap<String, Vec<LazyTensor>> = BTreeMap::new();
    let mut expert_biases = BTreeMap::new();
    let mut rank_params: BTreeMap<RankKey, ChunkParamsOwned> = BTreeMap::new();
    for (key, chunk_list) in &per_rank {
        let file = &files[key];
        let mut params = Vec::new();
        for (c, tensors) in chunk_list.iter().enumerate() {
            let mut chunk_params = Vec::new();
            for (name, tensor) in tensors {
                let Some(global) = global_name(*key, c, name) else {
                    continue;
                };
                // A buffer, not a parameter: every tensor rank holds the whole of it.
                if is_expert_bias(&global) {
                    if key.0 == 0 {
                        let value = tensor_of(file, &inputs[key], tensor)
                            .with_context(|| format!("{}: tensor {name}", file.path().display()))?;
                        expert_biases.insert(global, value);
                    }
                    continue;
                }
                chunk_params.push((global.clone(), tensor.shape.clone()));
                let is_head_copy = tied && global == "output_layer.weight";
                if is_head_copy {
                    continue;
                }
                let value = tensor_of(file, &inputs[key], tensor)
                    .with_context(|| format!("{}: tensor {name}", file.path().display()))?;
                shards.entry(global).or_default().push(value);
            }
            params.push(chunk_params);
        }
        rank_params.insert(*key, params);
    }
    check_experts(&origin, &config, shards.keys().map(String::as_str))?;
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
            let state = match rank_distributed_optimizer(file, params, *key)? {
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
                                if let Some(global) = global_name(*key, c, name) {
                                    weights_for_fp32
                                        .insert(global, tensor_of(file, &inputs[key], tensor)?);
                                }
                            }
                        }
                    }
                    rank_optimizer(
                        file,
                        &inputs[key],
                        &params.concat(),
                        &weights_for_fp32,
                        *key,
                    )?
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
        expert_biases,
        optimizer,
        run: run_state(&first.root),
        source_parallel: (tp, pp),
        source: format!("Megatron torch checkpoint {}", directory.display()),
    })
}

/// Checks that every MoE layer of `config` has exactly its `num_experts` routed experts among
/// the tensor `names` of a checkpoint (`origin`), and no other layer any.
pub(super) fn check_experts<'a>(
    origin: &str,
    config: &TransformerConfig,
    names: impl IntoIterator<Item = &'a str>,
) -> Result<()> {
    let mut found: BTreeMap<usize, std::collections::BTreeSet<usize>> = BTreeMap::new();
    for name in names {
        let Some((expert, _, _)) = expert_of(name) else {
            continue;
        };
        let layer = layer_of(name).map(|(i, _)| i).unwrap_or(0);
        match &config.moe {
            Some(moe) if moe.is_moe_layer(layer) => ensure!(
                (expert as i64) < moe.num_experts,
                "{origin}: tensor {name} is expert {expert}, but the args' num_experts is {}",
                moe.num_experts
            ),
            _ => bail!(
                "{origin}: tensor {name} is a routed expert, but the args make layer {layer} a dense one"
            ),
        }
        found.entry(layer).or_default().insert(expert);
    }
    if let Some(moe) = &config.moe {
        for layer in (0..config.num_layers).filter(|&i| moe.is_moe_layer(i)) {
            let count = found.get(&layer).map_or(0, |e| e.len());
            ensure!(
                count as i64 == moe.num_experts,
                "{origin}: layer {layer} has {count} routed experts (decoder.layers.{layer}.mlp.experts.local_experts.*), the args' num_experts is {}",
                moe.num_experts
            );
        }
    }
    Ok(())
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
