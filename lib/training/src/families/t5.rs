//! T5 on the training engine (`pretrain_t5`): the encoder-decoder, its token-averaged `lm loss`
//! over the decoder's targets (as GPT's) and Megatron's T5 datasets. T5 runs without pipeline
//! parallelism.

use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use clap::{Args, Command};
use megatron_data::blend::SplitDataset;
use megatron_data::gpt::Split;
use megatron_data::masked::{
    build_t5_datasets, open_indexed, MaskedTokenizer, T5MaskedWordPieceDataset,
};
use megatron_data::tokenizer::build_tokenizer;
use tch::Tensor;

use super::family::{LossTotals, ModelFamily, StepOutput};
use crate::args::{DataArgs, PretrainArgs, TokenizerArgs};
use crate::datasets::{masked_data_flags, masked_splits, refuse_sft, Masking};
use crate::engine::{pretrain, TrainingSummary};
use crate::flops::FlopsModel;
use megatron_models::loader::{SampleSource, Splits};
use megatron_models::t5::{MockT5Source, T5Args, T5Batch, T5Config, T5Input, T5Model};
use megatron_models::{ChunkSpec, ModelOptions, TransformerConfig};
use megatron_parallel::ParallelState;
use megatron_parallel::Placement;

/// Every flag of `pretrain_t5`: the common pretraining flags and T5's.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct T5PretrainArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: PretrainArgs,
    #[command(flatten, next_help_heading = "T5")]
    #[serde(flatten)]
    pub t5: T5Args,
}

/// T5's spelling of the trunk's flags on a parser holding [`T5PretrainArgs`]: Megatron's
/// `--encoder-num-layers` and `--encoder-seq-length` name the trunk's `--num-layers` and
/// `--seq-length` (either spelling works), and the tokenizer defaults to
/// BertWordPieceLowerCase as in `pretrain_t5.py`.
pub fn t5_flags(command: Command) -> Command {
    command
        .mut_arg("num_layers", |arg| {
            arg.visible_alias("encoder-num-layers")
                .help("Encoder layers (also the decoder's without --decoder-num-layers)")
        })
        .mut_arg("seq_length", |arg| {
            arg.visible_alias("encoder-seq-length")
                .help("Maximum encoder sequence length")
        })
        .mut_arg("tokenizer_type", |arg| {
            arg.default_value("BertWordPieceLowerCase")
        })
}

impl T5PretrainArgs {
    /// The architecture for a tokenizer of `vocab_size` tokens (sentinels included).
    pub fn t5_config(&self, vocab_size: i64) -> Result<T5Config> {
        self.common.model.moe.refuse_for("T5")?;
        self.t5.config(self.common.model.gpt_config(vocab_size)?)
    }
}

pub struct T5Family {
    pub config: T5Config,
    pub decoder_seq_length: usize,
    /// `--vocab-extra-ids`, `--mask-prob` and `--short-seq-prob` of the datasets.
    pub vocab_extra_ids: usize,
    pub mask_prob: f64,
    pub short_seq_prob: f64,
    /// `--cross-entropy-loss-fusion`.
    pub cross_entropy_loss_fusion: bool,
}

impl ModelFamily for T5Family {
    type Chunk = T5Model;
    type Batch = T5Batch;

    fn transformer(&self) -> &TransformerConfig {
        &self.config.transformer
    }

    fn build_chunk(
        &self,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<T5Model> {
        ensure!(
            spec.pre_process && spec.post_process,
            "pretrain_t5 does not support pipeline parallelism (--pipeline-model-parallel-size must be 1)"
        );
        T5Model::new(self.config.clone(), options, parallel)
    }

    fn loss_names(&self) -> &'static [&'static str] {
        &["lm loss"]
    }

    fn forward_step(
        &self,
        chunk: &T5Model,
        batch: &T5Batch,
        input: Option<&Tensor>,
        train: bool,
        losses: &mut LossTotals,
    ) -> Result<StepOutput> {
        ensure!(input.is_none(), "T5 runs on one pipeline stage");
        let head = chunk.forward_to_head(
            &T5Input {
                encoder_tokens: &batch.text_enc,
                decoder_tokens: &batch.text_dec,
                encoder_mask: &batch.enc_mask,
            },
            train,
        )?;
        // Padding carries label -1 and loss mask 0; the lookup needs a valid index.
        let labels = batch.labels.clamp_min(0);
        let masked_sum =
            head.masked_loss_sum(&labels, &batch.loss_mask, self.cross_entropy_loss_fusion)?;
        let tokens = batch.num_tokens();
        losses.add(0, &masked_sum, &tokens);
        // As GPT: each micro-batch's loss is divided by its token count.
        Ok(StepOutput::Loss(masked_sum / tokens.clamp_min(1.0)))
    }

    /// An estimate for the log line's TFLOP/s (Megatron's formula is GPT's and ignores the
    /// decoder): GPT layers at the encoder length standing for the encoder's layers over the
    /// encoder tokens plus the decoder's over the decoder tokens, each decoder layer counted
    /// twice for its self- and cross-attention blocks.
    fn flops(&self, seq_length: i64) -> FlopsModel {
        let trunk = &self.config.transformer;
        let encoder = trunk.num_layers as u64 * seq_length as u64;
        let decoder = 2 * self.config.decoder_num_layers as u64 * self.decoder_seq_length as u64;
        // Layer-positions of both stacks expressed at the encoder length.
        let num_layers = ((encoder + decoder) / seq_length.max(1) as u64).max(1);
        FlopsModel::of_trunk(trunk, num_layers, seq_length)
    }

    fn build_datasets(&self, args: &PretrainArgs, sizes: [u64; 3]) -> Result<Splits<T5Batch>> {
        let masking = Masking {
            mask_prob: self.mask_prob,
            short_seq_prob: self.short_seq_prob,
            vocab_extra_ids: self.vocab_extra_ids,
        };
        let mock = |samples: u64, seed: u64| {
            Arc::new(MockT5Source {
                samples,
                encoder_seq_length: args.model.seq_length as usize,
                decoder_seq_length: self.decoder_seq_length,
                vocab_size: self.config.transformer.vocab_size,
                seed,
            }) as Arc<dyn SampleSource<Batch = T5Batch>>
        };
        masked_splits(args, sizes, &masking, mock, |sources, flags| {
            let config = Arc::new(flags.t5(self.decoder_seq_length)?);
            build_t5_datasets(sources, sizes.map(Some), config, &open_indexed)
        })
    }
}

/// Megatron's `pretrain_t5.py` on this rank of the job.
pub fn pretrain_t5(args: &T5PretrainArgs, placement: &Placement) -> Result<TrainingSummary> {
    refuse_sft(&args.common.data, "pretrain_t5")?;
    let args = &T5PretrainArgs {
        common: args
            .common
            .with_checkpoint_args(placement.parallel.rank == 0)?,
        ..args.clone()
    };
    if args.common.parallel.pipeline_model_parallel_size > 1 {
        bail!(
            "pretrain_t5 does not support pipeline parallelism: use --pipeline-model-parallel-size 1 \
             (tensor, sequence and data parallelism are supported)"
        );
    }
    // The model's vocabulary is that of the data's tokenizer with T5's sentinels. Mock samples
    // take only a vocabulary size, which any tokenizer gives.
    let tokenizer = &args.common.tokenizer;
    let vocab_size = if args.common.data.mock_data && !MaskedTokenizer::supports(tokenizer)? {
        if args.t5.vocab_extra_ids > 0 {
            bail!(
                "--vocab-extra-ids {}: --tokenizer-type {} has no sentinel tokens (WordPiece \
                 and SentencePieceTokenizer have)",
                args.t5.vocab_extra_ids,
                tokenizer.tokenizer_type
            );
        }
        build_tokenizer(&tokenizer.config()?)?.vocab_size()
    } else {
        MaskedTokenizer::from_flags(tokenizer, args.t5.vocab_extra_ids)?
            .tokenizer
            .vocab_size()
    };
    let family = T5Family {
        config: args.t5_config(vocab_size as i64)?,
        decoder_seq_length: args.t5.decoder_seq_length as usize,
        vocab_extra_ids: args.t5.vocab_extra_ids,
        mask_prob: args.t5.mask_prob,
        short_seq_prob: args.t5.short_seq_prob,
        cross_entropy_loss_fusion: args.common.model.cross_entropy_loss_fusion,
    };
    pretrain(
        &args.common,
        serde_json::to_value(args)?,
        &family,
        placement,
    )
}

/// One split of the T5 data as `pretrain_t5` builds it, for tools that read its samples.
pub struct T5DataRequest<'a> {
    pub data: &'a DataArgs,
    pub tokenizer: &'a TokenizerArgs,
    pub seed: u64,
    pub encoder_seq_length: usize,
    pub decoder_seq_length: usize,
    pub masking: Masking,
    /// Samples asked of each split: its sample index is built for this many, as training
    /// builds it for the samples it needs.
    pub num_samples: u64,
    pub split: Split,
}

/// The samples of `request.split`; an empty split is an error naming it.
pub fn t5_split_dataset(request: &T5DataRequest) -> Result<SplitDataset<T5MaskedWordPieceDataset>> {
    let seed = u32::try_from(request.seed).context("--seed must fit in 32 bits (numpy's limit)")?;
    let (sources, flags) = masked_data_flags(
        request.data,
        request.tokenizer,
        seed,
        request.encoder_seq_length,
        &request.masking,
    )?;
    let config = Arc::new(flags.t5(request.decoder_seq_length)?);
    let sizes = [Some(request.num_samples); 3];
    let mut datasets = build_t5_datasets(&sources, sizes, config, &open_indexed)?;
    datasets[request.split.index()]
        .take()
        .filter(|dataset| !dataset.is_empty())
        .with_context(|| {
            format!(
                "the {} split of the T5 data is empty with these data paths and --split",
                request.split.name()
            )
        })
}
