//! Megatron's `_create_masked_lm_predictions`, shared by BERT and T5: whole-word candidates,
//! n-gram (or geometric span) selection and the exact order of random draws.

use crate::blend::numpy_sum;
use crate::random::RandomState;

use super::vocab::MaskedLmVocab;

/// How n-grams are chosen (Megatron's `masking_*` config fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MaskingOptions {
    pub probability: f64,
    pub max_ngram: usize,
    /// A `##` piece joins the preceding word's candidate.
    pub do_full_word: bool,
    /// Favour longer n-grams (probabilities ∝ 1/n reversed).
    pub use_longer_ngrams: bool,
    /// SpanBERT: n ~ Geometric(0.2), clipped at `max_ngram`.
    pub use_geometric_distribution: bool,
}

/// One masked span: positions and their original ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedSpan {
    pub positions: Vec<usize>,
    pub labels: Vec<i64>,
}

/// The masked sequence with positions/labels sorted by position and spans by first position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedTokens {
    pub tokens: Vec<i64>,
    pub positions: Vec<usize>,
    pub labels: Vec<i64>,
    pub spans: Vec<MaskedSpan>,
}

/// Masks `tokens`; `token_mask` gives each masked position's replacement (`None` keeps the
/// original) and may draw from the random state, as BERT's 80/10/10 rule does.
pub fn mask_tokens(
    tokens: &[i64],
    target_sequence_length: usize,
    options: &MaskingOptions,
    vocab: &MaskedLmVocab,
    rng: &mut RandomState,
    token_mask: &mut dyn FnMut(&mut RandomState) -> Option<i64>,
) -> MaskedTokens {
    let mut candidates: Vec<Vec<usize>> = Vec::new();
    for (i, &id) in tokens.iter().enumerate() {
        if id == vocab.cls || id == vocab.sep {
            continue;
        }
        if vocab.is_continuation(id) && options.do_full_word && !candidates.is_empty() {
            candidates.last_mut().expect("not empty").push(i);
        } else {
            candidates.push(vec![i]);
        }
    }

    let rounded = (tokens.len() as f64 * options.probability).round_ties_even();
    let n_maskings = (options.probability * target_sequence_length as f64).min(rounded.max(1.0));

    let max_ngram = options.max_ngram;
    let mut probabilities: Vec<f64> = (1..=max_ngram).map(|n| 1.0 / n as f64).collect();
    let total = numpy_sum(&probabilities);
    probabilities.iter_mut().for_each(|p| *p /= total);
    if options.use_longer_ngrams {
        probabilities.reverse();
    }
    // Every candidate offers `max_ngram` n-grams (shorter at the end), so Megatron's
    // per-candidate renormalisation always covers the whole vector.
    let total = numpy_sum(&probabilities);
    let renormalised: Vec<f64> = probabilities.iter().map(|p| p / total).collect();
    let mut cdf: Vec<f64> = renormalised
        .iter()
        .scan(0.0, |acc, p| {
            *acc += p;
            Some(*acc)
        })
        .collect();
    let last = *cdf.last().expect("max_ngram > 0");
    cdf.iter_mut().for_each(|c| *c /= last);

    // Candidate c's n-grams are candidates[c..c+n] for n = 1..=max_ngram; shuffling the
    // candidate indices draws exactly as shuffling Megatron's nested list does.
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    rng.shuffle(&mut order);

    let mut masked = tokens.to_vec();
    let mut positions_and_labels: Vec<(usize, i64)> = Vec::new();
    let mut spans: Vec<MaskedSpan> = Vec::new();
    let mut used = vec![false; tokens.len()];
    for &c in &order {
        if positions_and_labels.len() as f64 >= n_maskings {
            break;
        }
        let mut n = if options.use_geometric_distribution {
            (rng.geometric(0.2) as usize).min(max_ngram)
        } else {
            rng.choice_from_cdf(&cdf) + 1
        };
        let ngram = loop {
            let end = (c + n).min(candidates.len());
            let indices: Vec<usize> = candidates[c..end].iter().flatten().copied().collect();
            n -= 1;
            if n_maskings >= (positions_and_labels.len() + indices.len()) as f64 {
                break Some(indices);
            }
            if n == 0 {
                break None;
            }
        };
        let Some(indices) = ngram else { continue };
        if indices.iter().any(|&i| used[i]) {
            continue;
        }
        for &i in &indices {
            used[i] = true;
            masked[i] = token_mask(rng).unwrap_or(tokens[i]);
            positions_and_labels.push((i, tokens[i]));
        }
        spans.push(MaskedSpan {
            labels: indices.iter().map(|&i| tokens[i]).collect(),
            positions: indices,
        });
    }
    // Megatron shuffles the candidates a second time whether or not it permutes.
    rng.shuffle(&mut order);

    positions_and_labels.sort_by_key(|&(position, _)| position);
    spans.sort_by_key(|span| span.positions[0]);
    MaskedTokens {
        tokens: masked,
        positions: positions_and_labels.iter().map(|&(p, _)| p).collect(),
        labels: positions_and_labels.iter().map(|&(_, l)| l).collect(),
        spans,
    }
}
