//! A training run's state to and from checkpoints, every rank writing and reading its part.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::async_save;
use super::expert_bias::{expert_bias_tensors, load_expert_biases};
use super::loss_scale::{LossScaler, LossScalerState};
use super::lr_schedule::{OptimizerParamScheduler, SchedulerLoadPolicy, SchedulerState};
use megatron_data::blend::TrainedOn;
use megatron_kernels::rng::{
    model_parallel_rng_state, set_model_parallel_rng_state, GeneratorState,
};
use megatron_models::{ModelChunk, PipelineSplit};
use megatron_optim::MixedPrecisionOptimizer;
use megatron_parallel::ParallelState;
use megatron_store::{
    abandon_save, begin_save, find_checkpoint, finish_save, iteration_directory, optimizer_file,
    rank_directory_name, saved_iterations, write_rank_file, CheckpointDirectory,
    CheckpointMetadata, CHECKPOINT_FORMAT, EXPERT_BIAS_FILE, METADATA_FILE, MODEL_FILE, RNG_FILE,
};

/// The per-rank file of the fp8 scaling state (see [`fp8_tensors`]).
const FP8_FILE: &str = "fp8_state.safetensors";

/// Megatron's current `checkpoint_version` (per-head QKV layout).
const CHECKPOINT_VERSION: f64 = 3.0;

/// Counters that move with training and are checkpointed.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Progress {
    pub iteration: u64,
    pub consumed_train_samples: u64,
    pub consumed_valid_samples: u64,
    pub floating_point_operations: f64,
}

pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// This rank's directory: `mp_rank_TT` or `mp_rank_TT_PPP`.
fn rank_directory(parallel: &ParallelState) -> String {
    let c = parallel.coordinates();
    rank_directory_name(c.tensor, c.pipeline, parallel.layout.pipeline)
}

/// With virtual pipeline stages the chunks' tensors are prefixed `model0.`, `model1.`, …,
/// as Megatron keys them.
fn chunk_prefix(chunk: usize, chunks: usize) -> String {
    if chunks == 1 {
        String::new()
    } else {
        format!("model{chunk}.")
    }
}

/// Every tensor of this rank's model chunks under its checkpoint name.
pub fn model_tensors<C: ModelChunk>(chunks: &[C]) -> Vec<(String, Tensor)> {
    chunks
        .iter()
        .enumerate()
        .flat_map(|(c, chunk)| {
            let prefix = chunk_prefix(c, chunks.len());
            chunk
                .named_parameters()
                .into_iter()
                .map(move |p| (format!("{prefix}{}", p.name), p.tensor.detach()))
        })
        .collect()
}

/// The delayed-scaling state of this rank's fp8 linears (`--fp8-format`), named after them
/// like the parameters (`decoder.layers.0.mlp.linear_fc1.input.scale`, ...); empty without
/// fp8 or before the first step. Transformer Engine keeps it in each module's `_extra_state`.
fn fp8_tensors<C: ModelChunk>(chunks: &[C]) -> Result<Vec<(String, Tensor)>> {
    let mut tensors = Vec::new();
    for (c, chunk) in chunks.iter().enumerate() {
        let prefix = chunk_prefix(c, chunks.len());
        for (name, linear) in chunk.fp8_linears() {
            linear.state_tensors(&format!("{prefix}{name}"), &mut tensors)?;
        }
    }
    Ok(tensors)
}

/// Restores what [`fp8_tensors`] saved; linears it has nothing for (or a history of another
/// `--fp8-amax-history-len`) start afresh, which a note says.
fn load_fp8_tensors<C: ModelChunk>(chunks: &[C], tensors: &HashMap<String, Tensor>) -> Result<()> {
    let mut afresh = 0;
    for (c, chunk) in chunks.iter().enumerate() {
        let prefix = chunk_prefix(c, chunks.len());
        let device = chunk.options().device;
        for (name, linear) in chunk.fp8_linears() {
            afresh += linear.load_state(&format!("{prefix}{name}"), tensors, device)?;
        }
    }
    if afresh > 0 {
        eprintln!(
            "note: {afresh} fp8 scaling states are not in the checkpoint (or have another \
             --fp8-amax-history-len) and start afresh"
        );
    }
    Ok(())
}

fn load_model_tensors<C: ModelChunk>(
    chunks: &[C],
    mut tensors: HashMap<String, Tensor>,
) -> Result<()> {
    for (c, chunk) in chunks.iter().enumerate() {
        let prefix = chunk_prefix(c, chunks.len());
        let mine: HashMap<String, Tensor> = if prefix.is_empty() {
            std::mem::take(&mut tensors)
        } else {
            let keys: Vec<String> = tensors
                .keys()
                .filter(|k| k.starts_with(&prefix))
                .cloned()
                .collect();
            keys.into_iter()
                .map(|k| {
                    (
                        k[prefix.len()..].to_string(),
                        tensors.remove(&k).expect("listed"),
                    )
                })
                .collect()
        };
        chunk
            .load_parameters(&mine)
            .with_context(|| format!("model chunk {c}"))?;
    }
    ensure!(
        tensors.is_empty(),
        "tensors for no model chunk: {:?}",
        tensors.keys().take(5).collect::<Vec<_>>()
    );
    Ok(())
}

/// `tensors` without the routed experts this rank's chunks do not hold (a checkpoint holds
/// every expert; with expert parallelism a rank holds some).
fn only_held_experts<C: ModelChunk>(
    chunks: &[C],
    mut tensors: HashMap<String, Tensor>,
) -> HashMap<String, Tensor> {
    let held: std::collections::HashSet<String> = model_tensors(chunks)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    tensors.retain(|name, _| !name.contains(".mlp.experts.local_experts.") || held.contains(name));
    tensors
}

pub struct SaveRequest<'a, C: ModelChunk> {
    pub root: &'a Path,
    /// `GPT`, `BERT`.
    pub model_type: &'static str,
    pub progress: Progress,
    pub chunks: &'a [C],
    /// How the layers are spread over the pipeline, recorded so tools can merge the ranks.
    pub split: PipelineSplit,
    pub optimizer: Option<(&'a MixedPrecisionOptimizer, &'a str)>,
    pub distributed_optimizer: bool,
    pub scheduler: &'a OptimizerParamScheduler,
    pub scaler: &'a LossScaler,
    pub save_rng: bool,
    pub args: serde_json::Value,
    pub data: Option<TrainedOn>,
    pub parallel: &'a ParallelState,
}

fn rng_tensors(device: Device) -> Result<Vec<(String, Tensor)>> {
    let mut states = vec![(
        "cpu_rng_state".to_string(),
        GeneratorState::capture(Device::Cpu)?.tensor().copy(),
    )];
    if device.is_cuda() {
        states.push((
            "cuda_rng_state".to_string(),
            GeneratorState::capture(device)?.tensor().copy(),
        ));
    }
    if let Some(state) = model_parallel_rng_state()? {
        states.push(("model_parallel_rng_state".to_string(), state));
    }
    Ok(states)
}

/// Saves the checkpoint of `request.progress.iteration`; every rank calls it. Data-parallel
/// rank 0 of each model-parallel rank writes the model, RNG and (unsharded) optimizer state;
/// with the distributed optimizer every rank writes its shard. Rank 0 commits.
pub fn save<C: ModelChunk>(request: SaveRequest<C>) -> Result<PathBuf> {
    let parallel = request.parallel;
    let world = &parallel.world;
    let (root, iteration) = (request.root, request.progress.iteration);
    begin(parallel, root, iteration)?;
    let written = RankPart::of(request).and_then(|part| {
        part.write()?;
        world.barrier()?;
        part.commit()
    });
    if written.is_err() {
        // A save that cannot finish (a full disk) leaves nothing behind; the tracker still
        // names the previous checkpoint.
        abandon_save(root, iteration);
    }
    written?;
    world.barrier()?;
    Ok(iteration_directory(root, iteration))
}

/// `--async-save`'s part of a save on the training thread; every rank calls it. Copies this
/// rank's part into host memory (pinned on a GPU, ordered after the optimizer step on the
/// current stream and waited for, so the next step may change the weights at once) and
/// returns the job that writes it in the background and hands back rank 0's commit.
pub fn snapshot<C: ModelChunk>(request: SaveRequest<C>) -> Result<async_save::Write> {
    let (root, iteration) = (request.root.to_path_buf(), request.progress.iteration);
    begin(request.parallel, &root, iteration)?;
    let device = request.chunks[0].options().device;
    let part = RankPart::of(request)
        .and_then(|part| part.into_host(device))
        .inspect_err(|_| abandon_save(&root, iteration))?;
    let rank = part.rank;
    Ok(Box::new(move || {
        let written = part.write();
        if written.is_err() {
            abandon_save(&root, iteration);
        }
        written?;
        hold_for_test(iteration, rank)?;
        let RankPart { metadata, .. } = part;
        Ok(metadata.map(|metadata| {
            Box::new(move || {
                let committed = finish_save(&root, &metadata).map(drop);
                if committed.is_err() {
                    abandon_save(&root, iteration);
                }
                committed
            }) as async_save::Commit
        }))
    }))
}

/// Copies this rank's part of a save into pinned host memory and frees it: the blocks stay in
/// libtorch's caching host allocator, ready for the snapshots of `--async-save`.
pub fn reserve_host_memory<C: ModelChunk>(request: SaveRequest<C>) -> Result<()> {
    let device = request.chunks[0].options().device;
    RankPart::of(request)?.into_host(device).map(drop)
}

/// The first step of a save on every rank: rank 0 takes the save directory and makes the
/// staging directory, which the others wait for.
fn begin(parallel: &ParallelState, root: &Path, iteration: u64) -> Result<()> {
    let world = &parallel.world;
    world.barrier()?;
    if parallel.rank == 0 {
        begin_save(root, iteration)?;
    }
    world.barrier()
}

/// The test hook of `--async-save` (docs/checkpoints.md): with `MEGATRON_RS_TEST_HOLD_ASYNC_SAVE`
/// naming a directory, a rank's background writer, its files written and nothing committed,
/// creates `held_<iteration>_rank<rank>` there and waits until `release_<iteration>` appears,
/// so that a test can act in the middle of a save whatever the timing.
fn hold_for_test(iteration: u64, rank: usize) -> Result<()> {
    let Some(directory) = std::env::var_os("MEGATRON_RS_TEST_HOLD_ASYNC_SAVE") else {
        return Ok(());
    };
    let directory = PathBuf::from(directory);
    let held = directory.join(format!("held_{iteration}_rank{rank}"));
    std::fs::write(&held, b"").with_context(|| format!("creating {}", held.display()))?;
    let release = directory.join(format!("release_{iteration}"));
    while !release.exists() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    Ok(())
}

/// One rank's part of a checkpoint: its files (tensor lists) under its rank directory of the
/// staging directory and, on rank 0, the metadata that commits the checkpoint.
struct RankPart {
    root: PathBuf,
    iteration: u64,
    rank: usize,
    rank_dir: String,
    files: Vec<(String, Vec<(String, Tensor)>)>,
    metadata: Option<CheckpointMetadata>,
}

impl RankPart {
    /// What this rank writes of `request`, its tensors where training holds them.
    fn of<C: ModelChunk>(request: SaveRequest<'_, C>) -> Result<Self> {
        // One replica of data × context writes the model; the distributed optimizer's shards
        // are over data × context.
        let parallel = &request.parallel.for_gradients();
        let chunk = &request.chunks[0];
        let device = chunk.options().device;
        let data_rank = parallel.data.rank();
        let mut files = Vec::new();
        // Every rank joins the gathering of the experts, so it comes before the choice of who
        // writes.
        let model = with_every_expert(model_tensors(request.chunks), &parallel.expert)?;
        if data_rank == 0 {
            files.push((MODEL_FILE.to_string(), model));
            if request.save_rng {
                files.push((RNG_FILE.to_string(), rng_tensors(device)?));
            }
            let fp8 = fp8_tensors(request.chunks)?;
            if !fp8.is_empty() {
                files.push((FP8_FILE.to_string(), fp8));
            }
            let chunks = request.chunks.len();
            let biases = expert_bias_tensors(request.chunks, |c| chunk_prefix(c, chunks));
            if !biases.is_empty() {
                files.push((EXPERT_BIAS_FILE.to_string(), biases));
            }
        }
        if let Some((optimizer, _)) = request.optimizer {
            let per_rank = optimizer_state_per_rank(request.distributed_optimizer, parallel);
            if per_rank || data_rank == 0 {
                let file = optimizer_file(per_rank.then_some(data_rank));
                files.push((file, optimizer.state_tensors()));
            }
        }
        let metadata = if parallel.rank == 0 {
            Some(metadata(&request)?)
        } else {
            None
        };
        Ok(RankPart {
            root: request.root.to_path_buf(),
            iteration: request.progress.iteration,
            rank: parallel.rank,
            rank_dir: rank_directory(parallel),
            files,
            metadata,
        })
    }

    /// The same part with every tensor copied into host memory of its own. From a GPU the
    /// copies go to pinned memory (libtorch's caching host allocator keeps it for the next
    /// save) and are waited for.
    fn into_host(self, device: Device) -> Result<Self> {
        let gpu = device.is_cuda();
        let files = self
            .files
            .into_iter()
            .map(|(file, tensors)| {
                let copies = tensors
                    .into_iter()
                    .map(|(name, tensor)| {
                        let copy = tensor
                            .f_to_device_(Device::Cpu, tensor.kind(), gpu, true)
                            .with_context(|| format!("copying {file} {name} into host memory"))?;
                        Ok((name, copy))
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok((file, copies))
            })
            .collect::<Result<Vec<_>>>()?;
        if let Device::Cuda(index) = device {
            tch::Cuda::synchronize(index as i64);
        }
        Ok(RankPart { files, ..self })
    }

    /// This rank's files, durably, in the staging directory.
    fn write(&self) -> Result<()> {
        let staging = megatron_store::staging_directory(&self.root, self.iteration);
        for (file, tensors) in &self.files {
            write_rank_file(&staging, &self.rank_dir, file, tensors)?;
        }
        Ok(())
    }

    /// Rank 0's metadata and commit, once every rank's files are written.
    fn commit(&self) -> Result<()> {
        if let Some(metadata) = &self.metadata {
            finish_save(&self.root, metadata)?;
        }
        Ok(())
    }
}

/// The run-wide metadata of the checkpoint `request` saves.
fn metadata<C: ModelChunk>(request: &SaveRequest<'_, C>) -> Result<CheckpointMetadata> {
    let chunk = &request.chunks[0];
    let layout = request.parallel.layout;
    Ok(CheckpointMetadata {
        format: CHECKPOINT_FORMAT.to_string(),
        checkpoint_version: CHECKPOINT_VERSION,
        iteration: request.progress.iteration,
        model_type: request.model_type.to_string(),
        model: chunk.config_json()?,
        params_dtype: dtype_name(chunk.options().params_dtype).to_string(),
        tensor_model_parallel_size: layout.tensor,
        pipeline_model_parallel_size: layout.pipeline,
        virtual_pipeline_stages: request.chunks.len(),
        decoder_first_pipeline_num_layers: request.split.first_stage_layers,
        decoder_last_pipeline_num_layers: request.split.last_stage_layers,
        data_parallel_size: request.parallel.data_with_context.size(),
        distributed_optimizer: request.distributed_optimizer,
        consumed_train_samples: request.progress.consumed_train_samples,
        consumed_valid_samples: request.progress.consumed_valid_samples,
        num_floating_point_operations_so_far: request.progress.floating_point_operations,
        opt_param_scheduler: Some(serde_json::to_value(request.scheduler.state())?),
        grad_scaler: request
            .scaler
            .state()
            .map(serde_json::to_value)
            .transpose()?,
        optimizer: request.optimizer.map(|(_, name)| name.to_string()),
        has_rng_state: request.save_rng,
        args: request.args.clone(),
        data: request.data.clone(),
    })
}

/// Refuses to start a run whose saves would replace checkpoints of another run: iteration
/// directories in `save` newer than `start_iteration`, when this run did not resume from
/// `save` itself. A run resumed from `save` (its tracker, or a tracker moved back to an earlier
/// iteration) continues that lineage, and replacing its later iterations is what resuming
/// from an earlier one means.
pub fn refuse_replacing_another_run(
    save: &Path,
    resumed_from_save: bool,
    start_iteration: u64,
) -> Result<()> {
    if resumed_from_save {
        return Ok(());
    }
    let newer: Vec<u64> = saved_iterations(save)?
        .into_iter()
        .filter(|&iteration| iteration > start_iteration)
        .filter(|&iteration| {
            iteration_directory(save, iteration)
                .join(METADATA_FILE)
                .is_file()
        })
        .collect();
    let Some(&newest) = newer.first() else {
        return Ok(());
    };
    bail!(
        "{} already holds {} checkpoint(s) of another run, up to {}, which this run (starting at \
         iteration {start_iteration}, not resumed from that directory) would replace; resume \
         that run with --load {}, or give this one another --save directory",
        save.display(),
        newer.len(),
        iteration_directory(save, newest).display(),
        save.display()
    )
}

/// Whether `a` and `b` name the same existing directory.
pub fn same_directory(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// What resuming restored.
pub enum Resumed {
    /// Weights only (`--finetune`, `--pretrained-checkpoint`, or a `release` checkpoint).
    Weights,
    Full {
        directory: PathBuf,
        progress: Progress,
    },
}

/// A model's architecture JSON without its dropout rates: a training choice that Megatron lets
/// a resumed run change (its `check_checkpoint_args` leaves them out).
fn without_dropout(model: &serde_json::Value) -> serde_json::Value {
    let mut model = model.clone();
    if let Some(fields) = model.as_object_mut() {
        fields.remove("hidden_dropout");
        fields.remove("attention_dropout");
    }
    model
}

pub struct LoadRequest<'a> {
    pub root: &'a Path,
    pub finetune: bool,
    pub load_optimizer: bool,
    pub load_rng: bool,
    pub scheduler_policy: SchedulerLoadPolicy,
}

/// Loads this rank's model weights from the checkpoint under `request.root` into `chunks`,
/// after checking that the checkpoint has the same architecture and model-parallel layout.
/// Returns the checkpoint for [`restore_training_state`] once the optimizer exists.
///
/// The ranks agree on the checks before any goes on: a rank that fails leaves the job only once
/// every rank has read what it checks, so a copy of the checkpoint that the failing rank owns
/// and removes as it exits (`--load` rewritten for the node) is never read half-removed.
pub fn load_weights<C: ModelChunk>(
    request: &LoadRequest,
    model_type: &str,
    chunks: &[C],
    parallel: &ParallelState,
) -> Result<Option<CheckpointDirectory>> {
    let model = &chunks[0];
    let checked = find_checkpoint(request.root).and_then(|found| {
        if let Some(found) = &found {
            check_loadable(found, model_type, chunks, parallel)?;
        }
        Ok(found)
    });
    let [failed] = megatron_parallel::max_over_ranks(
        parallel.world.as_ref(),
        model.options().device,
        [f64::from(u8::from(checked.is_err()))],
    )?;
    let Some(found) = checked? else {
        return Ok(None);
    };
    if failed > 0.0 {
        bail!(
            "{}: another rank cannot load this checkpoint (its error says why)",
            found.directory.display()
        );
    }
    let rank_dir = rank_directory(parallel);
    let tensors = found
        .read(&rank_dir, MODEL_FILE, model.options().device)?
        .with_context(|| {
            format!(
                "{} has no {rank_dir}/{MODEL_FILE}",
                found.directory.display()
            )
        })?;
    load_model_tensors(chunks, only_held_experts(chunks, tensors))
        .with_context(|| format!("loading {}", found.directory.display()))?;
    if let Some(fp8) = found.read(&rank_dir, FP8_FILE, Device::Cpu)? {
        load_fp8_tensors(chunks, &fp8)
            .with_context(|| format!("fp8 state of {}", found.directory.display()))?;
    }
    let biases = found.read(&rank_dir, EXPERT_BIAS_FILE, model.options().device)?;
    load_expert_biases(chunks, |c| chunk_prefix(c, chunks.len()), biases.as_ref())
        .with_context(|| format!("expert biases of {}", found.directory.display()))?;
    Ok(Some(found))
}

/// Whether `found` holds a `model_type` model of `chunks`' architecture in this run's
/// model-parallel layout.
fn check_loadable<C: ModelChunk>(
    found: &CheckpointDirectory,
    model_type: &str,
    chunks: &[C],
    parallel: &ParallelState,
) -> Result<()> {
    let model = &chunks[0];
    if found.metadata.model_type != model_type {
        bail!(
            "{} holds a {} model, not {model_type}",
            found.directory.display(),
            found.metadata.model_type
        );
    }
    let ours = model.config_json()?;
    if without_dropout(&found.metadata.model) != without_dropout(&ours) {
        bail!(
            "{} was saved with a different architecture: {}",
            found.directory.display(),
            config_differences(&found.metadata.model, &ours)
        );
    }
    let metadata = &found.metadata;
    let layout = parallel.layout;
    if (
        metadata.tensor_model_parallel_size,
        metadata.pipeline_model_parallel_size,
        metadata.virtual_pipeline_stages,
    ) != (layout.tensor, layout.pipeline, chunks.len())
    {
        bail!(
            "{} was saved with {} but this run uses TP={} PP={}{}; the model-parallel layout must match to load it",
            found.directory.display(),
            metadata.describe_layout(),
            layout.tensor,
            layout.pipeline,
            if chunks.len() > 1 { format!(" ({} virtual stages)", chunks.len()) } else { String::new() }
        );
    }
    Ok(())
}

pub(super) fn config_differences(saved: &serde_json::Value, ours: &serde_json::Value) -> String {
    let (Some(saved), Some(ours)) = (saved.as_object(), ours.as_object()) else {
        return String::new();
    };
    saved
        .iter()
        .filter(|(k, v)| ours.get(*k) != Some(v))
        .map(|(k, v)| {
            format!(
                "{k} = {v} in the checkpoint, {} now",
                ours.get(k).cloned().unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub struct TrainingState<'a> {
    pub optimizer: &'a mut MixedPrecisionOptimizer,
    pub distributed_optimizer: bool,
    pub scheduler: &'a mut OptimizerParamScheduler,
    pub scaler: &'a mut LossScaler,
}

/// Restores counters, optimizer, scheduler, loss scaler and generators from a checkpoint.
/// Whether each data-parallel rank writes an optimizer state file of its own: with the
/// distributed optimizer (each holds a shard), and with expert parallelism (each holds other
/// experts).
fn optimizer_state_per_rank(distributed_optimizer: bool, parallel: &ParallelState) -> bool {
    (distributed_optimizer || parallel.layout.expert_size() > 1)
        && parallel.data_parallel_size() > 1
}

/// `tensors` with the routed experts of every rank of the expert-parallel `group` (gathered
/// from them), so a checkpoint holds each layer's every expert whatever the expert
/// parallelism; unchanged without it. Experts are named by global index
/// (`….mlp.experts.local_experts.<e>.…`), each rank holding a run of them; every rank calls
/// this, and gathers its experts' tensors in the same order.
fn with_every_expert(
    mut tensors: Vec<(String, Tensor)>,
    group: &std::sync::Arc<dyn megatron_parallel::Communicator>,
) -> Result<Vec<(String, Tensor)>> {
    const EXPERTS: &str = ".mlp.experts.local_experts.";
    if group.size() == 1 {
        return Ok(tensors);
    }
    // (layer prefix, global index, the rest of the name) of each expert tensor.
    let mut experts: Vec<(String, i64, String, Tensor)> = Vec::new();
    tensors.retain(|(name, tensor)| {
        let Some(at) = name.find(EXPERTS) else {
            return true;
        };
        let (prefix, tail) = name.split_at(at + EXPERTS.len());
        let Some((index, rest)) = tail.split_once('.') else {
            return true;
        };
        let Ok(index) = index.parse::<i64>() else {
            return true;
        };
        experts.push((
            prefix.to_string(),
            index,
            rest.to_string(),
            tensor.shallow_clone(),
        ));
        false
    });
    let mut first: HashMap<String, i64> = HashMap::new();
    for (prefix, index, _, _) in &experts {
        let entry = first.entry(prefix.clone()).or_insert(*index);
        *entry = (*entry).min(*index);
    }
    let mut locals: Vec<(String, i64, String, Tensor)> = experts
        .into_iter()
        .map(|(prefix, index, rest, tensor)| {
            let local = index - first[&prefix];
            (prefix, local, rest, tensor)
        })
        .collect();
    locals.sort_by(|a, b| (&a.0, a.1, &a.2).cmp(&(&b.0, b.1, &b.2)));
    let per_rank: HashMap<&String, i64> = locals.iter().fold(HashMap::new(), |mut m, e| {
        let count = m.entry(&e.0).or_insert(0);
        *count = (*count).max(e.1 + 1);
        m
    });
    let mut gathered = Vec::with_capacity(locals.len() * group.size());
    for (prefix, local, rest, tensor) in &locals {
        let all = group
            .all_gather(&tensor.unsqueeze(0).contiguous(), 0)
            .with_context(|| {
                format!("gathering {prefix}{local}.{rest} from the expert-parallel ranks")
            })?;
        for rank in 0..group.size() as i64 {
            let index = rank * per_rank[prefix] + local;
            gathered.push((format!("{prefix}{index}.{rest}"), all.get(rank)));
        }
    }
    tensors.extend(gathered);
    Ok(tensors)
}

pub fn restore_training_state(
    found: CheckpointDirectory,
    request: &LoadRequest,
    state: TrainingState,
    parallel: &ParallelState,
    device: Device,
) -> Result<Resumed> {
    if request.finetune || found.release {
        return Ok(Resumed::Weights);
    }
    let directory = found.directory.clone();
    let metadata = &found.metadata;
    if let Some(scheduler) = &metadata.opt_param_scheduler {
        let saved: SchedulerState =
            serde_json::from_value(scheduler.clone()).context("checkpoint scheduler state")?;
        state
            .scheduler
            .load_state(&saved, request.scheduler_policy)
            .with_context(|| format!("resuming {}", directory.display()))?;
    }
    if let (Some(scaler), true) = (&metadata.grad_scaler, state.scaler.is_dynamic()) {
        let saved: LossScalerState =
            serde_json::from_value(scaler.clone()).context("checkpoint loss scaler state")?;
        state.scaler.load_state(&saved)?;
    }
    let rank_dir = rank_directory(parallel);
    let parallel = &parallel.for_gradients();
    if request.load_optimizer {
        let sharded = optimizer_state_per_rank(state.distributed_optimizer, parallel);
        let saved_experts = metadata
            .args
            .pointer("/model/expert_model_parallel_size")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(1) as usize;
        let saved_sharded = (metadata.distributed_optimizer || saved_experts > 1)
            && metadata.data_parallel_size > 1;
        if metadata.optimizer.is_some() && saved_experts != parallel.layout.expert_size() {
            bail!(
                "{}: the optimizer state was saved with --expert-model-parallel-size \
                 {saved_experts} but this run uses {}; pass --no-load-optim to start the \
                 optimizer afresh",
                directory.display(),
                parallel.layout.expert_size()
            );
        }
        if metadata.optimizer.is_some()
            && (sharded, sharded.then_some(metadata.data_parallel_size))
                != (
                    saved_sharded,
                    sharded.then_some(parallel.data_parallel_size()),
                )
        {
            bail!(
                "{}: the optimizer state was saved with {} but this run uses DP={}{}; pass --no-load-optim to start the optimizer afresh",
                directory.display(),
                metadata.describe_layout(),
                parallel.data_parallel_size(),
                if state.distributed_optimizer { ", distributed optimizer" } else { "" }
            );
        }
        let file = optimizer_file(sharded.then(|| parallel.data.rank()));
        if let Some(tensors) = found.read(&rank_dir, &file, device)? {
            state
                .optimizer
                .load_state_tensors(&tensors)
                .with_context(|| format!("optimizer state of {}", directory.display()))?;
        }
    }
    if request.load_rng {
        if let Some(rng) = found.read(&rank_dir, RNG_FILE, Device::Cpu)? {
            if let Some(cpu) = rng.get("cpu_rng_state") {
                GeneratorState::from_tensor(Device::Cpu, cpu.shallow_clone()).restore()?;
            }
            if let (Some(cuda), true) = (rng.get("cuda_rng_state"), device.is_cuda()) {
                GeneratorState::from_tensor(device, cuda.shallow_clone()).restore()?;
            }
            if let (Some(state), true) = (rng.get("model_parallel_rng_state"), device.is_cuda()) {
                set_model_parallel_rng_state(device, state)?;
            }
        }
    }
    Ok(Resumed::Full {
        directory,
        progress: Progress {
            iteration: metadata.iteration,
            consumed_train_samples: metadata.consumed_train_samples,
            consumed_valid_samples: metadata.consumed_valid_samples,
            floating_point_operations: metadata.num_floating_point_operations_so_far,
        },
    })
}
