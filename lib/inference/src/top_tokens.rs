//! The most likely tokens at a position with their log-probabilities (OpenAI's `top_logprobs`),
//! for the rows that ask: prefill chunks, decode steps (eager or replayed from CUDA graphs) and
//! prompt scoring take them here from the log-softmax their chosen tokens' log-probabilities
//! come from, so a greedy token's value equals its first alternative's exactly, and a
//! streamed answer's alternatives are the whole answer's.

use anyhow::Result;
use tch::Tensor;

/// The most likely tokens at one position, likeliest first: `(token id, log-probability)`.
pub type TopTokens = Vec<(i64, f32)>;

/// The `n` most likely tokens of each row of `log_probs` (`[rows, vocabulary]`), on its
/// device: their log-probabilities and ids, `[rows, n]` each (fewer columns for a smaller
/// vocabulary).
pub(crate) fn most_likely(log_probs: &Tensor, n: usize) -> (Tensor, Tensor) {
    let n = (n as i64).min(log_probs.size()[1]);
    log_probs.topk(n, 1, true, true)
}

/// [`most_likely`]'s log-probabilities and ids (on the host) as lists, row `r` cut to its
/// first `wanted[r]`.
pub(crate) fn listed(values: &Tensor, ids: &Tensor, wanted: &[usize]) -> Result<Vec<TopTokens>> {
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let values = Vec::<Vec<f32>>::try_from(values)?;
    let ids = Vec::<Vec<i64>>::try_from(ids)?;
    Ok(ids
        .into_iter()
        .zip(values)
        .zip(wanted)
        .map(|((ids, values), &n)| ids.into_iter().zip(values).take(n).collect())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn each_row_keeps_its_own_count_of_the_likeliest_tokens() {
        let logits = Tensor::from_slice(&[0.0f32, 3.0, 1.0, 2.0, 5.0, 4.0, -1.0, 0.5])
            .view([2, 4])
            .log_softmax(1, Kind::Float);
        let (values, ids) = most_likely(&logits, 3);
        let lists = listed(&values, &ids, &[1, 3]).unwrap();
        let expected = Vec::<Vec<f32>>::try_from(&logits).unwrap();
        assert_eq!(lists[0], vec![(1, expected[0][1])]);
        assert_eq!(
            lists[1],
            vec![
                (0, expected[1][0]),
                (1, expected[1][1]),
                (3, expected[1][3])
            ]
        );
        // More than the vocabulary: all of it.
        let (values, ids) = most_likely(&logits.to_device(Device::Cpu), 20);
        assert_eq!(listed(&values, &ids, &[20, 20]).unwrap()[0].len(), 4);
    }
}
