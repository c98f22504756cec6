//! The 64-bit Mersenne Twister with the C++ standard's seeding (`std::mt19937_64(seed)`), which
//! Megatron's C++ helpers use to shuffle the BERT/T5 sample mapping.

const N: usize = 312;
const M: usize = 156;
const MATRIX_A: u64 = 0xb502_6f5a_a966_19e9;
const UPPER_MASK: u64 = 0xffff_ffff_8000_0000;
const LOWER_MASK: u64 = 0x7fff_ffff;

/// MT19937-64 state.
#[derive(Clone)]
pub struct Mt19937_64 {
    state: Box<[u64; N]>,
    position: usize,
}

impl Mt19937_64 {
    pub fn new(seed: u64) -> Self {
        let mut state = Box::new([0u64; N]);
        state[0] = seed;
        for i in 1..N {
            let prev = state[i - 1];
            state[i] = 6_364_136_223_846_793_005u64
                .wrapping_mul(prev ^ (prev >> 62))
                .wrapping_add(i as u64);
        }
        Mt19937_64 { state, position: N }
    }

    fn regenerate(&mut self) {
        let mt = &mut self.state;
        for i in 0..N {
            let y = (mt[i] & UPPER_MASK) | (mt[(i + 1) % N] & LOWER_MASK);
            let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
            mt[i] = mt[(i + M) % N] ^ (y >> 1) ^ mag;
        }
        self.position = 0;
    }

    /// The next tempered 64-bit output.
    pub fn next_u64(&mut self) -> u64 {
        if self.position >= N {
            self.regenerate();
        }
        let mut y = self.state[self.position];
        self.position += 1;
        y ^= (y >> 29) & 0x5555_5555_5555_5555;
        y ^= (y << 17) & 0x71d6_7fff_eda6_0000;
        y ^= (y << 37) & 0xfff7_eee0_0000_0000;
        y ^ (y >> 43)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_thousandth_output_is_the_standards_check_value() {
        let mut mt = Mt19937_64::new(5489);
        let mut last = 0;
        for _ in 0..10_000 {
            last = mt.next_u64();
        }
        assert_eq!(last, 9_981_545_732_273_789_042);
    }
}
