//! GPT on the training engine (`pretrain_gpt`): the causal model, its token-averaged `lm loss`
//! and Megatron's GPT datasets.

use anyhow::{Context, Result};
use megatron_data::tokenizer::build_tokenizer;
use tch::Tensor;

use super::family::{LossTotals, ModelFamily, StepOutput};
use crate::args::PretrainArgs;
use crate::datasets::{build_datasets, DatasetRequest};
use crate::engine::{train_with_hooks, NoHooks, TrainingHooks, TrainingSummary};
use megatron_models::gpt::{ChunkInput, ChunkOutput, GptBatch, GptModel};
use megatron_models::loader::Splits;
use megatron_models::{ChunkSpec, ModelOptions, TransformerConfig};
use megatron_parallel::ParallelState;
use megatron_parallel::Placement;

/// Every flag of `pretrain_gpt`: GPT has no flags beyond the common pretraining flags.
pub type GptPretrainArgs = PretrainArgs;

pub struct GptFamily {
    pub config: TransformerConfig,
    /// The tokenizer's end-of-document token.
    pub eod: i64,
    /// `--cross-entropy-loss-fusion`.
    pub cross_entropy_loss_fusion: bool,
}

impl ModelFamily for GptFamily {
    type Chunk = GptModel;
    type Batch = GptBatch;

    fn transformer(&self) -> &TransformerConfig {
        &self.config
    }

    fn build_chunk(
        &self,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<GptModel> {
        GptModel::new_chunk(self.config.clone(), options, parallel, spec)
    }

    fn loss_names(&self) -> &'static [&'static str] {
        &["lm loss"]
    }

    fn forward_step(
        &self,
        chunk: &GptModel,
        batch: &GptBatch,
        input: Option<&Tensor>,
        train: bool,
        losses: &mut LossTotals,
    ) -> Result<StepOutput> {
        let input = match input {
            Some(hidden) => ChunkInput::Hidden(hidden),
            None => ChunkInput::Tokens {
                tokens: &batch.tokens,
                position_ids: &batch.position_ids,
            },
        };
        let head = match chunk.forward_to_head(input, &batch.mask(), train)? {
            ChunkOutput::Hidden(hidden) => return Ok(StepOutput::Hidden(hidden)),
            ChunkOutput::Head(head) => head,
        };
        let masked_sum = head.masked_loss_sum(
            &batch.labels,
            &batch.loss_mask,
            self.cross_entropy_loss_fusion,
        )?;
        let tokens = batch.num_tokens();
        losses.add(0, &masked_sum, &tokens);
        Ok(StepOutput::TokenLoss {
            sum: masked_sum,
            tokens,
        })
    }

    fn loss_tokens(&self, batch: &GptBatch) -> Option<Tensor> {
        Some(batch.num_tokens())
    }

    fn build_datasets(&self, args: &PretrainArgs, sizes: [u64; 3]) -> Result<Splits<GptBatch>> {
        build_datasets(&DatasetRequest {
            data: &args.data,
            tokenizer: &args.tokenizer,
            seq_length: args.model.seq_length as usize,
            seed: args.training.seed,
            sizes,
            eod: self.eod,
            vocab_size: self.config.vocab_size as usize,
        })
    }
}

/// Megatron's `pretrain_gpt.py` on this rank of the job.
pub fn pretrain_gpt(args: &PretrainArgs, placement: &Placement) -> Result<TrainingSummary> {
    pretrain_gpt_with_hooks(args, placement, &mut NoHooks)
}

/// [`pretrain_gpt`] with `hooks` added to the loop (the binary's `--ckpt-format` export).
pub fn pretrain_gpt_with_hooks(
    args: &PretrainArgs,
    placement: &Placement,
    hooks: &mut dyn TrainingHooks<GptFamily>,
) -> Result<TrainingSummary> {
    let args = &args.with_checkpoint_args(placement.parallel.rank == 0)?;
    let tokenizer = build_tokenizer(&args.tokenizer.config()?)?;
    let eod = tokenizer
        .eod()
        .context("the tokenizer has no end-of-document token, which GPT training needs")?;
    let family = GptFamily {
        config: args.model.gpt_config(tokenizer.vocab_size() as i64)?,
        eod: eod as i64,
        cross_entropy_loss_fusion: args.model.cross_entropy_loss_fusion,
    };
    train_with_hooks(args, serde_json::to_value(args)?, &family, placement, hooks)
}
