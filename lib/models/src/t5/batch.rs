//! A micro-batch of T5 samples (Megatron's `T5MaskedWordPieceDataset`) as tensors, and the
//! synthetic span-corruption samples of `pretrain_t5 --mock-data`.

use std::ops::Range;

use anyhow::{ensure, Result};
use megatron_data::blend::SplitDataset;
use megatron_data::masked::{T5MaskedWordPieceDataset, T5Sample};
use tch::{Kind, Tensor};

use crate::loader::{DeviceBatch, SampleSource, SplitMix};

pub struct T5Batch {
    /// `[b, se]` int64 encoder input.
    pub text_enc: Tensor,
    /// `[b, sd]` int64 decoder input.
    pub text_dec: Tensor,
    /// `[b, sd]` int64 decoder targets, -1 on padding.
    pub labels: Tensor,
    /// `[b, sd]` float32, 1 on the decoder's real positions.
    pub loss_mask: Tensor,
    /// `[b, se]` int64, 1 on the encoder's real tokens and 0 on padding.
    pub enc_mask: Tensor,
}

impl T5Batch {
    pub fn collate(rows: &[T5Sample]) -> Result<T5Batch> {
        let b = rows.len() as i64;
        let se = rows.first().map_or(0, |r| r.text_enc.len());
        let sd = rows.first().map_or(0, |r| r.text_dec.len());
        ensure!(
            rows.iter()
                .all(|r| r.text_enc.len() == se && r.text_dec.len() == sd),
            "T5 samples of different lengths in one batch"
        );
        let stack = |get: fn(&T5Sample) -> &Vec<i64>, s: usize| {
            let flat: Vec<i64> = rows.iter().flat_map(|r| get(r).iter().copied()).collect();
            Tensor::from_slice(&flat).view([b, s as i64])
        };
        Ok(T5Batch {
            text_enc: stack(|r| &r.text_enc, se),
            text_dec: stack(|r| &r.text_dec, sd),
            labels: stack(|r| &r.labels, sd),
            loss_mask: stack(|r| &r.loss_mask, sd).to_kind(Kind::Float),
            enc_mask: stack(|r| &r.enc_mask, se),
        })
    }

    /// The number of decoder tokens that carry a loss, as a float32 scalar.
    pub fn num_tokens(&self) -> Tensor {
        self.loss_mask.sum(Kind::Float)
    }
}

impl DeviceBatch for T5Batch {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> T5Batch {
        T5Batch {
            text_enc: f(&self.text_enc),
            text_dec: f(&self.text_dec),
            labels: f(&self.labels),
            loss_mask: f(&self.loss_mask),
            enc_mask: f(&self.enc_mask),
        }
    }

    fn tensors(&self) -> Vec<&Tensor> {
        vec![
            &self.text_enc,
            &self.text_dec,
            &self.labels,
            &self.loss_mask,
            &self.enc_mask,
        ]
    }
}

/// Synthetic T5 samples for `--mock-data` (Megatron has no mock T5 dataset): a run of
/// consecutive token ids, some shorter than the encoder length and padded, with one to three
/// short spans replaced by sentinels in order; the decoder reads `[BOS]`, then each sentinel
/// followed by its span, and predicts the same shifted by one, ending in `[EOS]`. The samples
/// depend only on the seed and their index, so every layout and every resume reads the same
/// data, and a model can learn them.
pub struct MockT5Source {
    pub samples: u64,
    pub encoder_seq_length: usize,
    pub decoder_seq_length: usize,
    pub vocab_size: i64,
    pub seed: u64,
}

/// Token ids of the mock samples' special tokens; ordinary tokens follow the sentinels.
const PAD: i64 = 0;
const BOS: i64 = 1;
const EOS: i64 = 2;
const FIRST_SENTINEL: i64 = 3;
const SPANS: i64 = 3;
const FIRST_ORDINARY: i64 = FIRST_SENTINEL + SPANS;

impl MockT5Source {
    pub fn row(&self, index: u64) -> T5Sample {
        let (se, sd) = (self.encoder_seq_length, self.decoder_seq_length);
        let mut rng = SplitMix(self.seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ index);
        let length = if rng.chance(0.5) {
            se
        } else {
            se / 2 + rng.below((se - se / 2) as u64 + 1) as usize
        }
        .max(4)
        .min(se);
        let ordinary = (self.vocab_size - FIRST_ORDINARY).max(1);
        let start = rng.below(ordinary as u64) as i64;
        let text: Vec<i64> = (0..length as i64)
            .map(|k| FIRST_ORDINARY + (start + k).rem_euclid(ordinary))
            .collect();
        // Spans of 1..=3 tokens at increasing positions; the decoder must hold them all.
        let spans = 1 + rng.below(SPANS as u64) as usize;
        let mut cuts: Vec<Range<usize>> = Vec::new();
        let mut decoder_used = 1;
        let mut from = 0;
        for i in 0..spans {
            let room = length.saturating_sub(from);
            let span = 1 + rng.below(3) as usize;
            if room < span + 1 || decoder_used + span + 1 >= sd {
                break;
            }
            let segment = room / (spans - i);
            let at = from + rng.below(segment.saturating_sub(span).max(1) as u64) as usize;
            let at = at.min(length - span);
            cuts.push(at..at + span);
            decoder_used += span + 1;
            from = at + span + 1;
        }
        let mut text_enc = Vec::with_capacity(se);
        let mut text_dec = vec![BOS];
        let mut next = 0;
        for (i, cut) in cuts.iter().enumerate() {
            text_enc.extend_from_slice(&text[next..cut.start]);
            let sentinel = FIRST_SENTINEL + i as i64;
            text_enc.push(sentinel);
            text_dec.push(sentinel);
            text_dec.extend_from_slice(&text[cut.clone()]);
            next = cut.end;
        }
        text_enc.extend_from_slice(&text[next..]);
        let mut labels: Vec<i64> = text_dec[1..].to_vec();
        labels.push(EOS);
        let (real_enc, real_dec) = (text_enc.len(), text_dec.len());
        text_enc.resize(se, PAD);
        text_dec.resize(sd, PAD);
        labels.resize(sd, -1);
        let mask =
            |real: usize, s: usize| -> Vec<i64> { (0..s).map(|i| i64::from(i < real)).collect() };
        T5Sample {
            text_enc,
            text_dec,
            labels,
            loss_mask: mask(real_dec, sd),
            truncated: false,
            enc_mask: mask(real_enc, se),
            dec_mask: mask(real_dec, sd),
        }
    }
}

impl SampleSource for MockT5Source {
    type Batch = T5Batch;

    fn len(&self) -> u64 {
        self.samples
    }

    fn collate(&self, indices: Range<u64>) -> Result<T5Batch> {
        let rows: Vec<T5Sample> = indices.map(|i| self.row(i)).collect();
        T5Batch::collate(&rows)
    }
}

impl SampleSource for SplitDataset<T5MaskedWordPieceDataset> {
    type Batch = T5Batch;

    fn len(&self) -> u64 {
        SplitDataset::len(self) as u64
    }

    fn collate(&self, indices: Range<u64>) -> Result<T5Batch> {
        let rows = indices
            .map(|i| self.get(i as usize).1)
            .collect::<Result<Vec<T5Sample>>>()?;
        T5Batch::collate(&rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mock_samples_are_well_formed_and_reproducible() {
        let source = MockT5Source {
            samples: 100,
            encoder_seq_length: 32,
            decoder_seq_length: 12,
            vocab_size: 100,
            seed: 7,
        };
        for i in 0..100 {
            let row = source.row(i);
            assert_eq!(row, source.row(i));
            assert_eq!((row.text_enc.len(), row.text_dec.len()), (32, 12));
            let real_dec = row.loss_mask.iter().sum::<i64>() as usize;
            assert!(real_dec >= 2, "{row:?}");
            assert_eq!(row.text_dec[0], BOS);
            assert_eq!(row.labels[real_dec - 1], EOS);
            assert_eq!(&row.labels[..real_dec - 1], &row.text_dec[1..real_dec]);
            let sentinels: Vec<i64> = row
                .text_enc
                .iter()
                .copied()
                .filter(|&t| (FIRST_SENTINEL..FIRST_ORDINARY).contains(&t))
                .collect();
            let expected: Vec<i64> = (0..sentinels.len() as i64)
                .map(|k| FIRST_SENTINEL + k)
                .collect();
            assert_eq!(sentinels, expected, "{row:?}");
            let real_enc = row.enc_mask.iter().sum::<i64>() as usize;
            assert!(row.text_enc[real_enc..].iter().all(|&t| t == PAD));
        }
    }
}
