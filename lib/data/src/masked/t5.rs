//! `T5MaskedWordPieceDataset`: span corruption. Masked spans become sentinels in the encoder
//! input; the decoder reads `[BOS]` then each sentinel with its span and predicts the same
//! shifted, ending in `[EOS]`.

use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, Result};

use crate::blend::BlendMember;
use crate::cache::PyJson;
use crate::gpt::{SentenceSource, Split};

use super::config::T5DatasetConfig;
use super::dataset::{MaskedKind, MaskedWordPieceDataset};
use super::masking::mask_tokens;

const CLASS: &str = "T5MaskedWordPieceDataset";

/// One T5 training sample, field for field as Megatron's `__getitem__` returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct T5Sample {
    /// Encoder input: the text with each masked span replaced by its sentinel, padded with
    /// the pad id to the encoder length.
    pub text_enc: Vec<i64>,
    /// Decoder input: `[BOS]`, then each sentinel followed by its span; padded.
    pub text_dec: Vec<i64>,
    /// Decoder targets: each sentinel with its span, then `[EOS]`; −1 on padding.
    pub labels: Vec<i64>,
    /// 1 on the decoder's real positions.
    pub loss_mask: Vec<i64>,
    /// The sample's sentences were cut to its target length.
    pub truncated: bool,
    /// 1 on the encoder's real positions, 0 on padding (the model builds 2-D masks from it).
    pub enc_mask: Vec<i64>,
    /// 1 on the decoder's real positions, 0 on padding.
    pub dec_mask: Vec<i64>,
}

pub struct T5MaskedWordPieceDataset {
    base: MaskedWordPieceDataset,
    config: Arc<T5DatasetConfig>,
    bos: i64,
    eos: i64,
}

impl T5MaskedWordPieceDataset {
    /// Builds (or loads from cache) the sample index of `split`, covering `documents` of
    /// `source`; `dataset_path` is the prefix exactly as the user wrote it.
    pub fn new(
        source: Arc<dyn SentenceSource>,
        dataset_path: &str,
        documents: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: Arc<T5DatasetConfig>,
    ) -> Result<T5MaskedWordPieceDataset> {
        let masked = &config.masked;
        let vocab = &masked.vocab;
        let (Some(bos), Some(eos)) = (vocab.bos, vocab.eos) else {
            bail!("T5 data needs a tokenizer with [BOS] and [EOS] (Megatron's legacy BertWordPiece adds them)");
        };
        if vocab.sentinels.is_empty() {
            bail!(
                "T5 data needs sentinel tokens: pass --vocab-extra-ids N (the T5 example uses 100)"
            );
        }
        if masked.sequence_length < 4 || config.sequence_length_decoder < 2 {
            bail!(
                "T5 needs --encoder-seq-length of at least 4 and --decoder-seq-length of at least 2, \
                 got {} and {}",
                masked.sequence_length,
                config.sequence_length_decoder
            );
        }
        let kind = MaskedKind {
            class: CLASS,
            extra_identifiers: vec![(
                "sequence_length_decoder".into(),
                PyJson::Int(config.sequence_length_decoder as i64),
            )],
            // Room for [BOS] and [EOS].
            max_seq_length: masked.sequence_length - 2,
            min_sentences: 1,
        };
        let base = MaskedWordPieceDataset::new(
            kind,
            source,
            dataset_path,
            documents,
            num_samples,
            split,
            masked,
        )?;
        Ok(T5MaskedWordPieceDataset {
            base,
            config,
            bos,
            eos,
        })
    }

    /// The shared index, cache and description.
    pub fn base(&self) -> &MaskedWordPieceDataset {
        &self.base
    }

    pub fn len(&self) -> usize {
        self.base.len()
    }

    pub fn is_empty(&self) -> bool {
        self.base.is_empty()
    }

    /// Sample `idx` (0..len). Megatron asserts where this returns an error: more spans than
    /// sentinels, or a decoder sequence longer than `--decoder-seq-length`.
    pub fn get(&self, idx: usize) -> Result<T5Sample> {
        let masked = &self.config.masked;
        let vocab = &masked.vocab;
        let sample = self.base.sample_sentences(idx);
        let mut rng = sample.rng;
        let target = sample.target_length;

        let mut tokens: Vec<i64> = sample.sentences.concat();
        let truncated = tokens.len() > target;
        tokens.truncate(target);

        let mask_id = vocab.mask;
        let masked_tokens = mask_tokens(
            &tokens,
            target,
            &masked.masking,
            vocab,
            &mut rng,
            &mut |_| Some(mask_id),
        );
        let spans = &masked_tokens.spans;
        if spans.len() > vocab.sentinels.len() {
            bail!(
                "sample {idx} of the {} split has {} masked spans but only {} sentinels; raise \
                 --vocab-extra-ids",
                self.base.split().name(),
                spans.len(),
                vocab.sentinels.len()
            );
        }

        let tokens = &masked_tokens.tokens;
        let mut encoder = Vec::with_capacity(masked.sequence_length);
        let mut decoder_input = vec![self.bos];
        let mut decoder_output = Vec::new();
        let mut start = 0;
        for (span, &sentinel) in spans.iter().zip(&vocab.sentinels) {
            encoder.extend_from_slice(&tokens[start..span.positions[0]]);
            encoder.push(sentinel);
            decoder_input.push(sentinel);
            decoder_input.extend_from_slice(&span.labels);
            decoder_output.push(sentinel);
            decoder_output.extend_from_slice(&span.labels);
            start = span.positions[span.positions.len() - 1] + 1;
        }
        encoder.extend_from_slice(&tokens[start..]);
        decoder_output.push(self.eos);

        let encoder_length = masked.sequence_length;
        let decoder_length = self.config.sequence_length_decoder;
        if encoder.len() > encoder_length || decoder_input.len() > decoder_length {
            bail!(
                "sample {idx} of the {} split needs {} encoder and {} decoder positions, more than \
                 --encoder-seq-length {encoder_length} / --decoder-seq-length {decoder_length} \
                 (Megatron fails an assertion here); raise --decoder-seq-length",
                self.base.split().name(),
                encoder.len(),
                decoder_input.len()
            );
        }
        let real_encoder = encoder.len();
        let real_decoder = decoder_input.len();
        let pad = vocab.pad;
        encoder.resize(encoder_length, pad);
        decoder_input.resize(decoder_length, pad);
        decoder_output.resize(decoder_length, -1);
        let ones_then_zeros = |ones: usize, length: usize| {
            let mut mask = vec![1; ones];
            mask.resize(length, 0);
            mask
        };
        Ok(T5Sample {
            text_enc: encoder,
            text_dec: decoder_input,
            labels: decoder_output,
            loss_mask: ones_then_zeros(real_decoder, decoder_length),
            truncated,
            enc_mask: ones_then_zeros(real_encoder, encoder_length),
            dec_mask: ones_then_zeros(real_decoder, decoder_length),
        })
    }
}

impl BlendMember for T5MaskedWordPieceDataset {
    type Sample = Result<T5Sample>;

    fn len(&self) -> usize {
        self.base.len()
    }

    fn split(&self) -> Split {
        self.base.split()
    }

    fn identifiers(&self) -> &PyJson {
        self.base.identifiers()
    }

    fn sample(&self, idx: usize) -> Result<T5Sample> {
        self.get(idx)
    }
}
