//! `--load` in a training run of a checkpoint the run cannot read as it is: Megatron's `torch`
//! and `torch_dist` directories (detected), and our own checkpoints saved under another
//! layout (tensor or pipeline parallel size, virtual stages, or the distributed optimizer's
//! sharding over data-parallel ranks). Either is written, with its optimizer state (plain or
//! distributed), scheduler and counters, as one of ours laid out for the run in a temporary
//! directory, which the run then resumes from. This is `checkpoint_convert`'s reshape: it
//! streams tensor by tensor.

use std::path::Path;

use anyhow::{Context, Result};
use megatron_checkpoint::layout::{detect, Format};
use megatron_models::{FamilyModel, GptModel};
use megatron_store::{find_checkpoint, CheckpointDirectory};

use super::load::load_checkpoint;
use super::megatron_torch::LoadOptions;
use super::ours::{
    load_megatron_rs, save_megatron_rs_sharded, saved_optimizer_shards, OptimizerShards,
    TargetLayout,
};
use super::state::ModelState;

/// A checkpoint rewritten for the run that resumes from it.
pub struct PreparedCheckpoint {
    /// Holds the rewritten checkpoint; removed when dropped.
    pub directory: tempfile::TempDir,
    /// What was rewritten, from which layout to which, for the run's log.
    pub description: String,
}

/// The checkpoint under `load` written into a temporary directory in `layout`, with the
/// optimizer state where `optimizer` (sharded as `shards` where the run uses the distributed
/// optimizer over several data-parallel ranks), when the run cannot read it as it is: a
/// Megatron checkpoint, or a GPT checkpoint of ours saved under another layout. `None` where
/// the run reads `load` itself (one of ours in its layout, a `release` checkpoint, another
/// model type, or no checkpoint yet).
pub fn import_for_resume(
    load: &Path,
    layout: TargetLayout,
    optimizer: bool,
    shards: Option<OptimizerShards>,
) -> Result<Option<PreparedCheckpoint>> {
    if !load.is_dir() {
        return Ok(None);
    }
    let shards = shards.filter(|s| s.data_parallel > 1);
    let target = describe_target(layout, shards);
    let (state, description) = match detect(load) {
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
    };
    let directory = tempfile::Builder::new()
        .prefix("megatron-rs-resume")
        .tempdir()
        .context("creating a temporary directory for the rewritten checkpoint")?;
    save_megatron_rs_sharded(&state, directory.path(), layout, shards).with_context(|| {
        format!(
            "--load {}: writing the checkpoint for this run's layout to {}",
            load.display(),
            directory.path().display()
        )
    })?;
    Ok(Some(PreparedCheckpoint {
        directory,
        description,
    }))
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
