//! `BERTMaskedWordPieceDataset`: `[CLS] A [SEP] B [SEP]` samples with optional segment swap
//! (sentence-order prediction) and BERT's 80/10/10 masking.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;

use crate::blend::BlendMember;
use crate::cache::PyJson;
use crate::gpt::{SentenceSource, Split};
use crate::random::RandomState;

use super::config::BertDatasetConfig;
use super::dataset::{MaskedKind, MaskedWordPieceDataset};
use super::masking::mask_tokens;

const CLASS: &str = "BERTMaskedWordPieceDataset";

/// One BERT training sample, field for field as Megatron's `__getitem__` returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BertSample {
    /// `[CLS] A [SEP] B [SEP]` after masking, padded with the pad id to the sequence length.
    pub text: Vec<i64>,
    /// Segment ids: 0 for `[CLS] A [SEP]`, 1 for `B [SEP]`, 0 on padding.
    pub types: Vec<i64>,
    /// The original id at masked positions, −1 elsewhere.
    pub labels: Vec<i64>,
    /// A and B were swapped (the sentence-order label).
    pub is_random: bool,
    /// 1 on real tokens, 0 on padding.
    pub padding_mask: Vec<i64>,
    /// 1 at masked positions.
    pub loss_mask: Vec<i64>,
    /// Tokens were dropped to fit the sample's target length.
    pub truncated: bool,
}

pub struct BertMaskedWordPieceDataset {
    base: MaskedWordPieceDataset,
    config: Arc<BertDatasetConfig>,
}

impl BertMaskedWordPieceDataset {
    /// Builds (or loads from cache) the sample index of `split`, covering `documents` of
    /// `source`; `dataset_path` is the prefix exactly as the user wrote it.
    pub fn new(
        source: Arc<dyn SentenceSource>,
        dataset_path: &str,
        documents: Range<usize>,
        num_samples: Option<u64>,
        split: Split,
        config: Arc<BertDatasetConfig>,
    ) -> Result<BertMaskedWordPieceDataset> {
        let masked = &config.masked;
        if masked.sequence_length < 5 {
            anyhow::bail!(
                "--seq-length must be at least 5 for BERT, got {}",
                masked.sequence_length
            );
        }
        let kind = MaskedKind {
            class: CLASS,
            extra_identifiers: vec![(
                "classification_head".into(),
                PyJson::Bool(config.classification_head),
            )],
            // One [CLS] and two [SEP].
            max_seq_length: masked.sequence_length - 3,
            min_sentences: if config.classification_head { 2 } else { 1 },
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
        Ok(BertMaskedWordPieceDataset { base, config })
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

    /// Sample `idx` (0..len).
    pub fn get(&self, idx: usize) -> BertSample {
        let masked = &self.config.masked;
        let vocab = &masked.vocab;
        let sample = self.base.sample_sentences(idx);
        let mut rng = sample.rng;
        let sentences = sample.sentences;
        let target = sample.target_length;

        let mut pivot = sentences.len();
        let mut is_random = false;
        if self.config.classification_head {
            pivot = 1;
            if sentences.len() >= 3 {
                pivot = rng.randint(1, sentences.len() as i64) as usize;
            }
            is_random = rng.random() < 0.5;
        }
        let mut a: Vec<i64> = sentences[..pivot].concat();
        let mut b: Vec<i64> = sentences[pivot..].concat();
        if is_random {
            std::mem::swap(&mut a, &mut b);
        }

        let truncated = a.len() + b.len() > target;
        // Trim the longer segment (B on ties) from a random end until both fit.
        let (mut a_range, mut b_range) = (0..a.len(), 0..b.len());
        while a_range.len() + b_range.len() > target {
            let side = if a_range.len() > b_range.len() {
                &mut a_range
            } else {
                &mut b_range
            };
            if rng.random() < 0.5 {
                side.start += 1;
            } else {
                side.end -= 1;
            }
        }
        let (a, b) = (&a[a_range], &b[b_range]);

        let mut tokens = Vec::with_capacity(masked.sequence_length);
        tokens.push(vocab.cls);
        tokens.extend_from_slice(a);
        tokens.push(vocab.sep);
        let mut types = vec![0; tokens.len()];
        if !b.is_empty() {
            tokens.extend_from_slice(b);
            tokens.push(vocab.sep);
            types.resize(tokens.len(), 1);
        }

        let lookup = vocab.token_lookup();
        let mask_id = vocab.mask;
        let mut token_mask = |rng: &mut RandomState| -> Option<i64> {
            if rng.random() < 0.8 {
                Some(mask_id)
            } else if rng.random() >= 0.5 {
                Some(lookup[rng.randint(0, lookup.len() as i64) as usize])
            } else {
                None
            }
        };
        let masked_tokens = mask_tokens(
            &tokens,
            target,
            &masked.masking,
            vocab,
            &mut rng,
            &mut token_mask,
        );

        let length = masked.sequence_length;
        let real = masked_tokens.tokens.len();
        let mut text = masked_tokens.tokens;
        text.resize(length, vocab.pad);
        // Megatron pads these two with the pad id too. That is 0 for WordPiece, but
        // SentencePiece's pad id lies past the two segment types and reads as a real token
        // in the mask, so Megatron's BERT cannot train on SentencePiece data; 0 is what the
        // model needs, and what Megatron gives for WordPiece.
        types.resize(length, 0);
        let mut padding_mask = vec![1; real];
        padding_mask.resize(length, 0);
        let mut labels = vec![-1; length];
        let mut loss_mask = vec![0; length];
        for (&position, &label) in masked_tokens.positions.iter().zip(&masked_tokens.labels) {
            labels[position] = label;
            loss_mask[position] = 1;
        }
        BertSample {
            text,
            types,
            labels,
            is_random,
            padding_mask,
            loss_mask,
            truncated,
        }
    }
}

impl BlendMember for BertMaskedWordPieceDataset {
    type Sample = BertSample;

    fn len(&self) -> usize {
        self.base.len()
    }

    fn split(&self) -> Split {
        self.base.split()
    }

    fn identifiers(&self) -> &PyJson {
        self.base.identifiers()
    }

    fn sample(&self, idx: usize) -> BertSample {
        self.get(idx)
    }
}
