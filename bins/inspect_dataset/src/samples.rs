//! `samples`: build (or load from cache) the GPT datasets exactly as training does and print
//! the raw token windows of one split.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use megatron_data::blend::{build_gpt_datasets, DataPathFlags, DataSources, SplitDataset};
use megatron_data::gpt::{
    GptDataset, GptDatasetConfig, IndexOrigin, SampleOptions, Split, SplitMatrix, TokenSource,
    TokenizerGeneration, TokenizerIdentity,
};
use megatron_data::indexed::IndexedDataset;

#[derive(Args)]
pub struct SamplesArgs {
    /// Dataset prefixes, optionally weighted: `A`, `A B`, or `0.3 A 0.7 B`.
    #[arg(long, num_args = 1.., value_name = "[WEIGHT] PREFIX")]
    data_path: Vec<String>,
    /// File whose whitespace-separated words are the --data-path list.
    #[arg(long)]
    data_args_path: Option<PathBuf>,
    /// Train-split prefixes (per-split mode; excludes --data-path and --split).
    #[arg(long, num_args = 1..)]
    train_data_path: Vec<String>,
    /// Validation-split prefixes (per-split mode).
    #[arg(long, num_args = 1..)]
    valid_data_path: Vec<String>,
    /// Test-split prefixes (per-split mode).
    #[arg(long, num_args = 1..)]
    test_data_path: Vec<String>,
    /// JSON file {"train": [...], "valid": [...], "test": [...]} (per-split mode).
    #[arg(long)]
    per_split_data_args_path: Option<PathBuf>,
    /// Train/valid/test proportions, e.g. `969,30,1` (hashed verbatim into cache names).
    #[arg(long)]
    split: Option<String>,
    /// Tokens per sample (each sample holds one more, the last label).
    #[arg(long)]
    seq_length: usize,
    /// Random seed for the document and sample shuffles.
    #[arg(long, default_value_t = 1234)]
    seed: u32,
    /// Samples requested for train,valid,test (training's computed sizes); `none` = one epoch.
    #[arg(long, value_name = "TRAIN,VALID,TEST")]
    num_samples: Option<String>,
    /// Which split to print.
    #[arg(long, default_value = "train")]
    split_name: String,
    /// Print only the first N samples (default: all).
    #[arg(long)]
    first: Option<usize>,
    /// Index cache directory; without it indices go to PREFIX/cache/GPTDataset_indices.
    #[arg(long)]
    data_cache_path: Option<PathBuf>,
    /// Tokenizer type (enters the cache file names, as in Megatron).
    #[arg(long, default_value = "GPT2BPETokenizer")]
    tokenizer_type: String,
    /// Tokenizer vocabulary path, as training is given it (recorded, not read).
    #[arg(long)]
    vocab_file: Option<String>,
    /// BPE merges path, as training is given it (recorded, not read).
    #[arg(long)]
    merge_file: Option<String>,
    /// Name caches like Megatron's legacy tokenizers (`--legacy-tokenizer`, up to core_v0.14).
    #[arg(long)]
    legacy_tokenizer: bool,
    /// Extra fraction of samples built for each member of a weighted blend.
    #[arg(long, default_value_t = 0.005)]
    mid_level_dataset_surplus: f64,
}

pub fn run(args: &SamplesArgs) -> Result<()> {
    let split = Split::from_name(&args.split_name)?;
    let (sources, split_string) = data_sources(args)?;
    let generation = if args.legacy_tokenizer {
        TokenizerGeneration::Legacy
    } else {
        TokenizerGeneration::Current
    };
    let tokenizer = TokenizerIdentity::from_flags(
        &args.tokenizer_type,
        args.vocab_file.as_deref(),
        args.merge_file.as_deref(),
        generation,
    )?;
    let split_matrix = split_string
        .as_deref()
        .map(SplitMatrix::parse)
        .transpose()?;
    let config = Arc::new(GptDatasetConfig {
        random_seed: args.seed,
        sequence_length: args.seq_length,
        split: split_string,
        split_matrix,
        path_to_cache: args.data_cache_path.clone(),
        tokenizer,
        add_extra_token_to_sequence: true,
        drop_last_partial_validation_sequence: true,
        mid_level_dataset_surplus: args.mid_level_dataset_surplus,
        // Only raw windows are printed; masks (which need the EOD id) are not computed here.
        sample: SampleOptions {
            eod_token: -1,
            pad_token: -1,
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
            create_attention_mask: false,
        },
    });
    if args.seq_length < 2 {
        bail!("--seq-length must be at least 2");
    }
    let sizes = parse_sizes(args.num_samples.as_deref())?;
    let open = |prefix: &str| -> Result<Arc<dyn TokenSource>> {
        Ok(Arc::new(IndexedDataset::open(prefix)?) as Arc<dyn TokenSource>)
    };
    let mut datasets = build_gpt_datasets(&sources, sizes, config, &open)?;
    let Some(dataset) = datasets[split.index()].take() else {
        bail!(
            "the {} split is empty with these data paths and --split",
            split.name()
        );
    };

    let count = args.first.unwrap_or(usize::MAX).min(dataset.len());
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    for idx in 0..count {
        let (member, text) = dataset.sample_text(idx);
        let member = member.map_or(String::new(), |m| format!(", \"dataset_id\": {m}"));
        writeln!(
            out,
            "{{\"idx\": {idx}, \"text\": {}, \"document_ids\": {}{member}}}",
            serde_json::to_string(&text.tokens)?,
            serde_json::to_string(&text.document_ids)?
        )?;
    }
    out.flush().context("writing samples to stdout")?;
    eprintln!("{}", summary(split, &dataset, count));
    Ok(())
}

fn data_sources(args: &SamplesArgs) -> Result<(DataSources, Option<String>)> {
    DataPathFlags {
        data_path: args.data_path.clone(),
        data_args_path: args.data_args_path.clone(),
        train_data_path: args.train_data_path.clone(),
        valid_data_path: args.valid_data_path.clone(),
        test_data_path: args.test_data_path.clone(),
        per_split_data_args_path: args.per_split_data_args_path.clone(),
        split: args.split.clone(),
    }
    .sources()
}

fn parse_sizes(text: Option<&str>) -> Result<[Option<u64>; 3]> {
    let Some(text) = text else {
        return Ok([None; 3]);
    };
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.len() != 3 {
        bail!("--num-samples {text:?} needs three comma-separated values (train,valid,test)");
    }
    let mut sizes = [None; 3];
    for (size, part) in sizes.iter_mut().zip(&parts) {
        if !part.eq_ignore_ascii_case("none") {
            *size = Some(part.parse().with_context(|| {
                format!("--num-samples {text:?}: {part:?} is not a sample count")
            })?);
        }
    }
    Ok(sizes)
}

fn summary(split: Split, dataset: &SplitDataset, printed: usize) -> String {
    let origin = |d: &GptDataset| match d.origin() {
        IndexOrigin::Loaded(dir) => format!("loaded from {}", dir.display()),
        IndexOrigin::BuiltAndCached(dir) => format!("built, cached in {}", dir.display()),
        IndexOrigin::BuiltUncached => "built, not cached".to_string(),
    };
    match dataset {
        SplitDataset::Single(d) => format!(
            "{}: printed {printed} of {} samples (indices {}, hash {})",
            split.name(),
            d.len(),
            origin(d),
            d.description_hash()
        ),
        SplitDataset::Blended(b) => format!(
            "{}: printed {printed} of {} blended samples from {} datasets",
            split.name(),
            b.len(),
            b.datasets().len()
        ),
    }
}
