//! A training run's saves in one of Megatron's formats (`pretrain_gpt --ckpt-format torch_dist`
//! or `torch`): the ranks save their parts in our format into a hidden directory under `--save`
//! as every save does, then one process rewrites that checkpoint with `checkpoint_convert`'s
//! savers, read lazily and written tensor by tensor, into a staging directory that is renamed
//! into place before the tracker moves. One implementation of each format's layout, whether a
//! conversion or a training run writes it.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use megatron_store::{commit_iteration, find_checkpoint, iteration_directory};

use super::megatron_save::{run_flag, save_megatron_torch_experts};
use super::megatron_torch_dist_save::save_megatron_torch_dist;
use super::ours::{load_megatron_rs, TargetLayout};

/// One of Megatron's checkpoint formats a training run can save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MegatronFormat {
    /// `--ckpt-format torch`: `mp_rank_XX[_YYY]/model_optim_rng.pt`.
    Torch,
    /// `--ckpt-format torch_dist`: `.metadata`, `__R_0.distcp`, `common.pt`.
    TorchDist,
}

impl MegatronFormat {
    /// The format `--ckpt-format` names, if it is one of these.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "torch" => Some(Self::Torch),
            "torch_dist" => Some(Self::TorchDist),
            _ => None,
        }
    }

    /// Its `--ckpt-format` name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Torch => "torch",
            Self::TorchDist => "torch_dist",
        }
    }
}

/// Rewrites the checkpoint the tracker under `ours` names (one of ours, as a training run just
/// saved it) in `format` as iteration directory of `save`, with its optimizer state if it has
/// one, in the layout it was saved in; moves `save`'s tracker to it last. A failure leaves
/// `save` as it was.
pub fn export_saved_checkpoint(
    ours: &Path,
    save: &Path,
    format: MegatronFormat,
) -> Result<PathBuf> {
    let found = find_checkpoint(ours)?
        .with_context(|| format!("{} holds no checkpoint to export", ours.display()))?;
    let metadata = &found.metadata;
    if metadata.decoder_first_pipeline_num_layers.is_some()
        || metadata.decoder_last_pipeline_num_layers.is_some()
    {
        bail!(
            "{}: Megatron's formats are written here for pipeline stages of equal layers only \
             (--decoder-first-pipeline-num-layers or --decoder-last-pipeline-num-layers was \
             given); save with --ckpt-format \
             safetensors",
            found.directory.display()
        );
    }
    let state = load_megatron_rs(&found, metadata.optimizer.is_some())?;
    state.validate()?;
    let iteration = metadata.iteration;
    let target = TargetLayout {
        tensor: metadata.tensor_model_parallel_size,
        pipeline: metadata.pipeline_model_parallel_size,
        virtual_stages: metadata.virtual_pipeline_stages.max(1),
    };
    let staging = save.join(format!(
        ".{}.export.tmp",
        iteration_directory(Path::new(""), iteration).display()
    ));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing the abandoned {}", staging.display()))?;
    }
    let expert_parallel = run_flag(&state.run.args, "expert_model_parallel_size")
        .and_then(|v| v.as_u64())
        .map_or(1, |e| e.max(1) as usize);
    let written = match format {
        MegatronFormat::TorchDist => save_megatron_torch_dist(
            &state,
            &staging,
            target,
            metadata.data_parallel_size,
            metadata.distributed_optimizer,
            expert_parallel,
        ),
        MegatronFormat::Torch => save_megatron_torch_experts(
            &state,
            &staging,
            target,
            expert_parallel,
            metadata.distributed_optimizer,
        ),
    }
    .and_then(|()| commit_iteration(save, &iteration_directory(&staging, iteration), iteration));
    let _ = std::fs::remove_dir_all(&staging);
    written.with_context(|| {
        format!(
            "writing iteration {iteration} of {} in Megatron's {} format",
            save.display(),
            format.name()
        )
    })
}
