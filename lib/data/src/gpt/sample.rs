//! One training sample from a window of raw tokens: inputs, labels, loss mask, position ids
//! and the optional causal attention mask (Megatron's `__getitem__` + ltor masks).

use super::config::SampleOptions;

/// What training reads for one index.
#[derive(Debug, Clone, PartialEq)]
pub struct GptSample {
    pub tokens: Vec<i64>,
    pub labels: Vec<i64>,
    pub loss_mask: Vec<f32>,
    pub position_ids: Vec<i64>,
    /// Row-major `[S, S]`, `true` = masked out; `None` when attention masks are not created.
    pub attention_mask: Option<Vec<bool>>,
    /// With `reset_attention_mask`, the lengths of the documents the sequence packs (each
    /// ends with an end-of-document token, the last at the sequence's end): attention stays
    /// within each, as the dense mask says, without building it.
    pub document_lengths: Option<Vec<i64>>,
}

impl GptSample {
    /// Builds the sample from `text` (`S + 1` tokens with the extra token, else `S`).
    pub fn from_text(text: &[i64], add_extra_token: bool, options: &SampleOptions) -> GptSample {
        let (mut tokens, mut labels) = if add_extra_token {
            let s = text.len() - 1;
            (text[..s].to_vec(), text[1..].to_vec())
        } else {
            let mut labels = text[1..].to_vec();
            labels.push(options.pad_token);
            (text.to_vec(), labels)
        };
        let s = tokens.len();

        let mut loss_mask = vec![1.0f32; s];
        let mut position_ids: Vec<i64> = (0..s as i64).collect();
        let mut visible = options
            .create_attention_mask
            .then(|| (0..s * s).map(|k| k % s <= k / s).collect::<Vec<bool>>());

        if options.eod_mask_loss {
            for (mask, &token) in loss_mask.iter_mut().zip(&tokens) {
                if token == options.eod_token {
                    *mask = 0.0;
                }
            }
        }
        if options.reset_position_ids || options.reset_attention_mask {
            let mut document_start = 0usize;
            for i in (0..s).filter(|&i| tokens[i] == options.eod_token) {
                if options.reset_attention_mask {
                    if let Some(visible) = visible.as_mut() {
                        for row in i + 1..s {
                            visible[row * s..row * s + i + 1].fill(false);
                        }
                    }
                }
                if options.reset_position_ids {
                    let shift = (i + 1 - document_start) as i64;
                    for position in &mut position_ids[i + 1..] {
                        *position -= shift;
                    }
                    document_start = i + 1;
                }
            }
        }

        let document_lengths = options
            .reset_attention_mask
            .then(|| document_lengths(&tokens, options.eod_token));
        for ((mask, token), label) in loss_mask.iter_mut().zip(&mut tokens).zip(&mut labels) {
            if *label == options.pad_token {
                *mask = 0.0;
                *label = 0;
            }
            if *token == options.pad_token {
                *token = 0;
            }
        }
        GptSample {
            tokens,
            labels,
            loss_mask,
            position_ids,
            attention_mask: visible.map(|v| v.into_iter().map(|seen| !seen).collect()),
            document_lengths,
        }
    }

    /// The sample handed out for batch padding (index `None`): nothing contributes to the loss.
    pub fn into_padding(mut self) -> GptSample {
        self.loss_mask.fill(0.0);
        self
    }
}

/// The lengths of the documents of `tokens`, cut after each `eod` (Megatron's mask reset).
fn document_lengths(tokens: &[i64], eod: i64) -> Vec<i64> {
    let mut lengths = Vec::new();
    let mut start = 0;
    for i in (0..tokens.len()).filter(|&i| tokens[i] == eod) {
        lengths.push((i + 1 - start) as i64);
        start = i + 1;
    }
    if start < tokens.len() {
        lengths.push((tokens.len() - start) as i64);
    }
    lengths
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOD: i64 = 9;

    fn options(reset_positions: bool, reset_attention: bool, eod_mask: bool) -> SampleOptions {
        SampleOptions {
            eod_token: EOD,
            pad_token: -1,
            reset_position_ids: reset_positions,
            reset_attention_mask: reset_attention,
            eod_mask_loss: eod_mask,
            create_attention_mask: true,
        }
    }

    #[test]
    fn plain_sample_shifts_labels_and_is_causal() {
        let sample = GptSample::from_text(&[1, 2, EOD, 3, 4], true, &options(false, false, false));
        assert_eq!(sample.tokens, [1, 2, EOD, 3]);
        assert_eq!(sample.labels, [2, EOD, 3, 4]);
        assert_eq!(sample.loss_mask, [1.0; 4]);
        assert_eq!(sample.position_ids, [0, 1, 2, 3]);
        let mask = sample.attention_mask.unwrap();
        assert!(!mask[0] && mask[1] && !mask[4] && !mask[5] && mask[6]);
    }

    #[test]
    fn resets_restart_positions_and_hide_earlier_documents_after_eod() {
        let sample = GptSample::from_text(&[1, EOD, 3, 4, 5], true, &options(true, true, true));
        assert_eq!(sample.position_ids, [0, 1, 0, 1]);
        assert_eq!(sample.loss_mask, [1.0, 0.0, 1.0, 1.0]);
        let mask = sample.attention_mask.unwrap();
        let row = |r: usize| mask[r * 4..r * 4 + 4].to_vec();
        assert_eq!(row(1), [false, false, true, true]);
        assert_eq!(row(2), [true, true, false, true]);
        assert_eq!(row(3), [true, true, false, false]);
        assert_eq!(sample.document_lengths, Some(vec![2, 2]));
    }

    #[test]
    fn document_lengths_agree_with_the_dense_mask() {
        let text = [EOD, 1, 2, EOD, EOD, 3, 4, 5, EOD, 6, 7];
        let sample = GptSample::from_text(&text, true, &options(false, true, false));
        let lengths = sample.document_lengths.clone().unwrap();
        assert_eq!(lengths, [1, 3, 1, 4, 1]);
        let mask = sample.attention_mask.unwrap();
        let s = sample.tokens.len();
        let mut document_of = Vec::new();
        for (document, &n) in lengths.iter().enumerate() {
            document_of.extend(std::iter::repeat_n(document, n as usize));
        }
        for row in 0..s {
            for column in 0..s {
                let visible = column <= row && document_of[row] == document_of[column];
                assert_eq!(
                    !mask[row * s + column],
                    visible,
                    "row {row}, column {column}"
                );
            }
        }
    }

    #[test]
    fn without_extra_token_the_last_label_is_padding_and_masked() {
        let sample = GptSample::from_text(&[5, 6, 7], false, &options(false, false, false));
        assert_eq!(sample.tokens, [5, 6, 7]);
        assert_eq!(sample.labels, [6, 7, 0]);
        assert_eq!(sample.loss_mask, [1.0, 1.0, 0.0]);
    }
}
