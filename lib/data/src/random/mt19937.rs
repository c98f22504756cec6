//! The Mersenne Twister in its two standard widths, one recurrence over either word:
//! - [`Mt19937`], 32-bit words with the reference `init_genrand` seeding, which is what numpy's
//!   `RandomState(int)` uses;
//! - [`Mt19937_64`], 64-bit words with the C++ standard's seeding (`std::mt19937_64(seed)`),
//!   which Megatron's C++ helpers use to shuffle the BERT/T5 sample mapping.

use std::ops::{BitAnd, BitOr, BitXor, Shl, Shr};

/// A word width's constants: the recurrence, the seeding multiplier and the tempering.
pub trait Width {
    type Word: Copy
        + Default
        + PartialEq
        + BitAnd<Output = Self::Word>
        + BitOr<Output = Self::Word>
        + BitXor<Output = Self::Word>
        + Shl<u32, Output = Self::Word>
        + Shr<u32, Output = Self::Word>;
    /// Degree of recurrence (words of state).
    const N: usize;
    /// Middle word offset.
    const M: usize;
    const MATRIX_A: Self::Word;
    const UPPER_MASK: Self::Word;
    const LOWER_MASK: Self::Word;
    const ONE: Self::Word;
    /// State word `i` from the one before it (the standards' seeding recurrence).
    fn seed_step(previous: Self::Word, i: usize) -> Self::Word;
    fn temper(y: Self::Word) -> Self::Word;
}

/// 32-bit words (MT19937).
#[derive(Clone)]
pub struct Words32;

impl Width for Words32 {
    type Word = u32;
    const N: usize = 624;
    const M: usize = 397;
    const MATRIX_A: u32 = 0x9908_b0df;
    const UPPER_MASK: u32 = 0x8000_0000;
    const LOWER_MASK: u32 = 0x7fff_ffff;
    const ONE: u32 = 1;

    fn seed_step(previous: u32, i: usize) -> u32 {
        1_812_433_253u32
            .wrapping_mul(previous ^ (previous >> 30))
            .wrapping_add(i as u32)
    }

    fn temper(mut y: u32) -> u32 {
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }
}

/// 64-bit words (MT19937-64).
#[derive(Clone)]
pub struct Words64;

impl Width for Words64 {
    type Word = u64;
    const N: usize = 312;
    const M: usize = 156;
    const MATRIX_A: u64 = 0xb502_6f5a_a966_19e9;
    const UPPER_MASK: u64 = 0xffff_ffff_8000_0000;
    const LOWER_MASK: u64 = 0x7fff_ffff;
    const ONE: u64 = 1;

    fn seed_step(previous: u64, i: usize) -> u64 {
        6_364_136_223_846_793_005u64
            .wrapping_mul(previous ^ (previous >> 62))
            .wrapping_add(i as u64)
    }

    fn temper(mut y: u64) -> u64 {
        y ^= (y >> 29) & 0x5555_5555_5555_5555;
        y ^= (y << 17) & 0x71d6_7fff_eda6_0000;
        y ^= (y << 37) & 0xfff7_eee0_0000_0000;
        y ^ (y >> 43)
    }
}

/// Mersenne Twister state of one word width.
#[derive(Clone)]
pub struct MersenneTwister<W: Width> {
    state: Box<[W::Word]>,
    position: usize,
}

/// MT19937: 32-bit outputs.
pub type Mt19937 = MersenneTwister<Words32>;
/// MT19937-64: 64-bit outputs.
pub type Mt19937_64 = MersenneTwister<Words64>;

impl<W: Width> MersenneTwister<W> {
    /// Seeds with the width's standard recurrence.
    pub fn new(seed: W::Word) -> Self {
        let mut state = vec![W::Word::default(); W::N].into_boxed_slice();
        state[0] = seed;
        for i in 1..W::N {
            state[i] = W::seed_step(state[i - 1], i);
        }
        MersenneTwister {
            state,
            position: W::N,
        }
    }

    fn regenerate(&mut self) {
        let mt = &mut self.state;
        for i in 0..W::N {
            let y = (mt[i] & W::UPPER_MASK) | (mt[(i + 1) % W::N] & W::LOWER_MASK);
            let odd = y & W::ONE == W::ONE;
            let mag = if odd { W::MATRIX_A } else { W::Word::default() };
            mt[i] = mt[(i + W::M) % W::N] ^ (y >> 1) ^ mag;
        }
        self.position = 0;
    }

    /// The next tempered word.
    fn next_word(&mut self) -> W::Word {
        if self.position >= W::N {
            self.regenerate();
        }
        let y = self.state[self.position];
        self.position += 1;
        W::temper(y)
    }
}

impl Mt19937 {
    /// Seeds from a key of words (the reference `init_by_array`), which is what Python's
    /// `random.seed(int)` does with the integer's 32-bit words, least significant first.
    pub fn from_key(key: &[u32]) -> Self {
        let mut generator = Mt19937::new(19_650_218);
        let mt = &mut generator.state;
        let n = Words32::N;
        let key = if key.is_empty() { &[0][..] } else { key };
        let (mut i, mut j) = (1, 0);
        for _ in 0..n.max(key.len()) {
            let previous = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ previous.wrapping_mul(1_664_525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= n {
                mt[0] = mt[n - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..n - 1 {
            let previous = mt[i - 1] ^ (mt[i - 1] >> 30);
            mt[i] = (mt[i] ^ previous.wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= n {
                mt[0] = mt[n - 1];
                i = 1;
            }
        }
        mt[0] = 0x8000_0000;
        generator
    }

    /// The state words and the position of the next one used, as Python's `random.getstate()`
    /// and numpy's `get_state()` report them.
    pub fn words(&self) -> (&[u32], usize) {
        (&self.state, self.position)
    }

    /// The next tempered 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        self.next_word()
    }

    /// A double in `[0, 1)` from two outputs' 53 bits (the reference `genrand_res53`, which is
    /// numpy's `random_sample` and Python's `random()`).
    pub fn next_f64(&mut self) -> f64 {
        let a = self.next_u32() >> 5;
        let b = self.next_u32() >> 6;
        (f64::from(a) * 67_108_864.0 + f64::from(b)) / 9_007_199_254_740_992.0
    }

    /// Two outputs joined, the first one as the high half (numpy's `next_uint64` for MT19937).
    pub fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }
}

impl Mt19937_64 {
    /// The next tempered 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        self.next_word()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_the_reference_implementation_for_seed_5489() {
        // mt19937ar.c's default seed; the 10000th output is the C++ standard's check value.
        let mut mt = Mt19937::new(5489);
        assert_eq!(mt.next_u32(), 3_499_211_612);
        let mut last = 0;
        for _ in 1..10_000 {
            last = mt.next_u32();
        }
        assert_eq!(last, 4_123_659_995);
    }

    #[test]
    fn mt19937_64_ten_thousandth_output_is_the_standards_check_value() {
        let mut mt = Mt19937_64::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = mt.next_u64();
        }
        assert_eq!(last, 9_981_545_732_273_789_042);
    }
}
