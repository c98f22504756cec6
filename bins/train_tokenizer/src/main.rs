//! `train_tokenizer`: a byte-level BPE tokenizer for `--tokenizer-type GPT2BPETokenizer`,
//! trained on the same loose JSON that `preprocess_data` reads.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Parser;
use megatron_cli::bail_usage;
use megatron_data::preprocess::expand_inputs;
use megatron_data::tokenizer::{read_texts, train_byte_level_bpe, BpeTrainingOptions, END_OF_TEXT};

/// Train a GPT-2 style byte-level BPE tokenizer on loose JSON and write it as
/// {prefix}-vocab.json and {prefix}-merges.txt, the --vocab-file/--merge-file pair that
/// `preprocess_data`, `pretrain_gpt` and Megatron's GPT2BPETokenizer load. The vocabulary holds
/// the 256 byte symbols, <|endoftext|> (the end-of-document token) and the learned merges.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Args {
    /// Loose JSON input: files, globs (sorted), or - for stdin; gzip and zstd are detected.
    #[arg(long, num_args = 1.., required = true)]
    input: Vec<String>,
    /// Keys of each JSON line whose texts are trained on.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// Size of the final vocabulary (at least 257: the bytes and <|endoftext|>).
    #[arg(long, default_value_t = 50257)]
    vocab_size: usize,
    /// Pairs seen fewer times than this are never merged.
    #[arg(long, default_value_t = 2)]
    min_frequency: u64,
    /// Output prefix: writes {prefix}-vocab.json and {prefix}-merges.txt.
    #[arg(long)]
    output_prefix: PathBuf,
}

fn run(args: Args) -> Result<()> {
    if args.vocab_size <= 256 {
        bail_usage!(
            "--vocab-size {} leaves no room for <|endoftext|> beside the 256 bytes",
            args.vocab_size
        );
    }
    let inputs = expand_inputs(&args.input)?;
    let spinner = megatron_cli::spinner("documents");
    spinner.set_message("reading");
    let texts = read_texts(&inputs, &args.json_keys)?;
    spinner.set_position(texts.len() as u64);
    spinner.set_message("training");
    let options = BpeTrainingOptions {
        vocab_size: args.vocab_size,
        min_frequency: args.min_frequency,
    };
    let trained = train_byte_level_bpe(&texts, &options, &args.output_prefix)
        .with_context(|| format!("training a tokenizer for {}", args.output_prefix.display()))?;
    spinner.finish_and_clear();
    println!(
        "train_tokenizer: {} documents, {} tokens ({END_OF_TEXT} included) -> {}, {}",
        trained.documents,
        trained.vocab_size,
        trained.vocab_file.display(),
        trained.merge_file.display()
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    megatron_cli::run(|| run(args))
}
