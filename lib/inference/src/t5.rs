//! What a trained T5 learned (`generate_samples_t5`): teacher-forced scores of span-corruption
//! samples, counted as the training loss counts them, and greedy decoding of encoder inputs
//! with the decoder's keys and values cached step by step.

use anyhow::{bail, ensure, Result};
use megatron_data::masked::MaskedTokenizer;
use serde::Serialize;
use tch::{Device, Kind, Tensor};

use megatron_cli::python_format::format_exp_upper;
use megatron_models::mask_extra_vocabulary;
use megatron_models::T5Batch;
use megatron_models::{cross_entropy, T5Input, T5Model};
use megatron_parallel::gather_from_tensor_parallel_region;

/// One sample's teacher-forced score: the cross entropy summed over its decoder targets
/// (nats), how many targets it has and how many of them the model ranks first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct SampleScore {
    pub loss_sum: f64,
    pub tokens: u64,
    pub correct: u64,
}

impl SampleScore {
    /// The token-averaged cross entropy (0 without targets).
    pub fn loss(&self) -> f64 {
        self.loss_sum / self.tokens.max(1) as f64
    }

    /// The fraction of targets that are the model's first choice.
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.tokens.max(1) as f64
    }
}

/// Scores of many samples summed: the loss is the token-sum normalised mean, as training's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScoreTotals {
    pub samples: u64,
    pub total: SampleScore,
}

impl ScoreTotals {
    pub fn add(&mut self, score: &SampleScore) {
        self.samples += 1;
        self.total.loss_sum += score.loss_sum;
        self.total.tokens += score.tokens;
        self.total.correct += score.correct;
    }

    /// `generate_samples_t5`'s one-line summary.
    pub fn line(&self, split: &str) -> String {
        let loss = self.total.loss();
        format!(
            "generate_samples_t5: {} {split} samples, {} target tokens, lm loss {}, lm loss PPL {}, \
             token accuracy {:.4}",
            self.samples,
            self.total.tokens,
            format_exp_upper(loss, 6),
            format_exp_upper(loss.min(20.0).exp(), 6),
            self.total.accuracy()
        )
    }
}

/// Teacher-forced scores of every sample of `batch` (on the model's device), with the loss
/// training computes: the cross entropy of each decoder target under the loss mask. Every
/// tensor-parallel rank calls it with the same batch; the vocabulary padding that tensor
/// parallelism adds is left out, so any tensor-parallel size gives one rank's numbers.
pub fn score_t5_batch(model: &T5Model, batch: &T5Batch) -> Result<Vec<SampleScore>> {
    let group = model.tensor_group();
    let trunk = &model.config.transformer;
    tch::no_grad(|| {
        let logits = model.forward(
            &T5Input {
                encoder_tokens: &batch.text_enc,
                decoder_tokens: &batch.text_dec,
                encoder_mask: &batch.enc_mask,
            },
            false,
        )?;
        let logits = mask_extra_vocabulary(logits, trunk.padded_vocab_size(1), group.rank());
        // Padding carries label -1 and loss mask 0; the lookup needs a valid index.
        let labels = batch.labels.clamp_min(0);
        let mask = batch.loss_mask.to_kind(Kind::Double);
        let losses = cross_entropy(&logits, &labels, group)?.to_kind(Kind::Double) * &mask;
        // The first choice among the tokenizer's tokens, from the gathered vocabulary.
        let predicted = gather_from_tensor_parallel_region(&logits, group)?
            .narrow(-1, 0, trunk.vocab_size)
            .argmax(-1, false)
            .transpose(0, 1);
        let correct = predicted.eq_tensor(&labels).to_kind(Kind::Double) * &mask;
        let per_sample = |t: &Tensor| -> Result<Vec<f64>> {
            Ok(Vec::<f64>::try_from(
                t.sum_dim_intlist(1, false, Kind::Double)
                    .to_device(Device::Cpu),
            )?)
        };
        let (loss_sums, correct, tokens) = (
            per_sample(&losses)?,
            per_sample(&correct)?,
            per_sample(&mask)?,
        );
        Ok(loss_sums
            .iter()
            .zip(&correct)
            .zip(&tokens)
            .map(|((&loss_sum, &correct), &tokens)| SampleScore {
                loss_sum,
                tokens: tokens as u64,
                correct: correct as u64,
            })
            .collect())
    })
}

/// How greedy decoding starts and stops.
#[derive(Debug, Clone, Copy)]
pub struct GreedyOptions {
    /// Tokens to decode at most per input.
    pub max_decode_length: usize,
    /// The decoder's first input (`[BOS]`, as the T5 data starts its decoder input).
    pub bos: i64,
    /// Decoding of an input stops when the model picks this token.
    pub eos: Option<i64>,
}

/// Greedy decoding of `encoder_tokens` `[b, se]` (`encoder_mask` 1 on real tokens, 0 on
/// padding), on the model's device: the encoder runs once, then the decoder one position per
/// step through its KV cache, starting from `bos` and taking the most likely of the
/// tokenizer's tokens until it picks `eos` or has `max_decode_length` tokens. Returns each
/// row's decoded tokens without `bos` and `eos`. Every tensor-parallel rank calls it with the
/// same input and gets the same tokens.
pub fn greedy_decode(
    model: &T5Model,
    encoder_tokens: &Tensor,
    encoder_mask: &Tensor,
    options: &GreedyOptions,
) -> Result<Vec<Vec<i64>>> {
    let (rows, _) = encoder_tokens.size2()?;
    ensure!(rows > 0, "nothing to decode");
    ensure!(
        options.max_decode_length >= 1,
        "--max-decode-length must be at least 1"
    );
    let vocabulary = model.config.transformer.vocab_size;
    ensure!(
        (0..vocabulary).contains(&options.bos),
        "the decoder's start token {} is outside the vocabulary of {vocabulary} tokens",
        options.bos
    );
    let device = model.options().device;
    tch::no_grad(|| {
        let memory = model.encode(encoder_tokens, encoder_mask, false)?;
        let mut state = model.start_decoding(&memory, options.max_decode_length as i64)?;
        let mut decoded = vec![Vec::new(); rows as usize];
        let mut finished = vec![false; rows as usize];
        let mut input = Tensor::full([rows, 1], options.bos, (Kind::Int64, device));
        for step in 0..options.max_decode_length {
            let logits = model.decode_cached(&input, &mut state)?;
            let next = logits.get(0).narrow(-1, 0, vocabulary).argmax(-1, false);
            let ids = Vec::<i64>::try_from(next.to_device(Device::Cpu))?;
            for (row, &id) in ids.iter().enumerate() {
                if finished[row] {
                    continue;
                }
                if Some(id) == options.eos {
                    finished[row] = true;
                } else {
                    decoded[row].push(id);
                }
            }
            if finished.iter().all(|&f| f) || step + 1 == options.max_decode_length {
                break;
            }
            input = next.unsqueeze(1);
        }
        Ok(decoded)
    })
}

const SENTINEL_OPEN: &str = "<extra_id_";

/// The encoder ids of `text`, in which `<extra_id_N>` marks a masked span (the sentinels of
/// `--vocab-extra-ids`, which the tokenizer's own rules would split into pieces); the text
/// between sentinels is tokenized as the data is.
pub fn encode_with_sentinels(tokenizer: &MaskedTokenizer, text: &str) -> Result<Vec<i64>> {
    let sentinels = &tokenizer.vocab.sentinels;
    let mut ids = Vec::new();
    let mut rest = text;
    let mut any = false;
    while let Some(at) = rest.find(SENTINEL_OPEN) {
        let after = &rest[at + SENTINEL_OPEN.len()..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || !after[digits..].starts_with('>') {
            bail!(
                "{:?}: a sentinel is written <extra_id_N> with N a number",
                &rest[at..(at + SENTINEL_OPEN.len() + digits + 1).min(rest.len())]
            );
        }
        let number: usize = after[..digits].parse()?;
        let Some(&sentinel) = sentinels.get(number) else {
            bail!(
                "<extra_id_{number}>: the tokenizer has {} sentinels (--vocab-extra-ids {}), \
                 <extra_id_0> to <extra_id_{}>",
                sentinels.len(),
                sentinels.len(),
                sentinels.len().saturating_sub(1)
            );
        };
        ids.extend(
            tokenizer
                .tokenizer
                .tokenize(&rest[..at])?
                .iter()
                .map(|&t| i64::from(t)),
        );
        ids.push(sentinel);
        any = true;
        rest = &after[digits + 1..];
    }
    ids.extend(
        tokenizer
            .tokenizer
            .tokenize(rest)?
            .iter()
            .map(|&t| i64::from(t)),
    );
    if !any {
        bail!(
            "{text:?} has no sentinel: mark the spans for T5 to fill with <extra_id_0>, \
             <extra_id_1>, ..."
        );
    }
    Ok(ids)
}

/// A decoded sentinel and the tokens that follow it up to the next sentinel (`sentinel` is
/// `None` for tokens decoded before any sentinel).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedSpan {
    pub sentinel: Option<i64>,
    pub tokens: Vec<i64>,
}

/// `tokens` split at the `sentinels`.
pub fn split_spans(tokens: &[i64], sentinels: &[i64]) -> Vec<DecodedSpan> {
    let mut spans: Vec<DecodedSpan> = Vec::new();
    for &token in tokens {
        if sentinels.contains(&token) {
            spans.push(DecodedSpan {
                sentinel: Some(token),
                tokens: Vec::new(),
            });
        } else {
            match spans.last_mut() {
                Some(span) => span.tokens.push(token),
                None => spans.push(DecodedSpan {
                    sentinel: None,
                    tokens: vec![token],
                }),
            }
        }
    }
    spans
}

/// `encoder` with each sentinel replaced by the span decoded for it; sentinels the decoder
/// gave no span keep their place.
pub fn fill_spans(encoder: &[i64], spans: &[DecodedSpan]) -> Vec<i64> {
    let mut out = Vec::with_capacity(encoder.len());
    for &token in encoder {
        match spans.iter().find(|s| s.sentinel == Some(token)) {
            Some(span) => out.extend_from_slice(&span.tokens),
            None => out.push(token),
        }
    }
    out
}

/// One decoded input as text: what the encoder read, the decoded spans, the input with the
/// spans filled in and, for dataset samples, the spans the data masked.
#[derive(Debug, Clone, Serialize)]
pub struct T5Decoding {
    pub input: String,
    /// Sentinel (or `""` before any) → decoded text.
    pub spans: Vec<(String, String)>,
    pub filled: String,
    pub decoded_ids: Vec<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    /// The decoded tokens equal the target's (dataset samples only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exact: Option<bool>,
}

impl T5Decoding {
    /// `encoder` (the real tokens), the `decoded` tokens and the data's `target` tokens (the
    /// labels before `[EOS]`), as text.
    pub fn new(
        tokenizer: &MaskedTokenizer,
        encoder: &[i64],
        decoded: &[i64],
        target: Option<&[i64]>,
    ) -> Result<T5Decoding> {
        let text = |ids: &[i64]| -> Result<String> {
            let ids = ids
                .iter()
                .map(|&id| u32::try_from(id))
                .collect::<std::result::Result<Vec<u32>, _>>()?;
            Ok(tokenizer.tokenizer.detokenize(&ids)?)
        };
        let spans = split_spans(decoded, &tokenizer.vocab.sentinels);
        let named = spans
            .iter()
            .map(|span| {
                let name = match span.sentinel {
                    Some(s) => text(&[s])?,
                    None => String::new(),
                };
                Ok((name, text(&span.tokens)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(T5Decoding {
            input: text(encoder)?,
            spans: named,
            filled: text(&fill_spans(encoder, &spans))?,
            decoded_ids: decoded.to_vec(),
            target: target.map(text).transpose()?,
            exact: target.map(|t| t == decoded),
        })
    }

    /// The decoding for people: the input, then one line per span.
    pub fn text(&self) -> String {
        let mut out = format!("input:  {}\n", self.input);
        for (sentinel, span) in &self.spans {
            out.push_str(&format!("  {sentinel:<14} {span}\n"));
        }
        out.push_str(&format!("filled: {}\n", self.filled));
        if let Some(target) = &self.target {
            out.push_str(&format!("target: {target}\n"));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_data::tokenizer::BertWordPiece;

    fn tokenizer() -> MaskedTokenizer {
        let vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nsat\non\nmat\n.\n";
        MaskedTokenizer::from_wordpiece(
            BertWordPiece::from_vocab_text(vocab, true, false)
                .unwrap()
                .with_extra_ids(3),
        )
        .unwrap()
    }

    #[test]
    fn sentinels_in_text_become_their_ids() {
        // [BOS] 11, [EOS] 12, <extra_id_0..2> 13..15.
        let t = tokenizer();
        assert_eq!(
            encode_with_sentinels(&t, "The <extra_id_0> sat on the<extra_id_1>.").unwrap(),
            [5, 13, 7, 8, 5, 14, 10]
        );
        let error = |text: &str| encode_with_sentinels(&t, text).unwrap_err().to_string();
        assert!(error("the cat").contains("no sentinel"));
        assert!(error("the <extra_id_3>").contains("3 sentinels"));
        assert!(error("the <extra_id_x>").contains("<extra_id_N>"));
    }

    #[test]
    fn decoded_spans_fill_their_sentinels() {
        let spans = split_spans(&[6, 13, 6, 14, 9, 10], &[13, 14, 15]);
        assert_eq!(
            spans,
            [
                DecodedSpan {
                    sentinel: None,
                    tokens: vec![6]
                },
                DecodedSpan {
                    sentinel: Some(13),
                    tokens: vec![6]
                },
                DecodedSpan {
                    sentinel: Some(14),
                    tokens: vec![9, 10]
                },
            ]
        );
        assert_eq!(
            fill_spans(&[5, 13, 7, 15, 5, 14], &spans),
            [5, 6, 7, 15, 5, 9, 10]
        );
        let t = tokenizer();
        let decoding = T5Decoding::new(&t, &[5, 13, 7], &[13, 6], Some(&[13, 6])).unwrap();
        assert_eq!(decoding.filled, "the cat sat");
        assert_eq!(
            decoding.spans,
            [("<extra_id_0>".to_string(), "cat".to_string())]
        );
        assert_eq!(decoding.exact, Some(true));
    }
}
