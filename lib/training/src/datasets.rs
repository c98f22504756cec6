//! The train/valid/test datasets of a GPT run, and those of the masked-LM families (BERT, T5),
//! sized as Megatron sizes them (spec §4.1).

use std::sync::Arc;

use anyhow::{Context, Result};
use megatron_data::blend::{build_gpt_datasets, BlendMember, DataSources, SplitDataset};
use megatron_data::gpt::{
    GptDataset, GptDatasetConfig, MockTokenSource, SampleOptions, Split, SplitMatrix, TokenSource,
    TokenizerIdentity,
};
use megatron_data::indexed::IndexedDataset;
use megatron_data::masked::MaskedDataFlags;
use megatron_data::sft::{build_sft_splits, PromptFormat, SftRequest};
use megatron_data::tokenizer::build_tokenizer;

use crate::args::{DataArgs, PretrainArgs, TokenizerArgs};
use megatron_models::loader::{SampleSource, Splits};
use megatron_models::GptBatch;

/// Megatron's split for `--mock-data`.
const MOCK_SPLIT: &str = "1,1,1";

pub struct DatasetRequest<'a> {
    pub data: &'a DataArgs,
    pub tokenizer: &'a TokenizerArgs,
    pub seq_length: usize,
    pub seed: u64,
    /// Samples wanted per split (train, valid, test).
    pub sizes: [u64; 3],
    pub eod: i64,
    pub vocab_size: usize,
}

pub fn build_datasets(request: &DatasetRequest) -> Result<Splits<GptBatch>> {
    let data = request.data;
    if data.sft {
        return build_sft_datasets(request);
    }
    let sample = SampleOptions {
        eod_token: request.eod,
        pad_token: -1,
        reset_position_ids: data.reset_position_ids,
        reset_attention_mask: data.reset_attention_mask,
        eod_mask_loss: data.eod_mask_loss,
        // Causal masks are built by the attention kernel; with --reset-attention-mask the
        // batches carry the documents' offsets (packed sequences), never [s, s] masks.
        create_attention_mask: false,
    };
    let tokenizer = TokenizerIdentity::from_flags(request.tokenizer, 0)?;
    let sizes = request.sizes.map(Some);
    let config_for = |split: Option<String>| -> Result<Arc<GptDatasetConfig>> {
        Ok(Arc::new(GptDatasetConfig {
            random_seed: u32::try_from(request.seed)
                .context("--seed must fit in 32 bits (numpy's limit)")?,
            sequence_length: request.seq_length,
            split_matrix: split.as_deref().map(SplitMatrix::parse).transpose()?,
            split,
            path_to_cache: data.data_cache_path.clone(),
            tokenizer: tokenizer.clone(),
            add_extra_token_to_sequence: true,
            drop_last_partial_validation_sequence: true,
            mid_level_dataset_surplus: 0.005,
            sample: sample.clone(),
        }))
    };

    let built: [Option<SplitDataset>; 3] = if data.mock_data {
        let config = config_for(Some(MOCK_SPLIT.to_string()))?;
        let source: Arc<dyn TokenSource> =
            Arc::new(MockTokenSource::new(request.vocab_size, request.eod));
        let matrix = config.split_matrix.clone().expect("the mock split parses");
        let documents = source.sequence_lengths().len();
        let mut out: [Option<SplitDataset>; 3] = [None, None, None];
        for split in Split::ALL {
            if let Some(bookend) = matrix.get(split) {
                let dataset = GptDataset::new(
                    source.clone(),
                    None,
                    bookend.range(documents),
                    sizes[split.index()],
                    split,
                    config.clone(),
                )?;
                out[split.index()] = Some(SplitDataset::Single(dataset));
            }
        }
        out
    } else {
        let (sources, split) = data.paths.sources()?;
        let config = config_for(split)?;
        let open = |prefix: &str| -> Result<Arc<dyn TokenSource>> {
            let dataset = IndexedDataset::open(prefix)?;
            // An id beyond the embedding table would stop training deep inside libtorch.
            let cache = data.data_cache_path.clone().unwrap_or_else(|| {
                let parent = std::path::Path::new(prefix).parent();
                parent.unwrap_or(std::path::Path::new(".")).join("cache")
            });
            dataset.check_token_ids(request.vocab_size, Some(&cache))?;
            Ok(Arc::new(dataset))
        };
        build_gpt_datasets(&sources, sizes, config, &open)?
    };
    let [train, valid, test] = built;
    let keep = |d: Option<SplitDataset>| {
        d.filter(|d| !d.is_empty())
            .map(|d| Arc::new(d) as Arc<dyn SampleSource<Batch = GptBatch>>)
    };
    Ok(Splits {
        train: keep(train),
        valid: keep(valid),
        test: keep(test),
    })
}

/// `--sft`: the splits of a conversations file, one conversation per sample (Megatron's
/// `SFTDataset`).
fn build_sft_datasets(request: &DatasetRequest) -> Result<Splits<GptBatch>> {
    let data = request.data;
    if data.reset_attention_mask || data.reset_position_ids {
        megatron_cli::bail_usage!(
            "--sft with --reset-attention-mask or --reset-position-ids: SFT samples hold one \
             conversation each, as in Megatron, which refuses them too"
        );
    }
    let (sources, split) = data.paths.sources()?;
    let format = PromptFormat::parse(&data.sft_tokenizer_prompt_format)?;
    let tokenizer = build_tokenizer(&request.tokenizer.config()?)?;
    let built = build_sft_splits(&SftRequest {
        sources: &sources,
        split: split.as_deref(),
        sizes: request.sizes.map(Some),
        tokenizer: Arc::from(tokenizer),
        format,
        seq_length: request.seq_length,
    })?;
    let [train, valid, test] =
        built.map(|d| d.map(|d| Arc::new(d) as Arc<dyn SampleSource<Batch = GptBatch>>));
    Ok(Splits { train, valid, test })
}

/// The masking flags a masked-LM family (BERT, T5) passes to its datasets.
pub struct Masking {
    pub mask_prob: f64,
    pub short_seq_prob: f64,
    pub vocab_extra_ids: usize,
}

/// The data sources and Megatron's dataset flags of a masked-LM family: `--data-path` (or the
/// per-split paths) with `--split`, the tokenizer, `seq_length` (the encoder's for T5) and the
/// masking.
pub fn masked_data_flags(
    data: &DataArgs,
    tokenizer: &TokenizerArgs,
    seed: u32,
    seq_length: usize,
    masking: &Masking,
) -> Result<(DataSources, MaskedDataFlags)> {
    let (sources, split) = data.paths.sources()?;
    let flags = MaskedDataFlags {
        seed,
        seq_length,
        mask_prob: masking.mask_prob,
        short_seq_prob: masking.short_seq_prob,
        split,
        data_cache_path: data.data_cache_path.clone(),
        mid_level_dataset_surplus: 0.005,
        tokenizer: tokenizer.clone(),
        vocab_extra_ids: masking.vocab_extra_ids,
    };
    Ok((sources, flags))
}

/// `--sft` reads conversations into GPT samples; the masked-LM families have no use for them,
/// so `binary` refuses the flag rather than train on something else than asked.
pub fn refuse_sft(data: &DataArgs, binary: &str) -> Result<()> {
    if data.sft {
        megatron_cli::bail_usage!(
            "--sft: supervised fine-tuning data is for pretrain_gpt; {binary} trains on \
             masked-LM data (--data-path or --mock-data)"
        );
    }
    Ok(())
}

/// The train, validation and test data of a masked-LM family, sized as Megatron sizes them:
/// with `--mock-data`, the sources `mock(samples, seed)` makes (each split seeded by its offset
/// from `--seed`); else Megatron's datasets that `build` makes from the data flags.
pub fn masked_splits<B, D>(
    args: &PretrainArgs,
    sizes: [u64; 3],
    masking: &Masking,
    mock: impl Fn(u64, u64) -> Arc<dyn SampleSource<Batch = B>>,
    build: impl FnOnce(&DataSources, MaskedDataFlags) -> Result<[Option<SplitDataset<D>>; 3]>,
) -> Result<Splits<B>>
where
    D: BlendMember,
    SplitDataset<D>: SampleSource<Batch = B> + 'static,
{
    let seed =
        u32::try_from(args.training.seed).context("--seed must fit in 32 bits (numpy's limit)")?;
    if args.data.mock_data {
        let split = |samples: u64, offset: u64| {
            (samples > 0).then(|| mock(samples, u64::from(seed).wrapping_add(offset)))
        };
        return Ok(Splits {
            train: split(sizes[0], 0),
            valid: split(sizes[1], 1),
            test: split(sizes[2], 2),
        });
    }
    let (sources, flags) = masked_data_flags(
        &args.data,
        &args.tokenizer,
        seed,
        args.model.seq_length as usize,
        masking,
    )?;
    let [train, valid, test] = build(&sources, flags)?;
    let keep = |d: Option<SplitDataset<D>>| {
        d.filter(|d| !d.is_empty())
            .map(|d| Arc::new(d) as Arc<dyn SampleSource<Batch = B>>)
    };
    Ok(Splits {
        train: keep(train),
        valid: keep(valid),
        test: keep(test),
    })
}
