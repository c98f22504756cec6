//! Blending indices: which member dataset, and which of its samples, each blended sample is
//! (Megatron's `build_blending_indices` / `build_exhaustive_blending_indices`).

/// `(dataset_index, dataset_sample_index)` of a blend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlendingIndices {
    pub dataset_index: Vec<i16>,
    pub dataset_sample_index: Vec<i64>,
}

impl BlendingIndices {
    fn with_capacity(size: usize) -> Self {
        BlendingIndices {
            dataset_index: Vec::with_capacity(size),
            dataset_sample_index: Vec::with_capacity(size),
        }
    }

    fn push(&mut self, dataset: usize, counts: &mut [i64]) {
        self.dataset_index.push(dataset as i16);
        self.dataset_sample_index.push(counts[dataset]);
        counts[dataset] += 1;
    }

    /// Samples drawn from each of `num_datasets` members.
    pub fn counts(&self, num_datasets: usize) -> Vec<u64> {
        let mut counts = vec![0u64; num_datasets];
        for &d in &self.dataset_index {
            counts[d as usize] += 1;
        }
        counts
    }
}

/// Greedy error-minimising interleave of `size` samples: at step `n` pick the member whose
/// `weight·max(n,1) − drawn` is largest (first one on ties).
pub fn build_blending_indices(weights: &[f64], size: usize) -> BlendingIndices {
    let mut indices = BlendingIndices::with_capacity(size);
    let mut counts = vec![0i64; weights.len()];
    for n in 0..size {
        let x = (n as f64).max(1.0);
        let mut best = 0;
        let mut best_error = weights[0] * x - counts[0] as f64;
        for (i, w) in weights.iter().enumerate().skip(1) {
            let error = w * x - counts[i] as f64;
            if error > best_error {
                best = i;
                best_error = error;
            }
        }
        indices.push(best, &mut counts);
    }
    indices
}

/// Every sample of every member exactly once, interleaved in proportion to the sizes.
pub fn build_exhaustive_blending_indices(sizes: &[u64]) -> BlendingIndices {
    let total: u64 = sizes.iter().sum();
    let weights: Vec<f64> = sizes.iter().map(|&s| s as f64 / total as f64).collect();
    let mut indices = BlendingIndices::with_capacity(total as usize);
    let mut counts = vec![0i64; sizes.len()];
    let mut unspent: Vec<usize> = (0..sizes.len()).filter(|&i| sizes[i] > 0).collect();
    let mut n = 0u64;
    while !unspent.is_empty() {
        let x = (n as f64).max(1.0);
        let mut best = unspent[0];
        let mut best_error = f64::MIN;
        for &i in &unspent {
            let error = weights[i] * x - counts[i] as f64;
            if error > best_error {
                best = i;
                best_error = error;
            }
        }
        indices.push(best, &mut counts);
        if counts[best] as u64 == sizes[best] {
            unspent.retain(|&i| i != best);
        }
        n += 1;
    }
    indices
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_golden_values() {
        let a = build_blending_indices(&[0.5, 0.25, 0.25], 10);
        assert_eq!(a.dataset_index, [0, 1, 2, 0, 0, 1, 2, 0, 0, 1]);
        assert_eq!(a.dataset_sample_index, [0, 0, 0, 1, 2, 1, 1, 3, 4, 2]);
        let b = build_blending_indices(&[0.3, 0.7], 10);
        assert_eq!(b.dataset_index, [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]);
        assert_eq!(b.dataset_sample_index, [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]);
        let c = build_exhaustive_blending_indices(&[3, 1, 2]);
        assert_eq!(c.dataset_index, [0, 2, 1, 0, 2, 0]);
        assert_eq!(c.dataset_sample_index, [0, 0, 0, 1, 1, 2]);
    }

    #[test]
    fn greedy_rule_keeps_counts_within_one_of_the_weights() {
        // Independent property of the greedy rule: after n draws every member's count is
        // within one sample of weight·n, and the per-member sample ids count up from 0.
        let weights = [0.3, 0.7];
        let blend = build_blending_indices(&weights, 1000);
        let mut counts = [0i64; 2];
        for (n, (&d, &s)) in blend
            .dataset_index
            .iter()
            .zip(&blend.dataset_sample_index)
            .enumerate()
        {
            assert_eq!(s, counts[d as usize]);
            counts[d as usize] += 1;
            for (i, w) in weights.iter().enumerate() {
                assert!((counts[i] as f64 - w * (n + 1) as f64).abs() <= 1.0);
            }
        }
        assert_eq!(blend.counts(2), [300, 700]);
    }
}
