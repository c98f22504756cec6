//! The subset of numpy's legacy `RandomState` API that Megatron's data pipeline calls.

use super::Mt19937;

/// `numpy.random.RandomState(seed)`.
#[derive(Clone)]
pub struct RandomState {
    generator: Mt19937,
}

impl RandomState {
    pub fn new(seed: u32) -> Self {
        RandomState {
            generator: Mt19937::new(seed),
        }
    }

    /// A uniform integer in `0..=max` by masked rejection (numpy's `random_interval`).
    pub fn random_interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        if max <= u64::from(u32::MAX) {
            loop {
                let value = u64::from(self.generator.next_u32()) & mask;
                if value <= max {
                    return value;
                }
            }
        }
        loop {
            let value = self.generator.next_u64() & mask;
            if value <= max {
                return value;
            }
        }
    }

    /// `randint(low, high)`: a uniform integer in `low..high`.
    pub fn randint(&mut self, low: i64, high: i64) -> i64 {
        assert!(low < high, "randint needs low < high, got {low}..{high}");
        let span = (high - 1).wrapping_sub(low) as u64;
        low.wrapping_add(self.random_interval(span) as i64)
    }

    /// `random()`: a double in `[0, 1)` with 53 random bits.
    pub fn random(&mut self) -> f64 {
        self.generator.next_f64()
    }

    /// In-place Fisher–Yates shuffle, drawing exactly as numpy's legacy `shuffle` does.
    pub fn shuffle<T>(&mut self, values: &mut [T]) {
        for i in (1..values.len()).rev() {
            let j = self.random_interval(i as u64) as usize;
            values.swap(i, j);
        }
    }

    /// `choice(len(cdf), p=p)` for a cumulative `cdf` of `p` already normalised by its last
    /// element: the first index whose cdf exceeds one `random()` draw.
    pub fn choice_from_cdf(&mut self, cdf: &[f64]) -> usize {
        let u = self.random();
        cdf.partition_point(|&c| c <= u).min(cdf.len() - 1)
    }

    /// `geometric(p)` for `p < 1/3` (legacy inversion: `ceil(log1p(-U) / log(1 - p))`).
    pub fn geometric(&mut self, p: f64) -> i64 {
        assert!(
            p > 0.0 && p < 1.0 / 3.0,
            "geometric needs 0 < p < 1/3, got {p}"
        );
        ((-self.random()).ln_1p() / (1.0 - p).ln()).ceil() as i64
    }

    /// `permutation(n)`: `0..n` shuffled.
    pub fn permutation(&mut self, n: usize) -> Vec<i64> {
        let mut values: Vec<i64> = (0..n as i64).collect();
        self.shuffle(&mut values);
        values
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference values are widely published numpy outputs (`np.random.seed(0)` examples).
    #[test]
    fn randint_matches_numpy_seed_0() {
        let mut rs = RandomState::new(0);
        let draws: Vec<i64> = (0..10).map(|_| rs.randint(0, 10)).collect();
        assert_eq!(draws, [5, 0, 3, 3, 7, 9, 3, 5, 2, 4]);
    }

    #[test]
    fn random_matches_numpy_seed_0() {
        let mut rs = RandomState::new(0);
        assert_eq!(rs.random(), 0.548_813_503_927_324_8);
        assert_eq!(rs.random(), 0.715_189_366_372_419_5);
    }

    #[test]
    fn geometric_and_choice_match_numpy_seed_1234() {
        // numpy 2.x: [RandomState(1234).geometric(0.2) for _ in range(8)] and
        // RandomState(1234).choice([1, 2, 3], p=[6/11, 3/11, 2/11]) eight times.
        let mut rs = RandomState::new(1234);
        let draws: Vec<i64> = (0..8).map(|_| rs.geometric(0.2)).collect();
        assert_eq!(draws, [1, 5, 3, 7, 7, 2, 2, 8]);
        let p = [6.0 / 11.0, 3.0 / 11.0, 2.0 / 11.0];
        let cdf = [p[0], p[0] + p[1], p[0] + p[1] + p[2]];
        let mut rs = RandomState::new(1234);
        let picks: Vec<usize> = (0..8).map(|_| rs.choice_from_cdf(&cdf) + 1).collect();
        assert_eq!(picks, [1, 2, 1, 2, 2, 1, 1, 2]);
    }

    #[test]
    fn permutation_matches_numpy_seed_42() {
        assert_eq!(
            RandomState::new(42).permutation(10),
            [8, 1, 5, 0, 7, 2, 9, 4, 3, 6]
        );
    }

    #[test]
    fn shuffle_is_a_permutation_and_uses_64_bit_draws_for_huge_bounds() {
        let mut values: Vec<u32> = (0..1000).collect();
        RandomState::new(1234).shuffle(&mut values);
        let mut sorted = values.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(values, sorted);

        let mut rs = RandomState::new(7);
        let mut reference = Mt19937::new(7);
        let bound = (1u64 << 40) + 3;
        let value = rs.random_interval(bound);
        let expected = loop {
            let v = reference.next_u64() & ((1u64 << 41) - 1);
            if v <= bound {
                break v;
            }
        };
        assert_eq!(value, expected);
    }
}
