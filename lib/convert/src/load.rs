//! One entry point for every supported input: the format is detected from the files.

use std::path::Path;

use anyhow::{bail, Context, Result};
use megatron_checkpoint::layout::{detect, Format};

use super::hf::load_hf;
use super::megatron_torch::{load_megatron_torch, LoadOptions};
use super::megatron_torch_dist::load_torch_dist;
use super::ours::load_megatron_rs;
use super::state::ModelState;
use megatron_store::find_checkpoint;

/// Loads the checkpoint under `dir` — ours, Megatron's torch or torch_dist, or a HuggingFace
/// model directory — into one [`ModelState`] (whole model, Megatron-core names). `loader`
/// (convert.py's `--loader` names) insists on a kind; `None` takes whatever `dir` holds. Tools
/// that evaluate or serve a foreign checkpoint build the model from the result with
/// [`super::verify::model_of`].
pub fn load_checkpoint(
    dir: &Path,
    loader: Option<&str>,
    options: &LoadOptions,
) -> Result<ModelState> {
    let (format, directory) = detect(dir)?;
    let wanted = match loader {
        None => format,
        Some("megatron-rs") => Format::MegatronRs,
        Some("core" | "mcore" | "legacy" | "megatron") if format == Format::TorchDist => Format::TorchDist,
        Some("core" | "mcore" | "legacy" | "megatron") => Format::MegatronTorch,
        Some("hf" | "llama_mistral") => Format::HuggingFace,
        Some(other) => bail!("--loader {other}: expected megatron-rs, core, mcore, legacy, megatron, hf or llama_mistral"),
    };
    if wanted != format {
        bail!(
            "--loader {}: {} holds a {} checkpoint",
            loader.unwrap_or_default(),
            dir.display(),
            format.name()
        );
    }
    let state = match format {
        Format::MegatronRs => {
            let checkpoint = find_checkpoint(dir)?
                .with_context(|| format!("{}: no checkpoint", dir.display()))?;
            let state = load_megatron_rs(&checkpoint, options.optimizer)?;
            if let Some(size) = options.true_vocab_size {
                if size != state.config.vocab_size {
                    bail!(
                        "--true-vocab-size {size} disagrees with {} (vocabulary of {})",
                        checkpoint.directory.display(),
                        state.config.vocab_size
                    );
                }
            }
            state
        }
        Format::MegatronTorch => load_megatron_torch(&directory, options)?,
        Format::TorchDist => load_torch_dist(&directory, options)?,
        Format::HuggingFace => load_hf(
            &directory,
            options.make_vocab_size_divisible_by.unwrap_or(128),
            options.true_vocab_size,
        )?,
    };
    state.validate()?;
    Ok(state)
}
