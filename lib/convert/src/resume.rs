//! `--load` in a training run of a checkpoint the run cannot read as it is: Megatron's `torch`
//! and `torch_dist` directories (detected), and our own checkpoints saved under another
//! layout (tensor or pipeline parallel size, virtual stages, or the distributed optimizer's
//! sharding over data-parallel ranks). Either is written, with its optimizer state (plain or
//! distributed), scheduler and counters, as one of ours laid out for the run in a temporary
//! directory, which the run then resumes from. This is `checkpoint_convert`'s reshape: it
//! streams tensor by tensor. In a job of many processes one per node writes it
//! ([`import_for_job`]).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use megatron_checkpoint::layout::{detect, Format};
use megatron_models::{FamilyModel, GptModel};
use megatron_parallel::{max_over_ranks, LaunchEnv, Placement};
use megatron_store::{find_checkpoint, CheckpointDirectory};

use super::load::load_checkpoint;
use super::megatron_torch::LoadOptions;
use super::ours::{
    load_megatron_rs, save_megatron_rs_sharded, saved_optimizer_shards, OptimizerShards,
    TargetLayout,
};
use super::state::ModelState;

/// The checkpoint under `load`, read lazily, that the run cannot read as it is (a Megatron
/// checkpoint, or a GPT checkpoint of ours saved under another layout), and what rewriting it
/// into `layout`, with the optimizer state where `optimizer` (sharded as `shards` where the run
/// uses the distributed optimizer over several data-parallel ranks), does. `None` where the
/// run reads `load` itself (one of ours in its layout, a `release` checkpoint, another model
/// type, or no checkpoint yet).
fn rewrite_source(
    load: &Path,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
) -> Result<Option<(ModelState, String)>> {
    if !load.is_dir() {
        return Ok(None);
    }
    let shards = shards.filter(|s| s.data_parallel > 1);
    let target = describe_target(layout, shards);
    Ok(Some(match detect(load) {
        Ok((Format::MegatronTorch | Format::TorchDist, _)) => {
            let state = load_checkpoint(
                load,
                Some("core"),
                &LoadOptions {
                    optimizer,
                    ..Default::default()
                },
            )
            .with_context(|| {
                format!(
                    "--load {}: importing the Megatron checkpoint",
                    load.display()
                )
            })?;
            let description = format!("imported the {} into {target}", state.source);
            (state, description)
        }
        Ok((Format::MegatronRs, _)) => {
            let Some(found) = find_checkpoint(load)? else {
                return Ok(None);
            };
            if !needs_reshape(&found, layout, optimizer, shards) {
                return Ok(None);
            }
            let state = reshape_source(&found, optimizer)
                .with_context(|| format!("--load {}: reading the checkpoint", load.display()))?;
            let description = format!(
                "reshaped the checkpoint {} from {} to {target}",
                found.directory.display(),
                found.metadata.describe_layout()
            );
            (state, description)
        }
        _ => return Ok(None),
    }))
}

/// Writes `state` (read from `load`) into `directory` in the run's layout.
fn write_rewritten(
    state: &ModelState,
    load: &Path,
    directory: &Path,
    layout: TargetLayout,
    shards: Option<OptimizerShards>,
) -> Result<()> {
    let shards = shards.filter(|s| s.data_parallel > 1);
    save_megatron_rs_sharded(state, directory, layout, shards).with_context(|| {
        format!(
            "--load {}: writing the checkpoint for this run's layout to {}",
            load.display(),
            directory.display()
        )
    })
}

/// The checkpoint a process of a job resumes from, rewritten on its node.
pub struct NodeCheckpoint {
    /// The rewritten checkpoint, in the node's temporary directory.
    pub directory: PathBuf,
    /// On the process that wrote it (the node's local rank 0): what was rewritten, for the
    /// run's log.
    pub description: Option<String>,
    /// Held by the writer: removes the directory when the run ends.
    _owner: Option<RemovedWhenDropped>,
}

/// A directory removed when this is dropped.
struct RemovedWhenDropped(PathBuf);

impl Drop for RemovedWhenDropped {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `load` rewritten for the run (see [`rewrite_source`]) where it cannot read it as it is, for
/// every process of the job at `launch`, whose own part is `placement`: the node's local rank 0
/// writes the rewritten checkpoint once, into
/// `$TMPDIR/megatron-rs-resume-<master address>-<port>-node<N>` (replacing what a job of the
/// same name left there; a process alone takes a directory of a fresh name), while the node's
/// other processes wait for it over the job's communicator, then read that copy. Each node names
/// its own, so there is one copy per node whether or not the nodes share `$TMPDIR`. A failure
/// on any node stops every process.
pub fn import_for_job(
    load: &Path,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
    placement: &Placement,
    launch: &LaunchEnv,
) -> Result<Option<NodeCheckpoint>> {
    let shared = (placement.parallel.world_size() > 1).then(|| {
        std::env::temp_dir().join(format!(
            "megatron-rs-resume-{}-{}-node{}",
            launch.master_addr, launch.master_port, launch.node.node_rank
        ))
    });
    let written = if launch.local_rank == 0 {
        write_for_node(load, layout, optimizer, shards, shared.as_deref())
    } else {
        Ok(None)
    };
    let agreed = max_over_ranks(
        placement.parallel.world.as_ref(),
        placement.device,
        [
            f64::from(u8::from(written.is_err())),
            f64::from(u8::from(matches!(written, Ok(Some(_))))),
        ],
    )?;
    let written = written?;
    if agreed[0] > 0.0 {
        bail!(
            "--load {}: rewriting the checkpoint for this run failed on another node",
            load.display()
        );
    }
    if agreed[1] == 0.0 {
        return Ok(None);
    }
    Ok(Some(match written {
        Some((description, owner)) => NodeCheckpoint {
            directory: owner.0.clone(),
            description: Some(description),
            _owner: Some(owner),
        },
        None => NodeCheckpoint {
            directory: shared.context("a process alone writes its own copy")?,
            description: None,
            _owner: None,
        },
    }))
}

/// The node's copy, written under a temporary name and renamed to `shared` once complete (what
/// a job of the same name left there removed first), or kept under its temporary name.
fn write_for_node(
    load: &Path,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
    shared: Option<&Path>,
) -> Result<Option<(String, RemovedWhenDropped)>> {
    let Some((state, description)) = rewrite_source(load, layout, optimizer, shards)? else {
        return Ok(None);
    };
    let staging = tempfile::Builder::new()
        .prefix("megatron-rs-resume")
        .tempdir()
        .context("creating a temporary directory for the rewritten checkpoint")?;
    write_rewritten(&state, load, staging.path(), layout, shards)?;
    let Some(directory) = shared else {
        return Ok(Some((description, RemovedWhenDropped(staging.keep()))));
    };
    if directory.exists() {
        std::fs::remove_dir_all(directory)
            .with_context(|| format!("removing the leftover {}", directory.display()))?;
    }
    std::fs::rename(staging.path(), directory).with_context(|| {
        format!(
            "renaming {} to {}",
            staging.path().display(),
            directory.display()
        )
    })?;
    let _ = staging.keep();
    Ok(Some((
        format!(
            "{description} (written once for this node's processes, to {})",
            directory.display()
        ),
        RemovedWhenDropped(directory.to_path_buf()),
    )))
}

/// Whether the run (in `layout`, its optimizer state sharded as `shards`) cannot read our
/// checkpoint `found` as it is. Only GPT checkpoints are reshaped; a `release` checkpoint holds
/// weights that the run loads as they are.
fn needs_reshape(
    found: &CheckpointDirectory,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
) -> bool {
    let metadata = &found.metadata;
    if found.release || metadata.model_type != GptModel::MODEL_TYPE {
        return false;
    }
    let model_parallel = (
        metadata.tensor_model_parallel_size,
        metadata.pipeline_model_parallel_size,
        metadata.virtual_pipeline_stages.max(1),
    ) != (layout.tensor, layout.pipeline, layout.virtual_stages);
    let optimizer_sharding =
        optimizer && metadata.optimizer.is_some() && saved_optimizer_shards(metadata) != shards;
    model_parallel || optimizer_sharding
}

/// Our checkpoint `found` read lazily, checked against its own architecture.
fn reshape_source(found: &CheckpointDirectory, optimizer: bool) -> Result<ModelState> {
    let state = load_megatron_rs(found, optimizer)?;
    state.validate()?;
    Ok(state)
}

/// `layout` as `CheckpointMetadata::describe_layout` words a saved one.
fn describe_target(layout: TargetLayout, shards: Option<OptimizerShards>) -> String {
    let mut text = format!("TP={} PP={}", layout.tensor, layout.pipeline);
    if layout.virtual_stages > 1 {
        text.push_str(&format!(" ({} virtual stages)", layout.virtual_stages));
    }
    if let Some(shards) = shards {
        text.push_str(&format!(
            ", distributed optimizer over DP={}",
            shards.data_parallel
        ));
    }
    text
}
