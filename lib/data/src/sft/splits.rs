//! The train, validation and test splits of one conversations file, cut by `--split` as
//! Megatron's dataset builder cuts an SFT dataset (no shuffling, no blends).

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::conversation::read_conversations;
use super::dataset::{SftDataset, SftSplit};
use super::prompt_format::PromptFormat;
use crate::blend::{DataSources, DEFAULT_SPLIT};
use crate::gpt::{Split, SplitMatrix};
use crate::tokenizer::Tokenizer;

pub struct SftRequest<'a> {
    pub sources: &'a DataSources,
    /// The raw `--split` string.
    pub split: Option<&'a str>,
    /// Samples wanted per split (train, valid, test); `None`: one pass over its conversations.
    pub sizes: [Option<u64>; 3],
    pub tokenizer: Arc<dyn Tokenizer>,
    pub format: PromptFormat,
    pub seq_length: usize,
}

/// Each split of the request's one JSONL file, `None` where the split gets no conversation.
pub fn build_sft_splits(request: &SftRequest) -> Result<[Option<SftSplit>; 3]> {
    let path = match request.sources {
        DataSources::Blend(blend) if blend.prefixes.len() == 1 && blend.weights.is_none() => {
            &blend.prefixes[0]
        }
        _ => bail!(
            "--sft reads one conversations file: give it as --data-path FILE.jsonl, without \
             weights or per-split paths"
        ),
    };
    if request.seq_length < 2 {
        bail!("--sft needs --seq-length of at least 2 (a token and the end-of-document token)");
    }
    let conversations = read_conversations(Path::new(path))?;
    let dataset = Arc::new(SftDataset::new(
        conversations,
        request.tokenizer.clone(),
        request.format,
        request.seq_length,
    )?);
    let matrix = SplitMatrix::parse(request.split.unwrap_or(DEFAULT_SPLIT))?;
    let mut out: [Option<SftSplit>; 3] = [None, None, None];
    for split in Split::ALL {
        let Some(bookend) = matrix.get(split) else {
            continue;
        };
        let conversations = bookend.range(dataset.len());
        if conversations.is_empty() {
            continue;
        }
        let samples = request.sizes[split.index()].map_or(conversations.len(), |n| n as usize);
        out[split.index()] = Some(SftSplit {
            dataset: dataset.clone(),
            conversations,
            samples,
        });
    }
    Ok(out)
}
