//! The sample index: where each `sequence_length (+1)`-token window starts, as
//! (position in the document index, token offset) pairs — Megatron's `build_sample_idx`.

use crate::cache::IndexArray;

/// Inputs of the sample-index walk.
pub struct SampleIndexInput<'a> {
    /// Lengths of every sequence of the low-level dataset (not only the split's).
    pub sequence_lengths: &'a [i32],
    pub document_index: &'a [i32],
    pub sequence_length: u64,
    pub num_epochs: u64,
    pub tokens_per_epoch: u64,
    pub drop_last_partial_sequence: bool,
    pub add_extra_token: bool,
}

/// The flattened `[num_samples + 1, 2]` array, int32 when every value fits, else int64.
pub fn build_sample_index(input: &SampleIndexInput) -> IndexArray {
    let largest = input
        .sequence_lengths
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .max(0) as usize;
    if input.document_index.len().max(largest) <= i32::MAX as usize {
        IndexArray::I32(walk(input, |v| v as i32))
    } else {
        IndexArray::I64(walk(input, |v| v))
    }
}

fn walk<T: Copy>(input: &SampleIndexInput, convert: impl Fn(i64) -> T) -> Vec<T> {
    let extra = i64::from(input.add_extra_token);
    let sequence_length = input.sequence_length as i64;
    let total = (input.num_epochs * input.tokens_per_epoch) as i64 - extra;
    let num_samples = if input.drop_last_partial_sequence {
        total / sequence_length
    } else {
        // Megatron computes this ceil in 32-bit float; keep that so lengths agree.
        (total as f32 / sequence_length as f32).ceil() as i64
    };
    let last_position = input.document_index.len() as i64 - 1;
    let length_of = |position: i64| {
        i64::from(input.sequence_lengths[input.document_index[position as usize] as usize])
    };

    let mut rows = Vec::with_capacity(2 * (num_samples as usize + 1));
    let mut position = 0i64;
    let mut offset = 0i64;
    rows.push(convert(position));
    rows.push(convert(offset));
    for _ in 0..num_samples {
        let mut remaining = sequence_length + extra;
        while remaining != 0 {
            let available = length_of(position) - offset;
            remaining -= available;
            if remaining <= 0 {
                offset += remaining + available - extra;
                remaining = 0;
            } else if position == last_position {
                offset = length_of(position) - extra;
                break;
            } else {
                position += 1;
                offset = 0;
            }
        }
        rows.push(convert(position));
        rows.push(convert(offset));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_input(drop_last: bool, extra: bool) -> Vec<i64> {
        let sizes = [5, 3, 8, 2, 6];
        let document_index = [4, 0, 1, 2, 3, 3, 2, 1, 0, 4];
        build_sample_index(&SampleIndexInput {
            sequence_lengths: &sizes,
            document_index: &document_index,
            sequence_length: 4,
            num_epochs: 2,
            tokens_per_epoch: 24,
            drop_last_partial_sequence: drop_last,
            add_extra_token: extra,
        })
        .to_i64_vec()
    }

    const SPEC_ROWS: [i64; 24] = [
        0, 0, 0, 4, 1, 2, 2, 1, 3, 2, 3, 6, 5, 0, 6, 2, 6, 6, 7, 2, 8, 3, 9, 2,
    ];

    #[test]
    fn spec_golden_rows() {
        assert_eq!(spec_input(true, true), SPEC_ROWS);
    }

    #[test]
    fn keeping_the_partial_sequence_adds_a_row() {
        let mut expected = SPEC_ROWS.to_vec();
        expected.extend([9, 5]);
        assert_eq!(spec_input(false, true), expected);
    }

    #[test]
    fn without_the_extra_token_windows_do_not_overlap() {
        assert_eq!(
            spec_input(true, false),
            [0, 0, 0, 4, 1, 2, 2, 1, 3, 2, 3, 6, 4, 2, 6, 2, 6, 6, 7, 2, 8, 3, 9, 2, 9, 6]
        );
    }
}
