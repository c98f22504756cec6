//! `samples`: build (or load from cache) the GPT, BERT or T5 datasets exactly as training does
//! and print the samples of one split.

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use megatron_cli::bail_usage;
use megatron_data::blend::{build_gpt_datasets, BlendMember, DataPathFlags, SplitDataset};
use megatron_data::flags::TokenizerArgs;
use megatron_data::gpt::{
    GptDataset, GptDatasetConfig, IndexOrigin, SampleOptions, Split, SplitMatrix, TokenSource,
    TokenizerIdentity,
};
use megatron_data::indexed::IndexedDataset;
use megatron_data::masked::{
    build_bert_datasets, build_t5_datasets, open_indexed, BertMaskedWordPieceDataset, BertSample,
    MaskedDataFlags, MaskedWordPieceDataset, T5MaskedWordPieceDataset, T5Sample,
};
use megatron_data::sft::{build_sft_splits, PromptFormat, SftRequest};
use megatron_data::tokenizer::build_tokenizer;

/// The model family whose training samples are printed.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Model {
    Gpt,
    Bert,
    T5,
}

#[derive(Args)]
pub struct SamplesArgs {
    /// Whose samples: gpt (raw token windows), bert (masked pairs) or t5 (span corruption).
    #[arg(long, value_enum, default_value = "gpt")]
    model: Model,
    #[command(flatten)]
    paths: DataPathFlags,
    /// Tokens per sample (GPT: each sample holds one more, the last label; BERT: the padded
    /// length; T5: defaults to --encoder-seq-length).
    #[arg(long, required_unless_present = "encoder_seq_length")]
    seq_length: Option<usize>,
    /// T5 encoder length.
    #[arg(long)]
    encoder_seq_length: Option<usize>,
    /// T5 decoder length.
    #[arg(long)]
    decoder_seq_length: Option<usize>,
    /// BERT/T5: probability of masking a token.
    #[arg(long, default_value_t = 0.15)]
    mask_prob: f64,
    /// BERT/T5: probability of a sample shorter than the maximum.
    #[arg(long, default_value_t = 0.1)]
    short_seq_prob: f64,
    /// BERT: one segment per sample, no sentence-order swap (no binary head).
    #[arg(long)]
    bert_no_binary_head: bool,
    /// Sentinel tokens <extra_id_0>.. added to the WordPiece vocabulary (T5 uses 100).
    #[arg(long, default_value_t = 0)]
    vocab_extra_ids: usize,
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
    /// The tokenizer, named as training is given it: its flags enter the cache file names as in
    /// Megatron (GPT: recorded, not read; BERT/T5: the WordPiece vocabulary is read for the
    /// special ids and recorded).
    #[command(flatten)]
    tokenizer: TokenizerArgs,
    /// Extra fraction of samples built for each member of a weighted blend.
    #[arg(long, default_value_t = 0.005)]
    mid_level_dataset_surplus: f64,
    /// GPT: the supervised fine-tuning samples of a conversations file (--data-path
    /// FILE.jsonl), as `pretrain_gpt --sft` reads them: tokens, labels and the loss mask (1 on
    /// the assistant's turns).
    #[arg(long)]
    sft: bool,
    /// How --sft renders conversations: nemotron-h-aligned.
    #[arg(long, default_value = "nemotron-h-aligned")]
    sft_tokenizer_prompt_format: String,
}

pub fn run(args: &SamplesArgs) -> Result<()> {
    match args.model {
        Model::Gpt => run_gpt(args),
        Model::Bert | Model::T5 => run_masked(args),
    }
}

fn run_gpt(args: &SamplesArgs) -> Result<()> {
    if args.sft {
        return run_sft(args);
    }
    let split = Split::from_name(&args.split_name)?;
    let (sources, split_string) = args.paths.sources()?;
    let Some(seq_length) = args.seq_length else {
        bail_usage!("--seq-length is required");
    };
    let tokenizer = TokenizerIdentity::from_flags(&args.tokenizer, args.vocab_extra_ids)?;
    let split_matrix = split_string
        .as_deref()
        .map(SplitMatrix::parse)
        .transpose()?;
    let config = Arc::new(GptDatasetConfig {
        random_seed: args.seed,
        sequence_length: seq_length,
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
    if seq_length < 2 {
        bail_usage!("--seq-length must be at least 2");
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

/// `--sft`: each sample's tokens, labels and loss mask, one JSON object a line.
fn run_sft(args: &SamplesArgs) -> Result<()> {
    let split = Split::from_name(&args.split_name)?;
    let (sources, split_string) = args.paths.sources()?;
    let Some(seq_length) = args.seq_length else {
        bail_usage!("--seq-length is required");
    };
    let tokenizer = build_tokenizer(&args.tokenizer.config()?)?;
    let mut splits = build_sft_splits(&SftRequest {
        sources: &sources,
        split: split_string.as_deref(),
        sizes: parse_sizes(args.num_samples.as_deref())?,
        tokenizer: Arc::from(tokenizer),
        format: PromptFormat::parse(&args.sft_tokenizer_prompt_format)?,
        seq_length,
    })?;
    let Some(dataset) = splits[split.index()].take() else {
        bail!(
            "the {} split holds no conversation with this --split",
            split.name()
        );
    };
    let count = args.first.unwrap_or(usize::MAX).min(dataset.samples);
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    for idx in 0..count {
        let sample = dataset.get(idx)?;
        let loss_mask: Vec<u8> = sample
            .loss_mask
            .iter()
            .map(|&m| u8::from(m > 0.0))
            .collect();
        writeln!(
            out,
            "{{\"idx\": {idx}, \"tokens\": {}, \"labels\": {}, \"loss_mask\": {}}}",
            serde_json::to_string(&sample.tokens)?,
            serde_json::to_string(&sample.labels)?,
            serde_json::to_string(&loss_mask)?
        )?;
    }
    out.flush().context("writing samples to stdout")?;
    eprintln!(
        "{}: printed {count} of {} samples ({} conversations)",
        split.name(),
        dataset.samples,
        dataset.conversations.len()
    );
    Ok(())
}

fn run_masked(args: &SamplesArgs) -> Result<()> {
    let split = Split::from_name(&args.split_name)?;
    let (sources, split_string) = args.paths.sources()?;
    let sizes = parse_sizes(args.num_samples.as_deref())?;
    let seq_length = match args.model {
        Model::T5 => args.encoder_seq_length.or(args.seq_length),
        _ => args.seq_length,
    };
    let Some(seq_length) = seq_length else {
        bail_usage!(
            "{}",
            match args.model {
                Model::T5 => "--encoder-seq-length (or --seq-length) is required",
                _ => "--seq-length is required",
            }
        );
    };
    let flags = MaskedDataFlags {
        seed: args.seed,
        seq_length,
        mask_prob: args.mask_prob,
        short_seq_prob: args.short_seq_prob,
        split: split_string,
        data_cache_path: args.data_cache_path.clone(),
        mid_level_dataset_surplus: args.mid_level_dataset_surplus,
        tokenizer: args.tokenizer.clone(),
        vocab_extra_ids: args.vocab_extra_ids,
    };
    let stdout = std::io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let summary = if args.model == Model::Bert {
        let config = Arc::new(flags.bert(!args.bert_no_binary_head)?);
        let mut datasets = build_bert_datasets(&sources, sizes, config, &open_indexed)?;
        let dataset = take_split(&mut datasets, split)?;
        print_samples(&dataset, args.first, &mut out, |sample| {
            Ok(bert_fields(&sample))
        })?;
        masked_summary(
            split,
            &dataset,
            args.first,
            BertMaskedWordPieceDataset::base,
        )
    } else {
        let Some(decoder_seq_length) = args.decoder_seq_length else {
            bail_usage!("--model t5 needs --decoder-seq-length");
        };
        if args.vocab_extra_ids == 0 {
            bail_usage!("--model t5 needs sentinel tokens: pass --vocab-extra-ids N (usually 100)");
        }
        let config = Arc::new(flags.t5(decoder_seq_length)?);
        let mut datasets = build_t5_datasets(&sources, sizes, config, &open_indexed)?;
        let dataset = take_split(&mut datasets, split)?;
        print_samples(&dataset, args.first, &mut out, |sample| {
            Ok(t5_fields(&sample?))
        })?;
        masked_summary(split, &dataset, args.first, T5MaskedWordPieceDataset::base)
    };
    out.flush().context("writing samples to stdout")?;
    eprintln!("{summary}");
    Ok(())
}

fn take_split<D: BlendMember>(
    datasets: &mut [Option<SplitDataset<D>>; 3],
    split: Split,
) -> Result<SplitDataset<D>> {
    datasets[split.index()].take().with_context(|| {
        format!(
            "the {} split is empty with these data paths and --split",
            split.name()
        )
    })
}

/// Prints the first `first` samples as JSON lines: `idx`, the model's fields, and
/// `dataset_id` for blends.
fn print_samples<D: BlendMember>(
    dataset: &SplitDataset<D>,
    first: Option<usize>,
    out: &mut impl Write,
    fields: impl Fn(D::Sample) -> Result<String>,
) -> Result<()> {
    let count = first.unwrap_or(usize::MAX).min(dataset.len());
    for idx in 0..count {
        let (member, sample) = dataset.get(idx);
        let member = member.map_or(String::new(), |m| format!(", \"dataset_id\": {m}"));
        writeln!(out, "{{\"idx\": {idx}, {}{member}}}", fields(sample)?)?;
    }
    Ok(())
}

fn json_field(name: &str, values: &[i64]) -> String {
    format!(
        "\"{name}\": {}",
        serde_json::to_string(values).expect("integers serialise")
    )
}

fn bert_fields(sample: &BertSample) -> String {
    [
        json_field("text", &sample.text),
        json_field("types", &sample.types),
        json_field("labels", &sample.labels),
        format!("\"is_random\": {}", u8::from(sample.is_random)),
        json_field("padding_mask", &sample.padding_mask),
        json_field("loss_mask", &sample.loss_mask),
        format!("\"truncated\": {}", u8::from(sample.truncated)),
    ]
    .join(", ")
}

fn t5_fields(sample: &T5Sample) -> String {
    [
        json_field("text_enc", &sample.text_enc),
        json_field("text_dec", &sample.text_dec),
        json_field("labels", &sample.labels),
        json_field("loss_mask", &sample.loss_mask),
        format!("\"truncated\": {}", u8::from(sample.truncated)),
        json_field("enc_mask", &sample.enc_mask),
        json_field("dec_mask", &sample.dec_mask),
    ]
    .join(", ")
}

fn masked_summary<D: BlendMember>(
    split: Split,
    dataset: &SplitDataset<D>,
    first: Option<usize>,
    base: fn(&D) -> &MaskedWordPieceDataset,
) -> String {
    let printed = first.unwrap_or(usize::MAX).min(dataset.len());
    match dataset {
        SplitDataset::Single(d) => {
            let base = base(d);
            format!(
                "{}: printed {printed} of {} samples (sample index {}, hash {})",
                split.name(),
                base.len(),
                origin(base.origin()),
                base.description_hash()
            )
        }
        SplitDataset::Blended(b) => format!(
            "{}: printed {printed} of {} blended samples from {} datasets",
            split.name(),
            b.len(),
            b.datasets().len()
        ),
    }
}

fn origin(origin: &IndexOrigin) -> String {
    match origin {
        IndexOrigin::Loaded(dir) => format!("loaded from {}", dir.display()),
        IndexOrigin::BuiltAndCached(dir) => format!("built, cached in {}", dir.display()),
        IndexOrigin::BuiltUncached => "built, not cached".to_string(),
    }
}

fn parse_sizes(text: Option<&str>) -> Result<[Option<u64>; 3]> {
    let Some(text) = text else {
        return Ok([None; 3]);
    };
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.len() != 3 {
        bail_usage!("--num-samples {text:?} needs three comma-separated values (train,valid,test)");
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
    let origin = |d: &GptDataset| origin(d.origin());
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
