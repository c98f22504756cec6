//! numpy's `Generator` over PCG64 (`numpy.random.default_rng`), for the draws Megatron makes
//! with it.

use super::{Pcg64, SeedSequence};

/// `numpy.random.default_rng(seed)`.
#[derive(Clone, Debug)]
pub struct Generator {
    bit_generator: Pcg64,
}

impl Generator {
    pub fn default_rng(seed: u128) -> Self {
        Generator {
            bit_generator: Pcg64::from_seed_sequence(&SeedSequence::new(seed)),
        }
    }

    /// `integers(low, high, size, dtype=numpy.int32)`: `size` uniform integers in `low..high`.
    ///
    /// # Panics
    /// When `low..high` is empty or does not fit `int32`, where numpy raises `ValueError`.
    pub fn integers_i32(&mut self, low: i64, high: i64, size: usize) -> Vec<i32> {
        assert!(low < high, "integers needs low < high, got {low}..{high}");
        assert!(
            low >= i64::from(i32::MIN) && high - 1 <= i64::from(i32::MAX),
            "integers({low}, {high}) is out of bounds for int32"
        );
        // numpy works on the offset and the inclusive span as uint32 and adds them wrapping.
        let offset = low as u32;
        let span = (high - 1 - low) as u32;
        (0..size)
            .map(|_| offset.wrapping_add(self.bounded_u32(span)) as i32)
            .collect()
    }

    /// A uniform integer in `0..=span`, drawn as numpy's `random_bounded_uint32_fill` does.
    fn bounded_u32(&mut self, span: u32) -> u32 {
        match span {
            0 => 0,
            // Lemire's method needs `span + 1` to fit 32 bits.
            u32::MAX => self.bit_generator.next_u32(),
            _ => self.lemire_u32(span),
        }
    }

    /// Lemire's multiply-and-reject (numpy's `buffered_bounded_lemire_uint32`): the high word of
    /// `draw * (span + 1)`, redrawn while the low word falls below `2^32 mod (span + 1)`.
    fn lemire_u32(&mut self, span: u32) -> u32 {
        let range = span + 1;
        let mut product = u64::from(self.bit_generator.next_u32()) * u64::from(range);
        if (product as u32) < range {
            let threshold = range.wrapping_neg() % range;
            while (product as u32) < threshold {
                product = u64::from(self.bit_generator.next_u32()) * u64::from(range);
            }
        }
        (product >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // python -c "import numpy as np; l = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32); print(l[:10], l[-5:], l.sum())"
    #[test]
    fn megatron_mock_lengths_match_numpy() {
        let lengths = Generator::default_rng(0).integers_i32(1, 4096, 100_000);
        assert_eq!(
            lengths[..10],
            [3484, 2609, 2094, 1105, 1261, 168, 309, 68, 718, 3331]
        );
        assert_eq!(lengths[99_995..], [2815, 2592, 61, 100, 769]);
        assert_eq!(
            lengths.iter().map(|&l| i64::from(l)).sum::<i64>(),
            204_637_097
        );
    }

    // python -c "import numpy as np; print(np.random.default_rng(1234).integers(0, 10**6, 20, np.int32))"
    #[test]
    fn seed_1234_million_range_matches_numpy() {
        assert_eq!(
            Generator::default_rng(1234).integers_i32(0, 1_000_000, 20),
            [
                979_350, 976_699, 987_940, 380_195, 171_359, 923_246, 104_892, 261_692, 138_780,
                319_097, 536_048, 118_091, 795_857, 241_766, 786_055, 318_533, 793_492, 964_079,
                958_329, 263_649
            ]
        );
    }

    // python -c "import numpy as np; print(np.random.default_rng(42).integers(0, 1024, 20, np.int32))"
    #[test]
    fn power_of_two_range_uses_lemire_like_numpy() {
        assert_eq!(
            Generator::default_rng(42).integers_i32(0, 1024, 20),
            [
                91, 792, 670, 449, 443, 879, 88, 714, 206, 96, 539, 999, 753, 779, 734, 804, 525,
                131, 859, 461
            ]
        );
    }

    // python -c "import numpy as np; print(np.random.default_rng(7).integers(5, 6, 5, np.int32))"
    #[test]
    fn range_of_one_returns_low() {
        assert_eq!(Generator::default_rng(7).integers_i32(5, 6, 5), [5; 5]);
    }

    // python -c "import numpy as np; print(np.random.default_rng(3).integers(-50, 50, 12, np.int32))"
    #[test]
    fn negative_low_matches_numpy() {
        assert_eq!(
            Generator::default_rng(3).integers_i32(-50, 50, 12),
            [31, -42, -33, -27, -32, 30, 36, 8, -47, -41, -17, -7]
        );
    }

    // python -c "import numpy as np; print(np.random.default_rng(99).integers(-2**31, 2**31, 6, np.int32))"
    #[test]
    fn full_int32_range_takes_raw_draws_like_numpy() {
        assert_eq!(
            Generator::default_rng(99).integers_i32(-(1 << 31), 1 << 31, 6),
            [
                1_967_841_945,
                25_901_549,
                1_106_604_327,
                279_566_429,
                -1_383_764_470,
                51_178_657
            ]
        );
    }

    // A span of 3.5 * 2^30 rejects about one draw in eight, so twelve draws exercise the retry.
    // python -c "import numpy as np; print(np.random.default_rng(5).integers(-2**31, 2**30 + 2**29, 12, np.int32))"
    #[test]
    fn rejection_heavy_range_matches_numpy() {
        assert_eq!(
            Generator::default_rng(5).integers_i32(-(1 << 31), (1 << 30) + (1 << 29), 12),
            [
                877_794_928,
                -2_062_350_666,
                888_835_712,
                -210_840_521,
                220_996_583,
                -1_073_414_516,
                1_533_660_879,
                -1_944_806_872,
                -1_103_019_459,
                -706_746_444,
                -917_685,
                -612_401_973
            ]
        );
    }

    // The unused upper half of an output carries over to the next call, as in numpy.
    // python -c "import numpy as np; r = np.random.default_rng(11); print(r.integers(0, 100, 3, np.int32), r.integers(0, 100, 3, np.int32))"
    #[test]
    fn buffered_half_carries_across_calls() {
        let mut generator = Generator::default_rng(11);
        assert_eq!(generator.integers_i32(0, 100, 3), [13, 12, 79]);
        assert_eq!(generator.integers_i32(0, 100, 3), [49, 59, 60]);
    }

    #[test]
    #[should_panic(expected = "out of bounds for int32")]
    fn bounds_beyond_int32_panic() {
        Generator::default_rng(0).integers_i32(0, (1 << 31) + 1, 1);
    }
}
