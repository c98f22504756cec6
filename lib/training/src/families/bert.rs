//! BERT on the training engine (`pretrain_bert`): the padded bidirectional model with its LM and
//! sentence-order heads, Megatron's loss (the masked-LM mean of each micro-batch plus the
//! sentence-order cross entropy, reported as `lm loss` and `sop loss`) and its datasets.

use std::sync::Arc;

use anyhow::{bail, Result};
use clap::Args;
use megatron_data::masked::{build_bert_datasets, open_indexed};
use megatron_data::tokenizer::build_tokenizer;
use tch::{Kind, Reduction, Tensor};

use super::family::{LossTotals, ModelFamily, StepOutput};
use crate::args::PretrainArgs;
use crate::datasets::{masked_splits, refuse_sft, Masking};
use crate::engine::{pretrain, TrainingSummary};
use megatron_models::bert::{
    BertArgs, BertBatch, BertChunkOutput, BertConfig, BertInput, BertModel, BertOutput,
    MockBertSource,
};
use megatron_models::loader::{SampleSource, Splits};
use megatron_models::{ChunkSpec, ModelOptions, TransformerConfig};
use megatron_parallel::ParallelState;
use megatron_parallel::Placement;

/// Every flag of `pretrain_bert`: the common pretraining flags and BERT's.
#[derive(Debug, Clone, Args, serde::Serialize)]
pub struct BertPretrainArgs {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: PretrainArgs,
    #[command(flatten, next_help_heading = "BERT")]
    #[serde(flatten)]
    pub bert: BertArgs,
}

impl BertPretrainArgs {
    /// The architecture for a tokenizer of `vocab_size` tokens.
    pub fn bert_config(&self, vocab_size: i64) -> Result<BertConfig> {
        let model = &self.common.model;
        model.moe.refuse_for("BERT")?;
        Ok(self
            .bert
            .config(model.gpt_config(vocab_size)?, model.openai_gelu))
    }
}

pub struct BertFamily {
    pub config: BertConfig,
    /// `--mask-prob` and `--short-seq-prob` of the masked-LM datasets.
    pub mask_prob: f64,
    pub short_seq_prob: f64,
    /// `--cross-entropy-loss-fusion`.
    pub cross_entropy_loss_fusion: bool,
}

const WITH_SOP: &[&str] = &["lm loss", "sop loss"];
const LM_ONLY: &[&str] = &["lm loss"];

impl BertFamily {
    /// Megatron's BERT loss of one micro-batch from the heads' outputs: the masked-LM loss
    /// averaged over the micro-batch's masked tokens, plus the sentence-order cross entropy
    /// (labels -1 ignored) with the binary head. Each is added to `losses` as one value.
    pub fn loss(
        &self,
        output: &BertOutput,
        batch: &BertBatch,
        losses: &mut LossTotals,
    ) -> Result<Tensor> {
        // Unmasked positions carry label -1; their loss is multiplied by 0, but the lookup
        // needs a valid index.
        let labels = batch.labels.clamp_min(0);
        let masked_sum =
            output
                .lm
                .masked_loss_sum(&labels, &batch.loss_mask, self.cross_entropy_loss_fusion)?;
        let masked = batch.loss_mask.sum(Kind::Float);
        let lm = masked_sum / masked.clamp_min(1.0);
        let one = Tensor::ones([], (Kind::Float, lm.device()));
        losses.add(0, &lm, &one);
        let Some(binary) = &output.binary_logits else {
            return Ok(lm);
        };
        let sop = binary.to_kind(Kind::Float).cross_entropy_loss::<&Tensor>(
            &batch.sentence_order,
            None,
            Reduction::Mean,
            -1,
            0.0,
        );
        losses.add(1, &sop, &one);
        Ok(lm + sop)
    }
}

impl ModelFamily for BertFamily {
    type Chunk = BertModel;
    type Batch = BertBatch;

    fn transformer(&self) -> &TransformerConfig {
        &self.config.transformer
    }

    fn build_chunk(
        &self,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<BertModel> {
        BertModel::new_chunk(self.config.clone(), options, parallel, spec)
    }

    fn loss_names(&self) -> &'static [&'static str] {
        if self.config.binary_head {
            WITH_SOP
        } else {
            LM_ONLY
        }
    }

    fn forward_step(
        &self,
        chunk: &BertModel,
        batch: &BertBatch,
        input: Option<&Tensor>,
        train: bool,
        losses: &mut LossTotals,
    ) -> Result<StepOutput> {
        let input = match input {
            Some(hidden) => BertInput::Hidden(hidden),
            None => BertInput::Tokens {
                tokens: &batch.tokens,
                tokentypes: self.config.binary_head.then_some(&batch.types),
            },
        };
        match chunk.forward_chunk(input, &batch.padding_mask, train)? {
            BertChunkOutput::Hidden(hidden) => Ok(StepOutput::Hidden(hidden)),
            BertChunkOutput::Heads(output) => {
                Ok(StepOutput::Loss(self.loss(&output, batch, losses)?))
            }
            BertChunkOutput::Task(_) => {
                bail!("pretraining needs the LM head; this BERT has a finetuning head")
            }
        }
    }

    fn build_datasets(&self, args: &PretrainArgs, sizes: [u64; 3]) -> Result<Splits<BertBatch>> {
        let masking = Masking {
            mask_prob: self.mask_prob,
            short_seq_prob: self.short_seq_prob,
            vocab_extra_ids: 0,
        };
        let mock = |samples: u64, seed: u64| {
            Arc::new(MockBertSource {
                samples,
                seq_length: args.model.seq_length as usize,
                vocab_size: self.config.transformer.vocab_size,
                seed,
                binary_head: self.config.binary_head,
            }) as Arc<dyn SampleSource<Batch = BertBatch>>
        };
        masked_splits(args, sizes, &masking, mock, |sources, flags| {
            let config = Arc::new(flags.bert(self.config.binary_head)?);
            build_bert_datasets(sources, sizes.map(Some), config, &open_indexed)
        })
    }
}

/// Megatron's `pretrain_bert.py` on this rank of the job.
pub fn pretrain_bert(args: &BertPretrainArgs, placement: &Placement) -> Result<TrainingSummary> {
    refuse_sft(&args.common.data, "pretrain_bert")?;
    let args = &BertPretrainArgs {
        common: args
            .common
            .with_checkpoint_args(placement.parallel.rank == 0)?,
        ..args.clone()
    };
    let tokenizer = build_tokenizer(&args.common.tokenizer.config()?)?;
    let family = BertFamily {
        config: args.bert_config(tokenizer.vocab_size() as i64)?,
        mask_prob: args.bert.mask_prob,
        short_seq_prob: args.bert.short_seq_prob,
        cross_entropy_loss_fusion: args.common.model.cross_entropy_loss_fusion,
    };
    pretrain(
        &args.common,
        serde_json::to_value(args)?,
        &family,
        placement,
    )
}
