//! The document index: the split's sequence ids repeated once per epoch, then shuffled.

use std::ops::Range;

use crate::random::RandomState;

/// Builds `document_index` (int32) for the sequences `documents`, drawing from `rng`.
pub fn build_document_index(
    documents: Range<usize>,
    num_epochs: u64,
    separate_final_epoch: bool,
    rng: &mut RandomState,
) -> Vec<i32> {
    if separate_final_epoch && num_epochs > 1 {
        let mut index = build_document_index(documents.clone(), num_epochs - 1, false, rng);
        index.extend(build_document_index(documents, 1, false, rng));
        return index;
    }
    let mut index = Vec::with_capacity(documents.len() * num_epochs as usize);
    for _ in 0..num_epochs {
        index.extend(documents.clone().map(|d| d as i32));
    }
    rng.shuffle(&mut index);
    index
}
