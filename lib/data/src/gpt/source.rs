//! Where sample tokens come from: an indexed dataset on disk or the synthetic mock corpus.

use crate::indexed::IndexedDataset;

/// A low-level token store addressed by sequence.
pub trait TokenSource: Send + Sync {
    /// Length of every sequence, in tokens.
    fn sequence_lengths(&self) -> &[i32];

    /// Tokens `offset..offset+length` (to the end when `length` is `None`) of `sequence`,
    /// appended to `out`.
    fn read_into(&self, sequence: usize, offset: usize, length: Option<usize>, out: &mut Vec<i64>);
}

impl TokenSource for IndexedDataset {
    fn sequence_lengths(&self) -> &[i32] {
        IndexedDataset::sequence_lengths(self)
    }

    fn read_into(&self, sequence: usize, offset: usize, length: Option<usize>, out: &mut Vec<i64>) {
        let dtype = self.dtype();
        let bytes = self.get_bytes(sequence, offset, length);
        out.extend(bytes.chunks_exact(dtype.size()).map(|c| dtype.read_le(c)));
    }
}

/// A token store that also knows its documents: the BERT/T5 datasets sample whole sentences
/// (sequences) within documents.
pub trait SentenceSource: TokenSource {
    /// Document `d` spans sequences `document_indices[d]..document_indices[d + 1]`.
    fn document_indices(&self) -> &[i64];
}

impl SentenceSource for IndexedDataset {
    fn document_indices(&self) -> &[i64] {
        IndexedDataset::document_indices(self)
    }
}
