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
use megatron_models::layers::{AttentionMask, ContextExchange, ContextParallel};
use megatron_models::loader::{DeviceBatch, Splits};
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
    /// `--context-parallel-size` > 1: this rank's group, which splits every sequence.
    pub context: Option<ContextParallel>,
}

impl GptFamily {
    /// The part of `batch` this rank computes: under context parallelism its two chunks of
    /// every sequence (tokens, labels, loss mask and position ids), attending across the
    /// group, within each document when the sequences are packed.
    fn local(&self, batch: &GptBatch) -> Result<(GptBatch, AttentionMask)> {
        let Some(context) = &self.context else {
            return Ok((batch.map_tensors(&mut Tensor::shallow_clone), batch.mask()));
        };
        let keep = |t: &Tensor| context.keep_local_chunks(t, 1);
        let local = GptBatch {
            tokens: keep(&batch.tokens)?,
            labels: keep(&batch.labels)?,
            loss_mask: keep(&batch.loss_mask)?,
            position_ids: keep(&batch.position_ids)?,
            attention_mask: None,
            packed: None,
        };
        let chunks = match &batch.packed {
            Some(packed) => context.with_documents(packed)?,
            None => context.chunks(),
        };
        Ok((local, AttentionMask::ContextParallel(chunks)))
    }
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
        let (batch, mask) = self.local(batch)?;
        let batch = &batch;
        let input = match input {
            Some(hidden) => ChunkInput::Hidden(hidden),
            None => ChunkInput::Tokens {
                tokens: &batch.tokens,
                position_ids: &batch.position_ids,
            },
        };
        let head = match chunk.forward_to_head(input, &mask, train)? {
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
        let (local, _) = self.local(batch).ok()?;
        Some(local.num_tokens())
    }

    fn context_parallel(&self) -> bool {
        self.context.is_some()
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
        context: context_parallel(args, &placement.parallel)?,
    };
    train_with_hooks(args, serde_json::to_value(args)?, &family, placement, hooks)
}

/// This rank's context-parallel group with `--cp-comm-type`, when `--context-parallel-size` is
/// above 1; what it cannot run with is refused by name.
fn context_parallel(
    args: &PretrainArgs,
    parallel: &ParallelState,
) -> Result<Option<ContextParallel>> {
    let exchange = args.parallel.context_parallel_exchange()?;
    let size = args.parallel.context_parallel_size;
    if size == 1 {
        return Ok(None);
    }
    let seq_length = args.model.seq_length;
    if seq_length % (2 * size as i64) != 0 {
        megatron_cli::bail_usage!(
            "--seq-length {seq_length} is not divisible by 2 × --context-parallel-size {size}: \
             context parallelism cuts each sequence into 2 × {size} equal chunks"
        );
    }
    if args.model.moe.num_experts.is_some() {
        megatron_cli::bail_usage!(
            "--context-parallel-size {size} with --num-experts is not supported yet: the \
             load-balancing loss would count each context-parallel rank's tokens alone"
        );
    }
    if args.training.enable_cuda_graph {
        megatron_cli::bail_usage!(
            "--context-parallel-size {size} with --enable-cuda-graph is not supported: the \
             chunks' positions are copied to the device at every step"
        );
    }
    let traded_over = match exchange {
        ContextExchange::AllToAll => Some(("a2a", size)),
        ContextExchange::AllToAllThenRing { a2a_size } => Some(("a2a+p2p", a2a_size)),
        ContextExchange::Ring | ContextExchange::AllGather => None,
    };
    if let Some((comm, over)) = traded_over {
        let heads = args.model.num_attention_heads;
        let tensor = args.parallel.tensor_model_parallel_size as i64;
        if (heads / tensor) % over as i64 != 0 {
            megatron_cli::bail_usage!(
                "--cp-comm-type {comm}: --num-attention-heads {heads} / \
                 --tensor-model-parallel-size {tensor} = {} heads per rank are not divisible \
                 by the {over} ranks that trade heads for sequence",
                heads / tensor
            );
        }
    }
    Ok(Some(ContextParallel::new(
        parallel.context.clone(),
        exchange,
    )))
}
