//! One evaluation sample as Megatron's zero-shot datasets yield it.

/// `text`: `seq_length + 1` token ids (inputs are all but the last, labels all but the first);
/// `pad_mask`: `seq_length` entries, 1 where the label is scored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSample {
    pub text: Vec<u32>,
    pub pad_mask: Vec<u8>,
}

impl TaskSample {
    /// `tokens` right-padded with `pad` to `seq_length + 1`; `scored` flags each of `tokens`
    /// (padding is never scored); the mask drops the first flag, as labels drop the first token.
    pub(crate) fn padded(
        mut tokens: Vec<u32>,
        mut scored: Vec<u8>,
        seq_length: usize,
        pad: u32,
    ) -> Self {
        debug_assert_eq!(tokens.len(), scored.len());
        if tokens.len() < seq_length + 1 {
            scored.resize(seq_length + 1, 0);
            tokens.resize(seq_length + 1, pad);
        }
        scored.remove(0);
        TaskSample {
            text: tokens,
            pad_mask: scored,
        }
    }

    /// Positions (into the labels) that are scored.
    pub fn scored_positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.pad_mask
            .iter()
            .enumerate()
            .filter(|(_, &m)| m != 0)
            .map(|(i, _)| i)
    }
}
