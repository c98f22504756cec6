//! Weight arithmetic exactly as numpy does it, since blend weights enter cache hashes.

/// `numpy.sum` of a float64 vector: pairwise summation with 8-way unrolled leaves.
pub fn numpy_sum(values: &[f64]) -> f64 {
    const BLOCK: usize = 128;
    let n = values.len();
    if n < 8 {
        return values.iter().fold(0.0, |acc, v| acc + v);
    }
    if n <= BLOCK {
        let mut r = [0.0f64; 8];
        r.copy_from_slice(&values[..8]);
        let mut i = 8;
        while i + 8 <= n {
            for (k, acc) in r.iter_mut().enumerate() {
                *acc += values[i + k];
            }
            i += 8;
        }
        let mut sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for v in &values[i..] {
            sum += v;
        }
        return sum;
    }
    let half = (n / 2) / 8 * 8;
    numpy_sum(&values[..half]) + numpy_sum(&values[half..])
}

/// Megatron's `normalize`: each weight divided by the numpy sum.
pub fn normalize(weights: &[f64]) -> Vec<f64> {
    let total = numpy_sum(weights);
    weights.iter().map(|w| w / total).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairwise_sum_differs_from_sequential_like_numpy() {
        // numpy.sum([0.1]*10) == 1.0 while a left fold gives 0.9999999999999999.
        let tenths = [0.1; 10];
        assert_eq!(numpy_sum(&tenths), 1.0);
        assert_eq!(tenths.iter().sum::<f64>(), 0.999_999_999_999_999_9);
        assert_eq!(normalize(&[3.0, 7.0]), [0.3, 0.7]);
    }
}
