//! The shuffle index: a permutation of the samples, with the final epoch's samples shuffled
//! on their own when the epoch plan says so.

use crate::cache::IndexArray;
use crate::random::RandomState;

/// `uint32` unless the sample count reaches `2^32 - 2`, then `int64` (Megatron's rule).
pub fn build_shuffle_index(
    first_range_len: usize,
    total: usize,
    rng: &mut RandomState,
) -> IndexArray {
    if (total as u64) < u64::from(u32::MAX) - 1 {
        IndexArray::U32(shuffled_ranges(first_range_len, total, rng, |v| v as u32))
    } else {
        IndexArray::I64(shuffled_ranges(first_range_len, total, rng, |v| v as i64))
    }
}

fn shuffled_ranges<T>(
    first_range_len: usize,
    total: usize,
    rng: &mut RandomState,
    convert: impl Fn(usize) -> T,
) -> Vec<T> {
    let mut index: Vec<T> = (0..total).map(convert).collect();
    let (first, rest) = index.split_at_mut(first_range_len);
    rng.shuffle(first);
    if !rest.is_empty() {
        rng.shuffle(rest);
    }
    index
}
