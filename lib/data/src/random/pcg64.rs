//! numpy's `PCG64` bit generator: a 128-bit LCG with the XSL-RR output function, seeded from a
//! `SeedSequence`, handing out 32-bit draws as buffered halves of 64-bit outputs.

use super::SeedSequence;

const MULTIPLIER: u128 = 0x2360_ed05_1fc6_5da4_4385_df64_9fcc_f645;

/// `numpy.random.PCG64` state: the LCG state and increment, plus the unused upper half of the
/// last 64-bit output (numpy's `has_uint32`/`uinteger`).
#[derive(Clone, Debug)]
pub struct Pcg64 {
    state: u128,
    increment: u128,
    buffered_u32: Option<u32>,
}

impl Pcg64 {
    /// PCG's `srandom(initstate, initseq)`: the increment is `initseq` made odd, and the state
    /// is stepped once before and once after adding `initstate`.
    pub fn new(initial_state: u128, sequence: u128) -> Self {
        let mut generator = Pcg64 {
            state: 0,
            increment: (sequence << 1) | 1,
            buffered_u32: None,
        };
        generator.step();
        generator.state = generator.state.wrapping_add(initial_state);
        generator.step();
        generator
    }

    /// `PCG64(seed_sequence)`: four 64-bit words, the first pair the state and the second the
    /// sequence, each with its first word as the high half.
    pub fn from_seed_sequence(seed_sequence: &SeedSequence) -> Self {
        let words = seed_sequence.generate_state_u64(4);
        let join = |high: u64, low: u64| (u128::from(high) << 64) | u128::from(low);
        Pcg64::new(join(words[0], words[1]), join(words[2], words[3]))
    }

    fn step(&mut self) {
        self.state = self
            .state
            .wrapping_mul(MULTIPLIER)
            .wrapping_add(self.increment);
    }

    /// The LCG state and increment, as numpy's `PCG64.state["state"]` reports them.
    pub fn state(&self) -> (u128, u128) {
        (self.state, self.increment)
    }

    /// `random_raw()`: advance, then XOR-fold the new state and rotate by its top 6 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let folded = ((self.state >> 64) as u64) ^ (self.state as u64);
        folded.rotate_right((self.state >> 122) as u32)
    }

    /// numpy's `next_uint32`: the low half of a fresh 64-bit output, its high half kept for
    /// the next call.
    pub fn next_u32(&mut self) -> u32 {
        if let Some(high) = self.buffered_u32.take() {
            return high;
        }
        let output = self.next_u64();
        self.buffered_u32 = Some((output >> 32) as u32);
        output as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // python -c "import numpy as np; print(np.random.PCG64(0).state['state'])"
    #[test]
    fn seeding_from_seed_sequence_matches_numpy_state() {
        let generator = Pcg64::from_seed_sequence(&SeedSequence::new(0));
        assert_eq!(
            generator.state(),
            (
                35_399_562_948_360_463_058_890_781_895_381_311_971,
                87_136_372_517_582_989_555_478_159_403_783_844_777
            )
        );
    }

    // python -c "import numpy as np; print(np.random.PCG64(0).random_raw(5))"
    #[test]
    fn raw_outputs_match_numpy() {
        let mut generator = Pcg64::from_seed_sequence(&SeedSequence::new(0));
        let outputs: Vec<u64> = (0..5).map(|_| generator.next_u64()).collect();
        assert_eq!(
            outputs,
            [
                11_749_869_230_777_074_271,
                4_976_686_463_289_251_617,
                755_828_109_848_996_024,
                304_881_062_738_325_533,
                15_002_187_965_291_974_971
            ]
        );
    }

    #[test]
    fn u32_draws_are_the_low_then_high_half_of_each_output() {
        let mut halves = Pcg64::from_seed_sequence(&SeedSequence::new(0));
        let mut whole = halves.clone();
        for _ in 0..3 {
            let output = whole.next_u64();
            assert_eq!(halves.next_u32(), output as u32);
            assert_eq!(halves.next_u32(), (output >> 32) as u32);
        }
    }
}
