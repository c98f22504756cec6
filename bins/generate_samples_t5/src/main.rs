//! `generate_samples_t5`: what a trained T5 learned. `score` runs the decoder teacher-forced
//! over the T5 data's samples and reports each sample's loss and token accuracy as training
//! counts them; `decode` fills the sentinel spans of data samples or of `--input` texts by
//! greedy decoding. The architecture comes from the checkpoint's metadata.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use megatron_cli::bail_usage;
use megatron_data::blend::{DataPathFlags, SplitDataset};
use megatron_data::flags::{DataArgs, TokenizerArgs};
use megatron_data::gpt::Split;
use megatron_data::masked::{MaskedTokenizer, T5MaskedWordPieceDataset, T5Sample};
use megatron_inference::CheckpointModelArgs;
use megatron_inference::{
    encode_with_sentinels, greedy_decode, score_t5_batch, GreedyOptions, ScoreTotals, T5Decoding,
};
use megatron_models::loader::DeviceBatch;
use megatron_models::T5Batch;
use megatron_models::T5Model;
use megatron_parallel::{Job, ParallelState};
use megatron_training::{t5_split_dataset, Masking, T5DataRequest};
use tch::{Device, Kind, Tensor};

/// Look into a T5 checkpoint trained by pretrain_t5: `score` gives the teacher-forced decoder
/// loss (masked, averaged over target tokens as in training) and token accuracy of the T5
/// data's samples; `decode` fills the masked spans of data samples, or of --input texts with
/// sentinels such as <extra_id_0>, by greedy decoding. Pass the data and tokenizer flags as
/// pretrain_t5 was given them; the architecture comes from the checkpoint (Megatron's model
/// flags are accepted and checked against it). Under torchrun with
/// --tensor-model-parallel-size N the model is split over N processes.
#[derive(Parser)]
#[command(version, long_about = None, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Teacher-forced loss and token accuracy of T5 data samples, per sample and in total.
    Score(ScoreArgs),
    /// Greedy decoding of the masked spans of T5 data samples or of --input texts.
    Decode(DecodeArgs),
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    common: Common,
    /// Samples to score: the first N of the split.
    #[arg(long, default_value_t = 100)]
    num_samples: u64,
}

#[derive(Args)]
struct DecodeArgs {
    #[command(flatten)]
    common: Common,
    /// A text to fill, with sentinels <extra_id_0>, <extra_id_1>, ... marking the masked spans;
    /// repeat for several. Without it, data samples are decoded.
    #[arg(long)]
    input: Vec<String>,
    /// Data samples to decode without --input: the first N of the split.
    #[arg(long, default_value_t = 8)]
    num_samples: u64,
    /// Tokens to decode at most per input [default: --decoder-seq-length, else 64 or the
    /// model's positions if fewer].
    #[arg(long)]
    max_decode_length: Option<usize>,
    /// Token id that ends decoding [default: the tokenizer's [EOS]].
    #[arg(long)]
    eos: Option<i64>,
    /// Token id the decoder starts from [default: the tokenizer's [BOS], as in the T5 data].
    #[arg(long)]
    bos: Option<i64>,
}

#[derive(Args)]
struct Common {
    #[command(flatten)]
    model: CheckpointModelArgs,
    /// Checked against the checkpoint.
    #[arg(long, help_heading = "Architecture (checked against the checkpoint)")]
    decoder_num_layers: Option<usize>,
    #[command(flatten, next_help_heading = "Tokenizer")]
    tokenizer: TokenizerArgs,
    /// Sentinel tokens <extra_id_0>.. appended to the WordPiece vocabulary, as in training.
    #[arg(long, default_value_t = 0, help_heading = "Tokenizer")]
    vocab_extra_ids: usize,
    #[command(flatten, next_help_heading = "Data")]
    data: DataFlags,
    /// Print one JSON object per sample instead of text (the summary then goes to stderr).
    #[arg(long)]
    jsonl: bool,
}

#[derive(Args)]
struct DataFlags {
    /// Sentence data (preprocess_data --split-sentences).
    #[command(flatten)]
    paths: DataPathFlags,
    /// Where the sample indices are cached [default: beside each dataset].
    #[arg(long)]
    data_cache_path: Option<PathBuf>,
    /// Which split's samples: train, valid or test.
    #[arg(long, default_value = "valid")]
    split_name: String,
    /// Maximum decoder sequence length of the samples, as in training.
    #[arg(long)]
    decoder_seq_length: Option<usize>,
    /// Probability of masking a token, as in training.
    #[arg(long, default_value_t = 0.15)]
    mask_prob: f64,
    /// Probability of a sample shorter than the encoder length, as in training.
    #[arg(long, default_value_t = 0.1)]
    short_seq_prob: f64,
}

impl DataFlags {
    /// The training binaries' data flags for these paths (no mock data, no GPT-only options),
    /// so the samples come from the same dataset code as pretrain_t5's.
    fn data_args(&self) -> DataArgs {
        DataArgs {
            paths: self.paths.clone(),
            mock_data: false,
            data_cache_path: self.data_cache_path.clone(),
            reset_position_ids: false,
            reset_attention_mask: false,
            eod_mask_loss: false,
            sft: false,
            sft_tokenizer_prompt_format: "nemotron-h-aligned".into(),
            num_workers: 0,
            dataloader_type: "single".into(),
        }
    }
}

/// Megatron's T5 spellings and defaults on a subcommand's flags: `--encoder-num-layers` and
/// `--encoder-seq-length` name `--num-layers` and `--seq-length`, and the tokenizer defaults to
/// BertWordPieceLowerCase as in `pretrain_t5.py`. A flag given twice takes its last value.
fn t5_spellings(command: clap::Command) -> clap::Command {
    command
        .args_override_self(true)
        .mut_arg("num_layers", |arg| {
            arg.visible_alias("encoder-num-layers")
                .help("Checked against the checkpoint (the encoder's depth)")
        })
        .mut_arg("seq_length", |arg| {
            arg.visible_alias("encoder-seq-length")
                .help("Encoder sequence length of the data samples, as in training")
        })
        .mut_arg("tokenizer_type", |arg| {
            arg.default_value("BertWordPieceLowerCase")
        })
        // HuggingFace imports are GPTs.
        .mut_arg("load_hf", |arg| arg.hide(true))
}

fn main() -> ExitCode {
    let command = Cli::command()
        .mut_subcommand("score", t5_spellings)
        .mut_subcommand("decode", t5_spellings);
    let matches = command.get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    megatron_cli::run(|| match &cli.command {
        Command::Score(args) => score(args),
        Command::Decode(args) => decode(args),
    })
}

/// The launched job, the model for this rank and the tokenizer the model was trained with.
struct Loaded {
    job: Job,
    parallel: ParallelState,
    device: Device,
    model: T5Model,
    tokenizer: MaskedTokenizer,
}

impl Loaded {
    fn finish(self) -> Result<()> {
        drop(self.model);
        drop(self.parallel);
        self.job.finish()
    }
}

fn load(common: &Common) -> Result<Loaded> {
    common.model.print_ignored_flag_notes("generate_samples_t5");
    let (job, parallel, device) = common.model.join_job()?;
    let config = common.model.checked_t5_config()?;
    if let Some(layers) = common.decoder_num_layers {
        if layers != config.decoder_num_layers {
            bail!(
                "--decoder-num-layers {layers} does not match the checkpoint ({}); drop the flag \
                 or load the right checkpoint",
                config.decoder_num_layers
            );
        }
    }
    if common.vocab_extra_ids == 0 {
        bail_usage!("T5 needs its sentinel tokens: pass --vocab-extra-ids as in training (the T5 example uses 100)");
    }
    let tokenizer = MaskedTokenizer::from_flags(&common.tokenizer, common.vocab_extra_ids)?;
    let vocab_size = tokenizer.tokenizer.vocab_size();
    if vocab_size as i64 != config.transformer.vocab_size {
        bail!(
            "the tokenizer has {vocab_size} tokens (--tokenizer-type {} with --vocab-extra-ids {}) \
             but the checkpoint was trained with {}",
            common.tokenizer.tokenizer_type,
            common.vocab_extra_ids,
            config.transformer.vocab_size
        );
    }
    let model = common.model.load_t5_model(device, &parallel)?;
    Ok(Loaded {
        job,
        parallel,
        device,
        model,
        tokenizer,
    })
}

/// The first `num_samples` samples' split of the T5 data, built as pretrain_t5 builds it.
fn dataset(
    common: &Common,
    model: &T5Model,
    num_samples: u64,
) -> Result<SplitDataset<T5MaskedWordPieceDataset>> {
    let flags = &common.data;
    if num_samples == 0 {
        bail_usage!("--num-samples must be at least 1");
    }
    let encoder_seq_length = common
        .model
        .seq_length
        .context("the data samples need --encoder-seq-length (as in training)")?;
    let decoder_seq_length = flags
        .decoder_seq_length
        .context("the data samples need --decoder-seq-length (as in training)")?;
    let positions = model.config.transformer.max_position_embeddings;
    if decoder_seq_length as i64 > positions {
        bail!("--decoder-seq-length {decoder_seq_length} exceeds the checkpoint's --max-position-embeddings {positions}");
    }
    let data = flags.data_args();
    t5_split_dataset(&T5DataRequest {
        data: &data,
        tokenizer: &common.tokenizer,
        seed: common.model.seed,
        encoder_seq_length,
        decoder_seq_length,
        masking: Masking {
            mask_prob: flags.mask_prob,
            short_seq_prob: flags.short_seq_prob,
            vocab_extra_ids: common.vocab_extra_ids,
        },
        num_samples,
        split: Split::from_name(&flags.split_name)?,
    })
}

fn micro_batch_size(common: &Common) -> usize {
    common.model.micro_batch_size.unwrap_or(8)
}

/// Samples `range` of `dataset`.
fn samples(
    dataset: &SplitDataset<T5MaskedWordPieceDataset>,
    range: std::ops::Range<usize>,
) -> Result<Vec<T5Sample>> {
    range.map(|i| dataset.get(i).1).collect()
}

fn score(args: &ScoreArgs) -> Result<()> {
    let common = &args.common;
    let loaded = load(common)?;
    let dataset = dataset(common, &loaded.model, args.num_samples)?;
    let count = (args.num_samples as usize).min(dataset.len());
    let print = loaded.parallel.is_logging_rank();
    let batch_size = micro_batch_size(common);
    let bar = print.then(|| {
        megatron_cli::progress_bar(count.div_ceil(batch_size) as u64, "batches of samples")
    });
    let mut out = std::io::stdout().lock();
    if print && !common.jsonl {
        writeln!(
            out,
            "{:>8} {:>8} {:>10} {:>9}",
            "sample", "targets", "lm loss", "accuracy"
        )?;
    }
    let mut totals = ScoreTotals::default();
    for start in (0..count).step_by(batch_size) {
        let rows = samples(&dataset, start..(start + batch_size).min(count))?;
        let batch = T5Batch::collate(&rows)?.to_device(loaded.device);
        let scores = score_t5_batch(&loaded.model, &batch)?;
        for (offset, score) in scores.iter().enumerate() {
            totals.add(score);
            if !print {
                continue;
            }
            let idx = start + offset;
            let line = if common.jsonl {
                serde_json::json!({
                    "idx": idx,
                    "tokens": score.tokens,
                    "loss": score.loss(),
                    "loss_sum": score.loss_sum,
                    "correct": score.correct,
                    "accuracy": score.accuracy(),
                })
                .to_string()
            } else {
                format!(
                    "{idx:>8} {:>8} {:>10.4} {:>9.4}",
                    score.tokens,
                    score.loss(),
                    score.accuracy()
                )
            };
            match &bar {
                Some(bar) => bar.suspend(|| writeln!(out, "{line}"))?,
                None => writeln!(out, "{line}")?,
            }
        }
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if print {
        let line = totals.line(&common.data.split_name);
        if common.jsonl {
            eprintln!("{line}");
        } else {
            writeln!(out, "{line}")?;
        }
    }
    out.flush()?;
    loaded.finish()
}

/// An encoder input to decode: its real tokens and, for data samples, the masked spans.
struct Input {
    encoder: Vec<i64>,
    target: Option<Vec<i64>>,
}

fn decode(args: &DecodeArgs) -> Result<()> {
    let common = &args.common;
    let loaded = load(common)?;
    let tokenizer = &loaded.tokenizer;
    let positions = loaded.model.config.transformer.max_position_embeddings;
    let inputs: Vec<Input> = if !args.input.is_empty() {
        args.input
            .iter()
            .map(|text| {
                let encoder = encode_with_sentinels(tokenizer, text)
                    .with_context(|| format!("--input {text:?}"))?;
                if encoder.len() as i64 > positions {
                    bail!(
                        "--input {text:?} has {} tokens, more than the model's {positions} positions",
                        encoder.len()
                    );
                }
                Ok(Input {
                    encoder,
                    target: None,
                })
            })
            .collect::<Result<_>>()?
    } else if !common.data.paths.any() {
        bail_usage!("give texts to fill with --input, or data samples with --data-path");
    } else {
        let dataset = dataset(common, &loaded.model, args.num_samples)?;
        let count = (args.num_samples as usize).min(dataset.len());
        samples(&dataset, 0..count)?
            .into_iter()
            .map(|sample| {
                let real = |mask: &[i64]| mask.iter().filter(|&&m| m != 0).count();
                let encoder = sample.text_enc[..real(&sample.enc_mask)].to_vec();
                // The targets end in [EOS], which is not shown.
                let targets = real(&sample.loss_mask).saturating_sub(1);
                Input {
                    encoder,
                    target: Some(sample.labels[..targets].to_vec()),
                }
            })
            .collect()
    };
    let max_decode_length = args
        .max_decode_length
        .or(common.data.decoder_seq_length)
        .unwrap_or_else(|| 64.min(positions as usize));
    let options = GreedyOptions {
        max_decode_length,
        bos: args
            .bos
            .or(tokenizer.vocab.bos)
            .context("the tokenizer has no [BOS]: give --bos")?,
        eos: args.eos.or(tokenizer.vocab.eos),
    };
    let pad = tokenizer.vocab.pad;
    let print = loaded.parallel.is_logging_rank();
    let mut out = std::io::stdout().lock();
    let (mut decoded_tokens, mut exact) = (0, 0);
    let batch_size = micro_batch_size(common);
    let bar = print.then(|| {
        megatron_cli::progress_bar(
            inputs.len().div_ceil(batch_size) as u64,
            "batches of inputs",
        )
    });
    for chunk in inputs.chunks(batch_size) {
        let (tokens, mask) = padded(chunk, pad, loaded.device);
        let decoded = greedy_decode(&loaded.model, &tokens, &mask, &options)?;
        for (input, decoded) in chunk.iter().zip(&decoded) {
            decoded_tokens += decoded.len();
            let decoding =
                T5Decoding::new(tokenizer, &input.encoder, decoded, input.target.as_deref())?;
            exact += usize::from(decoding.exact == Some(true));
            if print {
                let text = if common.jsonl {
                    serde_json::to_string(&decoding)?
                } else {
                    decoding.text()
                };
                match &bar {
                    Some(bar) => bar.suspend(|| writeln!(out, "{text}"))?,
                    None => writeln!(out, "{text}")?,
                }
            }
        }
        if let Some(bar) = &bar {
            bar.inc(1);
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if print {
        let mut line = format!(
            "generate_samples_t5: decoded {} inputs, {decoded_tokens} tokens",
            inputs.len()
        );
        if args.input.is_empty() {
            line.push_str(&format!(
                ", {exact} of {} equal to the masked spans",
                inputs.len()
            ));
        }
        if common.jsonl {
            eprintln!("{line}");
        } else {
            writeln!(out, "{line}")?;
        }
    }
    out.flush()?;
    loaded.finish()
}

/// The encoder inputs of `chunk` padded to the longest, and their padding mask.
fn padded(chunk: &[Input], pad: i64, device: Device) -> (Tensor, Tensor) {
    let length = chunk.iter().map(|i| i.encoder.len()).max().unwrap_or(1);
    let mut tokens = Vec::with_capacity(chunk.len() * length);
    let mut mask = Vec::with_capacity(chunk.len() * length);
    for input in chunk {
        let real = input.encoder.len();
        tokens.extend(&input.encoder);
        tokens.extend(std::iter::repeat_n(pad, length - real));
        mask.extend((0..length).map(|i| i64::from(i < real)));
    }
    let shape = [chunk.len() as i64, length as i64];
    (
        Tensor::from_slice(&tokens).view(shape).to(device),
        Tensor::from_slice(&mask)
            .view(shape)
            .to_kind(Kind::Int64)
            .to(device),
    )
}
