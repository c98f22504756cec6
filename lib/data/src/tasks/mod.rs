//! The data of Megatron's `tasks/`, exactly as Megatron builds it: the zero-shot GPT tasks
//! (`tasks/zeroshot_gpt`, spec §7.2–7.3: LAMBADA's strict and non-strict samples, WikiText's
//! detokenized overlapping windows) and the finetuning tasks (spec §7.4–7.5: RACE multiple choice,
//! the GLUE classification tasks MNLI and QQP, read from each task's official files and turned
//! into BERT pair inputs). Model-free, so it is tested against Megatron's goldens on its own.

mod glue;
mod lambada;
mod pair;
mod python_text;
mod race;
mod text;
mod wikitext;
mod window;

pub use glue::{read_glue_tsv, ClassificationSample, GlueFile, GlueRow, GlueTask};
pub use lambada::{LambadaDataset, LambadaFormulation, LambadaPassage};
pub use pair::{PairInput, PairSpecials};
pub use python_text::{is_python_space, python_split_whitespace, python_strip};
pub use race::{read_race_dir, RaceSample, MAX_QA_LENGTH, NUM_CHOICES};
pub use text::clean_text;
pub use wikitext::{
    detokenizer_for_path, wikitext_detokenize, Detokenizer, LmDataset, WikitextData,
};
pub use window::TaskSample;

#[cfg(test)]
mod golden_tests;

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The whole of a task's data file as UTF-8, with the errors a user needs: a missing file, a
/// directory where a file belongs, an empty file, bytes that are not UTF-8.
pub(crate) fn read_task_file(path: &Path) -> Result<String> {
    let metadata = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if !metadata.is_file() {
        bail!(
            "{}: is a directory, not a data file (give the file itself)",
            path.display()
        );
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if bytes.is_empty() {
        bail!("{}: the file is empty", path.display());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
