//! `merge_datasets`: Megatron's `tools/merge_datasets.py`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use megatron_data::indexed::{merge_datasets, prefixes_in_directory, IndexedDataset};

/// Merge every indexed dataset (.bin/.idx pair) in a directory into one, in lexicographic
/// order of the file names, like Megatron's tools/merge_datasets.py. The result is
/// byte-identical to preprocessing the concatenated inputs in one run.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None, args_override_self = true)]
struct Args {
    /// Directory holding the .bin/.idx pairs to merge (sub-directories are ignored).
    #[arg(long)]
    input: PathBuf,
    /// Output prefix; writes {prefix}.bin and {prefix}.idx. Its directory must exist.
    #[arg(long)]
    output_prefix: PathBuf,
    /// The datasets are multimodal (carry a per-sequence mode byte).
    #[arg(long)]
    multimodal: bool,
}

fn run(args: Args) -> Result<()> {
    if !args.input.is_dir() {
        bail!("--input {}: not a directory", args.input.display());
    }
    let (prefixes, ignored) = prefixes_in_directory(&args.input)?;
    for file in &ignored {
        eprintln!(
            "warning: ignoring {} (not a .bin or .idx file)",
            file.display()
        );
    }
    if prefixes.is_empty() {
        bail!("--input {}: no .bin/.idx pairs found", args.input.display());
    }
    merge_datasets(&prefixes, &args.output_prefix, args.multimodal)
        .with_context(|| format!("merging into {}", args.output_prefix.display()))?;
    let merged = IndexedDataset::open(&args.output_prefix)?;
    println!(
        "merged {} datasets: {} documents, {} sequences, {} tokens ({}) -> {}.{{bin,idx}}",
        prefixes.len(),
        merged.document_count(),
        merged.len(),
        merged.token_count(),
        merged.dtype(),
        args.output_prefix.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    megatron_cli::run(|| run(args))
}
