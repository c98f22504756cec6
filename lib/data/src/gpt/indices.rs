//! The three index arrays of a GPT dataset, built in Megatron's RNG order.

use std::ops::Range;

use crate::cache::{IndexArray, NpyArray};
use crate::random::RandomState;

use super::document_index::build_document_index;
use super::epochs::EpochPlan;
use super::sample_index::{build_sample_index, SampleIndexInput};
use super::shuffle_index::build_shuffle_index;

/// `document_index`, `sample_index` (flattened `[n+1, 2]`) and `shuffle_index`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GptIndices {
    pub document_index: IndexArray,
    pub sample_index: IndexArray,
    pub shuffle_index: IndexArray,
}

/// What the index build needs to know about a split.
pub struct IndexRequest<'a> {
    pub sequence_lengths: &'a [i32],
    pub documents: Range<usize>,
    pub plan: EpochPlan,
    pub sequence_length: u64,
    pub seed: u32,
    pub drop_last_partial_sequence: bool,
    pub add_extra_token: bool,
}

impl GptIndices {
    pub fn build(request: &IndexRequest) -> GptIndices {
        let mut rng = RandomState::new(request.seed);
        let document_index = build_document_index(
            request.documents.clone(),
            request.plan.num_epochs,
            request.plan.separate_final_epoch(),
            &mut rng,
        );
        let sample_index = build_sample_index(&SampleIndexInput {
            sequence_lengths: request.sequence_lengths,
            document_index: &document_index,
            sequence_length: request.sequence_length,
            num_epochs: request.plan.num_epochs,
            tokens_per_epoch: request.plan.tokens_per_epoch,
            drop_last_partial_sequence: request.drop_last_partial_sequence,
            add_extra_token: request.add_extra_token,
        });
        let num_samples = sample_index.len() / 2 - 1;
        let first_range = request
            .plan
            .samples_before_final_epoch
            .map_or(num_samples, |n| n as usize);
        let shuffle_index = build_shuffle_index(first_range, num_samples, &mut rng);
        GptIndices {
            document_index: IndexArray::I32(document_index),
            sample_index,
            shuffle_index,
        }
    }

    /// Samples available (rows of the sample index minus one).
    pub fn num_samples(&self) -> usize {
        self.shuffle_index.len()
    }

    /// `(position in document_index, offset)` of sample-index row `row`.
    #[inline]
    pub fn sample_row(&self, row: usize) -> (usize, usize) {
        (
            self.sample_index.get(2 * row) as usize,
            self.sample_index.get(2 * row + 1) as usize,
        )
    }

    /// Arrays with their numpy shapes, named by their cache-file affixes.
    pub fn to_npy(&self) -> [(&'static str, NpyArray); 3] {
        let rows = self.sample_index.len() / 2;
        [
            (
                "document_index.npy",
                NpyArray::vector(self.document_index.clone()),
            ),
            (
                "sample_index.npy",
                NpyArray::new(vec![rows, 2], self.sample_index.clone()),
            ),
            (
                "shuffle_index.npy",
                NpyArray::vector(self.shuffle_index.clone()),
            ),
        ]
    }

    /// Reassembles indices read from cache files, checking they are mutually consistent.
    pub fn from_npy(
        document_index: NpyArray,
        sample_index: NpyArray,
        shuffle_index: NpyArray,
    ) -> Result<GptIndices, String> {
        if document_index.shape.len() != 1 || shuffle_index.shape.len() != 1 {
            return Err("document and shuffle indices must be 1-D".to_string());
        }
        if sample_index.shape.len() != 2 || sample_index.shape[1] != 2 {
            return Err(format!(
                "sample index must have shape [n, 2], found {:?}",
                sample_index.shape
            ));
        }
        if sample_index.shape[0] != shuffle_index.data.len() + 1 {
            return Err(format!(
                "sample index has {} rows but the shuffle index has {} entries",
                sample_index.shape[0],
                shuffle_index.data.len()
            ));
        }
        Ok(GptIndices {
            document_index: document_index.data,
            sample_index: sample_index.data,
            shuffle_index: shuffle_index.data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_golden_example() {
        let sizes = [5, 3, 8, 2, 6];
        let plan = EpochPlan::new(24, 4, Some(7), 1).unwrap();
        let indices = GptIndices::build(&IndexRequest {
            sequence_lengths: &sizes,
            documents: 0..5,
            plan,
            sequence_length: 4,
            seed: 1234,
            drop_last_partial_sequence: true,
            add_extra_token: true,
        });
        assert_eq!(
            indices.document_index,
            IndexArray::I32(vec![4, 0, 1, 2, 3, 3, 2, 1, 0, 4])
        );
        assert_eq!(
            indices.shuffle_index,
            IndexArray::U32(vec![2, 0, 4, 3, 1, 6, 10, 7, 5, 9, 8])
        );
        assert_eq!(indices.num_samples(), 11);
        assert_eq!(indices.sample_row(11), (9, 2));
    }
}
