//! Megatron's `helpers.build_mapping`: the BERT/T5 sample index over sentence data. Each row is
//! `(first sentence, end sentence (exclusive), target length)`; rows are emitted over whole
//! passes of the split's documents and shuffled at the end.

use crate::cache::{IndexArray, NpyArray};
use crate::random::{Mt19937, Mt19937_64};

/// Documents holding a sentence longer than this (and more than one sentence) are skipped.
const LONG_SENTENCE_LEN: i32 = 512;

/// The inputs of one mapping.
pub struct MappingRequest<'a> {
    /// Sentence boundaries of the split's documents: document `d` is
    /// `document_bounds[d]..document_bounds[d + 1]`.
    pub document_bounds: &'a [i64],
    pub sentence_lengths: &'a [i32],
    /// `None`: one pass. `Some(n)`: whole passes until at least `n` rows exist.
    pub num_samples: Option<u64>,
    /// Token budget per sample (BERT: sequence length − 3, T5: − 2).
    pub max_seq_length: i32,
    pub short_seq_prob: f64,
    pub seed: u32,
    /// Sentences a sample needs at least (2 with BERT's binary head, else 1).
    pub min_num_sent: u32,
}

/// The shuffled rows, as a `[rows, 3]` array of Megatron's dtype (uint32, or uint64 when the
/// dataset has more than 2^32 − 1 sentences).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleMapping {
    rows: Vec<[u64; 3]>,
    wide: bool,
}

impl SampleMapping {
    pub fn build(request: &MappingRequest) -> SampleMapping {
        let ratio: u32 = if request.short_seq_prob > 0.0 {
            // C++ `round` (half away from zero), as an int32.
            (1.0 / request.short_seq_prob).round() as u32
        } else {
            0
        };
        let max_len = request.max_seq_length;
        let mut rng = Mt19937::new(request.seed);
        let mut target = || -> i32 {
            if ratio == 0 {
                return max_len;
            }
            let r = rng.next_u32();
            if r.is_multiple_of(ratio) {
                2 + (r % (max_len as u32 - 1)) as i32
            } else {
                max_len
            }
        };
        let bounds = request.document_bounds;
        let sizes = request.sentence_lengths;
        let min_num_sent = i64::from(request.min_num_sent);
        let mut rows: Vec<[u64; 3]> = Vec::new();
        let epochs = match request.num_samples {
            Some(_) => (i32::MAX - 1) as u64,
            None => 1,
        };
        for _ in 0..epochs {
            if rows.len() as u64 >= request.num_samples.unwrap_or(u64::MAX) {
                break;
            }
            let before = rows.len();
            for doc in bounds.windows(2) {
                let (first, last) = (doc[0], doc[1]);
                let mut remaining = last - first;
                let long =
                    remaining > 1 && (first..last).any(|s| sizes[s as usize] > LONG_SENTENCE_LEN);
                if remaining < min_num_sent || long {
                    continue;
                }
                let mut start = first;
                let mut seq_len: i64 = 0;
                let mut num_sent: i64 = 0;
                let mut tgt = target();
                for s in first..last {
                    seq_len += i64::from(sizes[s as usize]);
                    num_sent += 1;
                    remaining -= 1;
                    if (seq_len >= i64::from(tgt) && remaining > 1 && num_sent >= min_num_sent)
                        || remaining == 0
                    {
                        rows.push([start as u64, (s + 1) as u64, tgt as u64]);
                        start = s + 1;
                        tgt = target();
                        seq_len = 0;
                        num_sent = 0;
                    }
                }
            }
            // A pass that emits nothing draws no random numbers, so every later pass would
            // emit nothing too: Megatron runs them all (2^31 of them); we stop.
            if rows.len() == before {
                break;
            }
        }
        let mut shuffle = Mt19937_64::new(u64::from(request.seed) + 1);
        for i in (1..rows.len()).rev() {
            let j = (shuffle.next_u64() % (i as u64 + 1)) as usize;
            rows.swap(i, j);
        }
        SampleMapping {
            rows,
            wide: sizes.len() as u64 > u64::from(u32::MAX),
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// `(first sentence, end sentence, target length)` of sample `idx`.
    pub fn row(&self, idx: usize) -> [u64; 3] {
        self.rows[idx]
    }

    pub fn to_npy(&self) -> NpyArray {
        let flat = self.rows.iter().flatten().copied();
        let data = if self.wide {
            IndexArray::U64(flat.collect())
        } else {
            IndexArray::U32(flat.map(|v| v as u32).collect())
        };
        NpyArray::new(vec![self.rows.len(), 3], data)
    }

    /// A cached `[rows, 3]` array; `None` when its shape or dtype is not a mapping's.
    pub fn from_npy(array: NpyArray) -> Option<SampleMapping> {
        if array.shape.len() != 2 || array.shape[1] != 3 {
            return None;
        }
        let (values, wide): (Vec<u64>, bool) = match array.data {
            IndexArray::U32(v) => (v.into_iter().map(u64::from).collect(), false),
            IndexArray::U64(v) => (v, true),
            _ => return None,
        };
        let rows = values.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect();
        Some(SampleMapping { rows, wide })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mapping(min_num_sent: u32) -> Vec<[u64; 3]> {
        // The spec's worked example (verified against helpers.cpp).
        let m = SampleMapping::build(&MappingRequest {
            document_bounds: &[0, 3, 5, 6, 10],
            sentence_lengths: &[4, 6, 3, 5, 5, 7, 2, 2, 2, 600],
            num_samples: None,
            max_seq_length: 10,
            short_seq_prob: 0.1,
            seed: 1234,
            min_num_sent,
        });
        (0..m.len()).map(|i| m.row(i)).collect()
    }

    #[test]
    fn matches_megatrons_helpers_on_the_worked_example() {
        assert_eq!(mapping(2), [[0, 3, 10], [3, 5, 10]]);
        assert_eq!(mapping(1), [[5, 6, 10], [3, 5, 10], [0, 3, 10]]);
    }

    #[test]
    fn documents_too_short_for_any_sample_give_an_empty_mapping_at_once() {
        let m = SampleMapping::build(&MappingRequest {
            document_bounds: &[0, 1, 2],
            sentence_lengths: &[5, 5],
            num_samples: Some(10),
            max_seq_length: 10,
            short_seq_prob: 0.1,
            seed: 1,
            min_num_sent: 2,
        });
        assert!(m.is_empty());
        assert_eq!(m.to_npy().shape, [0, 3]);
    }
}
