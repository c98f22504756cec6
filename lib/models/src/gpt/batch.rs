//! A micro-batch of GPT samples as tensors.

use std::ops::Range;

use anyhow::{Context, Result};
use megatron_data::blend::SplitDataset;
use megatron_data::gpt::GptSample;
use megatron_data::sft::SftSplit;
use tch::{Kind, Tensor};

use crate::layers::{AttentionMask, PackedSequences};
use crate::loader::{DeviceBatch, SampleSource};

pub struct GptBatch {
    /// `[b, s]` int64.
    pub tokens: Tensor,
    pub labels: Tensor,
    /// `[b, s]` float32.
    pub loss_mask: Tensor,
    pub position_ids: Tensor,
    /// `[b, 1, s, s]` booleans (`true` = masked) when the samples carry dense masks.
    pub attention_mask: Option<Tensor>,
    /// The documents of the sequences when the samples are packed (`--reset-attention-mask`):
    /// attention stays within each. With neither, attention is causal.
    pub packed: Option<PackedSequences>,
}

impl GptBatch {
    pub fn collate(samples: &[GptSample]) -> Result<GptBatch> {
        let b = samples.len() as i64;
        let s = samples.first().map_or(0, |x| x.tokens.len()) as i64;
        let stack_i64 = |get: fn(&GptSample) -> &Vec<i64>| {
            let flat: Vec<i64> = samples
                .iter()
                .flat_map(|x| get(x).iter().copied())
                .collect();
            Tensor::from_slice(&flat).view([b, s])
        };
        let loss_mask: Vec<f32> = samples
            .iter()
            .flat_map(|x| x.loss_mask.iter().copied())
            .collect();
        let attention_mask = samples
            .first()
            .and_then(|x| x.attention_mask.as_ref())
            .map(|_| {
                let flat: Vec<bool> = samples
                    .iter()
                    .flat_map(|x| {
                        x.attention_mask
                            .as_ref()
                            .expect("every sample has a mask")
                            .iter()
                            .copied()
                    })
                    .collect();
                Tensor::from_slice(&flat).view([b, 1, s, s])
            });
        let packed = match samples.first().and_then(|x| x.document_lengths.as_ref()) {
            None => None,
            Some(_) => {
                let lengths = samples
                    .iter()
                    .map(|x| x.document_lengths.clone().context("a sample is not packed"))
                    .collect::<Result<Vec<_>>>()?;
                Some(PackedSequences::from_lengths(&lengths, s)?)
            }
        };
        Ok(GptBatch {
            tokens: stack_i64(|x| &x.tokens),
            labels: stack_i64(|x| &x.labels),
            loss_mask: Tensor::from_slice(&loss_mask).view([b, s]),
            position_ids: stack_i64(|x| &x.position_ids),
            attention_mask,
            packed,
        })
    }

    pub fn mask(&self) -> AttentionMask {
        match (&self.packed, &self.attention_mask) {
            (Some(packed), _) => AttentionMask::Packed(packed.clone()),
            (None, Some(mask)) => AttentionMask::Explicit(mask.shallow_clone()),
            (None, None) => AttentionMask::Causal,
        }
    }

    /// Tokens that count towards the loss.
    pub fn num_tokens(&self) -> Tensor {
        self.loss_mask.sum(Kind::Float)
    }
}

impl DeviceBatch for GptBatch {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> GptBatch {
        GptBatch {
            tokens: f(&self.tokens),
            labels: f(&self.labels),
            loss_mask: f(&self.loss_mask),
            position_ids: f(&self.position_ids),
            attention_mask: self.attention_mask.as_ref().map(&mut *f),
            packed: self.packed.as_ref().map(|p| p.map_tensors(&mut *f)),
        }
    }

    fn tensors(&self) -> Vec<&Tensor> {
        let mut tensors = vec![
            &self.tokens,
            &self.labels,
            &self.loss_mask,
            &self.position_ids,
        ];
        tensors.extend(self.attention_mask.as_ref());
        if let Some(packed) = &self.packed {
            tensors.extend([&packed.cu_seqlens, &packed.positions]);
        }
        tensors
    }
}

impl SampleSource for SplitDataset {
    type Batch = GptBatch;

    fn len(&self) -> u64 {
        SplitDataset::len(self) as u64
    }

    fn collate(&self, indices: Range<u64>) -> Result<GptBatch> {
        let samples: Vec<GptSample> = indices.map(|i| self.get(i as usize).1).collect();
        GptBatch::collate(&samples)
    }
}

impl SampleSource for SftSplit {
    type Batch = GptBatch;

    fn len(&self) -> u64 {
        self.samples as u64
    }

    fn collate(&self, indices: Range<u64>) -> Result<GptBatch> {
        let samples = indices
            .map(|i| self.get(i as usize))
            .collect::<Result<Vec<GptSample>>>()?;
        GptBatch::collate(&samples)
    }
}
