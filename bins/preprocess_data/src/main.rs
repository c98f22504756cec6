//! `preprocess_data`: Megatron's `tools/preprocess_data.py` flags and outputs, in one pass.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use megatron_data::preprocess::{
    expand_inputs, input_size, preprocess, Encoder, PreprocessOptions, Progress, Summary,
};
use megatron_data::sentence::{
    download_punkt_tab, find_punkt_dir, nltk_download_root, PunktParameters, SentenceError,
    SentenceSplitter,
};
use megatron_data::tokenizer::{build_tokenizer, TikTokenOptions, TokenizerConfig, TokenizerType};

/// Tokenize loose JSON (one object per line) into Megatron indexed datasets
/// `{output-prefix}_{key}_{document|sentence}.bin/.idx`, byte-identical to Megatron's
/// tools/preprocess_data.py. Unlike Megatron, --split-sentences needs a single run (no
/// intermediate `_ss` file is written).
#[derive(Parser, Debug)]
#[command(version, about, long_about = None, args_override_self = true)]
struct Args {
    /// Input JSONL: files, glob patterns, or `-` for standard input; gzip and zstd input is
    /// detected and decompressed. Lines are processed in the order given.
    #[arg(long, required = true, num_args = 1..)]
    input: Vec<String>,
    /// JSON keys to extract; each key gets its own output pair.
    #[arg(long, num_args = 1.., default_value = "text")]
    json_keys: Vec<String>,
    /// Split each text into sentences with NLTK's Punkt (English parameters from punkt_tab).
    #[arg(long)]
    split_sentences: bool,
    /// With --split-sentences: keep the whitespace (newlines included) after each sentence.
    #[arg(long)]
    keep_newlines: bool,
    /// Tokenizer: GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase,
    /// HuggingFaceTokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer,
    /// Llama2Tokenizer, TikTokenizer or NullTokenizer.
    #[arg(long)]
    tokenizer_type: TokenizerType,
    /// Vocabulary: GPT-2 encoder JSON or BERT vocab.txt.
    #[arg(long)]
    vocab_file: Option<PathBuf>,
    /// GPT-2 BPE merges file.
    #[arg(long)]
    merge_file: Option<PathBuf>,
    /// HuggingFaceTokenizer: a tokenizer.json, or a directory holding tokenizer.json (and
    /// optionally tokenizer_config.json naming the eos_token); SentencePiece tokenizers: the
    /// `.model` file; TikTokenizer: Megatron's tiktoken JSON vocabulary.
    #[arg(long)]
    tokenizer_model: Option<PathBuf>,
    /// NullTokenizer: largest token id + 1; the end-of-document id is this value.
    /// TikTokenizer: the whole vocabulary, special tokens included (default 131072).
    #[arg(long)]
    vocab_size: Option<u32>,
    /// TikTokenizer: pre-tokenization pattern, v1 or v2 (Megatron's PATTERN_TIKTOKEN(_V2)).
    #[arg(long, default_value = "v2")]
    tiktoken_pattern: String,
    /// TikTokenizer: ids reserved for special tokens in front of the BPE ranks.
    #[arg(long, default_value_t = 1000)]
    tiktoken_num_special_tokens: usize,
    /// TikTokenizer: the special tokens (must include <unk>, <s>, </s>; default exactly those).
    #[arg(long, num_args = 1..)]
    tiktoken_special_tokens: Option<Vec<String>>,
    /// BERT: wrap every sequence in [CLS] ... [SEP] and use [SEP] as end of document, like
    /// Megatron's 2026 HuggingFace-backed tokenizers (default: the classic tokenizer).
    #[arg(long)]
    tokenizer_hf_include_special_tokens: bool,
    /// Append the end-of-document token to every document that produced tokens.
    #[arg(long)]
    append_eod: bool,
    /// Punkt language (the punkt_tab/<lang> directory name).
    #[arg(long, default_value = "english")]
    lang: String,
    /// Directory with the Punkt parameters (abbrev_types.txt, collocations.tab,
    /// sent_starters.txt, ortho_context.tab); default: NLTK's search path
    /// ($NLTK_DATA, ~/nltk_data, /usr/share/nltk_data, ...) under tokenizers/punkt_tab/<lang>.
    #[arg(long)]
    punkt_dir: Option<PathBuf>,
    /// Output prefix; outputs are {prefix}_{key}_{document|sentence}.bin/.idx.
    #[arg(long)]
    output_prefix: PathBuf,
    /// Encoder threads (default: all available cores).
    #[arg(long)]
    workers: Option<usize>,
    /// Megatron's partitions: with N > 1 documents are dealt round-robin to N partitions that
    /// are concatenated in order (Megatron's output order); parallelism comes from --workers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    partitions: u64,
    /// With --partitions: keep the input order (contiguous partitions).
    #[arg(long)]
    keep_sequential_samples: bool,
    /// Print a progress line every this many documents when stderr is not a terminal.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    log_interval: u64,
    /// Skip malformed lines (bad JSON, missing key, wrong type), count them and report the
    /// count, instead of stopping at the first one.
    #[arg(long)]
    skip_invalid: bool,
}

fn build_encoder(args: &Args) -> Result<Encoder> {
    let tokenizer = build_tokenizer(&TokenizerConfig {
        kind: args.tokenizer_type,
        vocab_file: args.vocab_file.clone(),
        merge_file: args.merge_file.clone(),
        tokenizer_model: args.tokenizer_model.clone(),
        vocab_size: args.vocab_size,
        tiktoken: TikTokenOptions {
            pattern: args.tiktoken_pattern.clone(),
            num_special_tokens: args.tiktoken_num_special_tokens,
            special_tokens: args.tiktoken_special_tokens.clone(),
            ..Default::default()
        },
        include_special_tokens: args.tokenizer_hf_include_special_tokens,
    })
    .context("building the tokenizer")?;
    let splitter = if args.split_sentences {
        let dir = match find_punkt_dir(args.punkt_dir.as_deref(), &args.lang) {
            Ok(dir) => dir,
            Err(missing) if args.punkt_dir.is_none() => download_punkt(&args.lang, missing)?,
            Err(missing) => return Err(missing.into()),
        };
        let params = PunktParameters::load(&dir).context("loading the Punkt sentence splitter")?;
        Some(SentenceSplitter::new(params, args.keep_newlines))
    } else {
        if args.tokenizer_type.is_bert() {
            eprintln!("warning: a BERT tokenizer is normally used with --split-sentences");
        }
        None
    };
    Ok(Encoder::new(tokenizer, splitter, args.append_eod)?)
}

/// NLTK's `punkt_tab` fetched as Megatron's `nltk.download` does, with a progress bar; without
/// network the answer is the message of the search that failed, with the download's reason.
fn download_punkt(lang: &str, missing: SentenceError) -> Result<PathBuf> {
    let Some(root) = nltk_download_root() else {
        return Err(missing.into());
    };
    eprintln!(
        "preprocess_data: downloading NLTK's punkt_tab into {}",
        root.join("tokenizers").display()
    );
    let bar = megatron_cli::byte_progress_bar(0);
    let downloaded = download_punkt_tab(&root, lang, &mut |received, total| {
        if let Some(total) = total {
            bar.set_length(total);
        }
        bar.set_position(received);
    });
    bar.finish_and_clear();
    downloaded.map_err(|reason| anyhow::anyhow!("{missing}; downloading them failed: {reason}"))
}

/// Documents and text per second since the start, for the log lines and the summary.
fn rate_line(documents: u64, text_bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!(
        "{:.1} docs/s, {:.2} MB/s",
        documents as f64 / secs,
        text_bytes as f64 / secs / 1024.0 / 1024.0
    )
}

fn summary_line(s: &Summary) -> String {
    let outputs: Vec<String> = s
        .outputs
        .iter()
        .map(|p| format!("{}.{{bin,idx}}", p.display()))
        .collect();
    format!(
        "processed {} documents ({} skipped), {} sequences, {} tokens ({}) in {:.2}s ({}) -> {}",
        s.documents,
        s.skipped,
        s.sequences,
        s.tokens,
        s.dtype,
        s.elapsed.as_secs_f64(),
        rate_line(s.documents, s.bytes, s.elapsed),
        outputs.join(", ")
    )
}

fn run(args: Args) -> Result<()> {
    let encoder = build_encoder(&args)?;
    let inputs = expand_inputs(&args.input)?;
    let workers = args
        .workers
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let options = PreprocessOptions {
        inputs,
        json_keys: args.json_keys.clone(),
        output_prefix: args.output_prefix.clone(),
        workers,
        partitions: args.partitions as usize,
        keep_sequential_samples: args.keep_sequential_samples,
        skip_invalid: args.skip_invalid,
    };
    // Files have a size to measure the run against; standard input only a count.
    let total = input_size(&options.inputs);
    let bar = match total {
        Some(bytes) => megatron_cli::byte_progress_bar(bytes),
        None => megatron_cli::spinner("docs"),
    };
    let mut next_log = args.log_interval;
    let summary = preprocess(&options, &encoder, |p: &Progress| {
        if total.is_some() {
            bar.set_position(p.input_bytes);
            bar.set_message(format!("{} docs", p.documents));
        } else {
            bar.set_position(p.documents);
        }
        if bar.is_hidden() && p.documents >= next_log {
            eprintln!(
                "Processed {} documents ({}).",
                p.documents,
                rate_line(p.documents, p.bytes, p.elapsed)
            );
            next_log = (p.documents / args.log_interval + 1) * args.log_interval;
        }
    })?;
    bar.finish_and_clear();
    println!("{}", summary_line(&summary));
    if summary.skipped > 0 {
        eprintln!(
            "warning: {} invalid lines were skipped (--skip-invalid)",
            summary.skipped
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    megatron_cli::run(|| run(args))
}
