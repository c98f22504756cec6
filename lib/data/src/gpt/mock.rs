//! Megatron's `MockGPTLowLevelDataset`: a synthetic corpus for `--mock-data`, needing no files.

use crate::random::Generator;

use super::source::TokenSource;

const SEED: u128 = 0;
const DOCUMENTS: usize = 100_000;
const MAX_SEQUENCE_LENGTH: i64 = 4096;

/// 100,000 documents whose lengths are `default_rng(0).integers(1, 4096, 100000, int32)`;
/// document `i` of length `L` is `1, 2, …, L-1` (each modulo the vocabulary size) then `eod`.
///
/// The modulo follows current Megatron-LM (core_v0.13.0 emitted `1..L-1` unreduced, which only
/// differs for vocabularies under 4095 tokens); it keeps every id a valid embedding row.
pub struct MockTokenSource {
    lengths: Vec<i32>,
    vocab_size: i64,
    eod: i64,
}

impl MockTokenSource {
    /// # Panics
    /// When `vocab_size` is zero.
    pub fn new(vocab_size: usize, eod: i64) -> Self {
        assert!(
            vocab_size > 0,
            "the mock corpus needs a non-empty vocabulary"
        );
        MockTokenSource {
            lengths: Generator::default_rng(SEED).integers_i32(1, MAX_SEQUENCE_LENGTH, DOCUMENTS),
            vocab_size: vocab_size as i64,
            eod,
        }
    }

    fn token(&self, document_length: usize, position: usize) -> i64 {
        if position + 1 == document_length {
            self.eod
        } else {
            (position as i64 + 1) % self.vocab_size
        }
    }
}

impl TokenSource for MockTokenSource {
    fn sequence_lengths(&self) -> &[i32] {
        &self.lengths
    }

    fn read_into(&self, sequence: usize, offset: usize, length: Option<usize>, out: &mut Vec<i64>) {
        let document_length = self.lengths[sequence] as usize;
        assert!(
            offset <= document_length,
            "offset {offset} beyond mock document {sequence} of length {document_length}"
        );
        let end = length.map_or(document_length, |length| offset + length);
        assert!(
            end <= document_length,
            "reading up to token {end} overruns mock document {sequence} of length {document_length}"
        );
        out.extend((offset..end).map(|position| self.token(document_length, position)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(
        source: &MockTokenSource,
        sequence: usize,
        offset: usize,
        length: Option<usize>,
    ) -> Vec<i64> {
        let mut out = Vec::new();
        source.read_into(sequence, offset, length, &mut out);
        out
    }

    #[test]
    fn lengths_are_megatrons() {
        let source = MockTokenSource::new(50_257, 50_256);
        let lengths = source.sequence_lengths();
        assert_eq!(lengths.len(), 100_000);
        assert_eq!(
            lengths[..10],
            [3484, 2609, 2094, 1105, 1261, 168, 309, 68, 718, 3331]
        );
        assert_eq!(
            lengths.iter().map(|&l| i64::from(l)).sum::<i64>(),
            204_637_097
        );
    }

    #[test]
    fn documents_count_up_and_end_with_eod() {
        let source = MockTokenSource::new(50_257, 50_256);
        let document = read(&source, 7, 0, None);
        let mut expected: Vec<i64> = (1..68).collect();
        expected.push(50_256);
        assert_eq!(document, expected);
    }

    // python -c "import numpy as np; L = 68; print(np.int64(np.concatenate([(np.arange(L - 1) + 1) % 10, [0]]))[60:])"
    #[test]
    fn small_vocab_wraps_ids_and_slices_like_numpy() {
        let source = MockTokenSource::new(10, 0);
        assert_eq!(read(&source, 7, 60, None), [1, 2, 3, 4, 5, 6, 7, 0]);
        assert_eq!(read(&source, 7, 8, Some(4)), [9, 0, 1, 2]);
        assert_eq!(read(&source, 7, 68, None), Vec::<i64>::new());
    }

    // Document 1711 is the first of length 1 (numpy: np.where(lengths == 1)[0][0]).
    #[test]
    fn length_one_document_is_only_eod() {
        let source = MockTokenSource::new(10, 3);
        assert_eq!(source.sequence_lengths()[1711], 1);
        assert_eq!(read(&source, 1711, 0, None), [3]);
    }

    #[test]
    #[should_panic(expected = "overruns mock document 7")]
    fn reading_past_the_end_panics() {
        read(&MockTokenSource::new(10, 0), 7, 60, Some(9));
    }
}
