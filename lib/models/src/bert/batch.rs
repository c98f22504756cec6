//! A micro-batch of BERT samples (Megatron's `BERTMaskedWordPieceDataset`) as tensors, and the
//! synthetic masked-LM samples of `pretrain_bert --mock-data`.

use std::ops::Range;

use anyhow::{ensure, Result};
use megatron_data::blend::SplitDataset;
use megatron_data::masked::{BertMaskedWordPieceDataset, BertSample};
use tch::{Kind, Tensor};

use crate::loader::{DeviceBatch, SampleSource, SplitMix};

pub struct BertBatch {
    /// `[b, s]` int64.
    pub tokens: Tensor,
    pub types: Tensor,
    /// `[b, s]` int64, -1 where nothing is predicted.
    pub labels: Tensor,
    /// `[b, s]` float32.
    pub loss_mask: Tensor,
    /// `[b, s]` int64, 1 for tokens and 0 for padding.
    pub padding_mask: Tensor,
    /// `[b]` int64.
    pub sentence_order: Tensor,
}

impl BertBatch {
    pub fn collate(rows: &[BertSample]) -> Result<BertBatch> {
        let b = rows.len() as i64;
        let s = rows.first().map_or(0, |r| r.text.len()) as i64;
        ensure!(
            rows.iter().all(|r| r.text.len() as i64 == s),
            "BERT samples of different lengths in one batch"
        );
        let stack = |get: fn(&BertSample) -> &Vec<i64>| {
            let flat: Vec<i64> = rows.iter().flat_map(|r| get(r).iter().copied()).collect();
            Tensor::from_slice(&flat).view([b, s])
        };
        let order: Vec<i64> = rows.iter().map(|r| i64::from(r.is_random)).collect();
        Ok(BertBatch {
            tokens: stack(|r| &r.text),
            types: stack(|r| &r.types),
            labels: stack(|r| &r.labels),
            loss_mask: stack(|r| &r.loss_mask).to_kind(Kind::Float),
            padding_mask: stack(|r| &r.padding_mask),
            sentence_order: Tensor::from_slice(&order),
        })
    }
}

impl DeviceBatch for BertBatch {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> BertBatch {
        BertBatch {
            tokens: f(&self.tokens),
            types: f(&self.types),
            labels: f(&self.labels),
            loss_mask: f(&self.loss_mask),
            padding_mask: f(&self.padding_mask),
            sentence_order: f(&self.sentence_order),
        }
    }

    fn tensors(&self) -> Vec<&Tensor> {
        vec![
            &self.tokens,
            &self.types,
            &self.labels,
            &self.loss_mask,
            &self.padding_mask,
            &self.sentence_order,
        ]
    }
}

/// Synthetic BERT samples for `--mock-data` (Megatron has no mock BERT dataset): each sample is
/// `[CLS] A [SEP] B [SEP]` over a run of consecutive token ids, B continuing A's run in order or
/// (sentence order "random") running backwards, about 15 % of the tokens replaced by `[MASK]`,
/// and some samples shorter than the sequence and padded. The samples depend only on the seed and
/// their index, so every layout and every resume reads the same data, and a model can learn them.
pub struct MockBertSource {
    pub samples: u64,
    pub seq_length: usize,
    pub vocab_size: i64,
    pub seed: u64,
    pub binary_head: bool,
}

/// Token ids of the mock samples' special tokens; ordinary tokens follow them.
const PAD: i64 = 0;
const CLS: i64 = 1;
const SEP: i64 = 2;
const MASK: i64 = 3;
const FIRST_ORDINARY: i64 = 4;

impl MockBertSource {
    pub fn row(&self, index: u64) -> BertSample {
        let s = self.seq_length;
        let mut rng = SplitMix(self.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ index);
        let length = if rng.chance(0.5) {
            s
        } else {
            s / 2 + rng.below((s - s / 2) as u64 + 1) as usize
        }
        .max(5)
        .min(s);
        let ordinary = (self.vocab_size - FIRST_ORDINARY).max(1);
        let is_random = self.binary_head && rng.chance(0.5);
        let (a, b) = ((length - 3) / 2, length - 3 - (length - 3) / 2);
        let start = rng.below(ordinary as u64) as i64;
        let token = |k: i64| FIRST_ORDINARY + k.rem_euclid(ordinary);
        let mut text = vec![CLS];
        text.extend((0..a as i64).map(|k| token(start + k)));
        text.push(SEP);
        let types_a = text.len();
        if is_random {
            text.extend((0..b as i64).map(|k| token(start - 1 - k)));
        } else {
            text.extend((0..b as i64).map(|k| token(start + a as i64 + k)));
        }
        text.push(SEP);
        let mut labels = vec![-1; s];
        let mut loss_mask = vec![0; s];
        for (i, t) in text.iter_mut().enumerate() {
            if *t >= FIRST_ORDINARY && rng.chance(0.15) {
                labels[i] = *t;
                loss_mask[i] = 1;
                *t = MASK;
            }
        }
        let mut types: Vec<i64> = (0..text.len())
            .map(|i| i64::from(self.binary_head && i >= types_a))
            .collect();
        let mut padding_mask = vec![1; text.len()];
        text.resize(s, PAD);
        types.resize(s, 0);
        padding_mask.resize(s, 0);
        BertSample {
            text,
            types,
            labels,
            loss_mask,
            padding_mask,
            is_random,
            truncated: false,
        }
    }
}

impl SampleSource for MockBertSource {
    type Batch = BertBatch;

    fn len(&self) -> u64 {
        self.samples
    }

    fn collate(&self, indices: Range<u64>) -> Result<BertBatch> {
        let rows: Vec<BertSample> = indices.map(|i| self.row(i)).collect();
        BertBatch::collate(&rows)
    }
}

impl SampleSource for SplitDataset<BertMaskedWordPieceDataset> {
    type Batch = BertBatch;

    fn len(&self) -> u64 {
        SplitDataset::len(self) as u64
    }

    fn collate(&self, indices: Range<u64>) -> Result<BertBatch> {
        let rows: Vec<BertSample> = indices.map(|i| self.get(i as usize).1).collect();
        BertBatch::collate(&rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mock_samples_are_well_formed_and_reproducible() {
        let source = MockBertSource {
            samples: 100,
            seq_length: 32,
            vocab_size: 100,
            seed: 7,
            binary_head: true,
        };
        let mut orders = [0; 2];
        for i in 0..100 {
            let row = source.row(i);
            assert_eq!(row, source.row(i));
            assert_eq!(row.text.len(), 32);
            assert_eq!(row.text[0], CLS);
            let real = row.padding_mask.iter().sum::<i64>() as usize;
            assert!(real >= 16 && row.text[real - 1] == SEP, "{row:?}");
            assert!(row.text[real..].iter().all(|&t| t == PAD));
            for (j, &label) in row.labels.iter().enumerate() {
                assert_eq!(label >= 0, row.loss_mask[j] == 1);
                if label >= 0 {
                    assert_eq!(row.text[j], MASK);
                }
            }
            orders[usize::from(row.is_random)] += 1;
        }
        assert!(orders[0] > 20 && orders[1] > 20, "{orders:?}");
    }
}
