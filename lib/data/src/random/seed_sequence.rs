//! numpy's `SeedSequence`: hashes a seed into a 4-word entropy pool and draws bit-generator
//! seeds from it, so that `default_rng(seed)` starts from the same PCG64 state as numpy's.

const POOL_SIZE: usize = 4;
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;

/// `numpy.random.SeedSequence(seed)` without spawn keys, for seeds up to 128 bits (numpy's own
/// fresh entropy size). Such a seed fits the pool, so numpy's pass that folds entropy words
/// beyond the pool size into it never applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

/// The multiplier chain numpy threads through every `hashmix` call of one mixing pass.
struct HashMixer {
    hash_const: u32,
}

impl HashMixer {
    fn hashmix(&mut self, value: u32) -> u32 {
        let mut value = value ^ self.hash_const;
        self.hash_const = self.hash_const.wrapping_mul(MULT_A);
        value = value.wrapping_mul(self.hash_const);
        value ^ (value >> XSHIFT)
    }
}

fn mix(x: u32, y: u32) -> u32 {
    let result = MIX_MULT_L
        .wrapping_mul(x)
        .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
    result ^ (result >> XSHIFT)
}

/// A non-negative integer as numpy coerces it to entropy: 32-bit words, least significant
/// first, and a single zero word for zero.
fn entropy_words(seed: u128) -> Vec<u32> {
    let mut words = Vec::new();
    let mut rest = seed;
    loop {
        words.push(rest as u32);
        rest >>= 32;
        if rest == 0 {
            return words;
        }
    }
}

impl SeedSequence {
    pub fn new(seed: u128) -> Self {
        let entropy = entropy_words(seed);
        let mut mixer = HashMixer { hash_const: INIT_A };
        let mut pool = [0u32; POOL_SIZE];
        for (i, word) in pool.iter_mut().enumerate() {
            *word = mixer.hashmix(entropy.get(i).copied().unwrap_or(0));
        }
        // Every pool word feeds every other one, so late entropy words reach early pool words.
        for src in 0..POOL_SIZE {
            for dst in 0..POOL_SIZE {
                if src != dst {
                    pool[dst] = mix(pool[dst], mixer.hashmix(pool[src]));
                }
            }
        }
        SeedSequence { pool }
    }

    /// `generate_state(n_words, dtype=uint32)`.
    pub fn generate_state_u32(&self, n_words: usize) -> Vec<u32> {
        let mut hash_const = INIT_B;
        self.pool
            .iter()
            .cycle()
            .take(n_words)
            .map(|&word| {
                let mut value = word ^ hash_const;
                hash_const = hash_const.wrapping_mul(MULT_B);
                value = value.wrapping_mul(hash_const);
                value ^ (value >> XSHIFT)
            })
            .collect()
    }

    /// `generate_state(n_words, dtype=uint64)`: twice as many 32-bit words, paired low word first
    /// (numpy reinterprets the little-endian `uint32` array as `uint64`).
    pub fn generate_state_u64(&self, n_words: usize) -> Vec<u64> {
        self.generate_state_u32(2 * n_words)
            .chunks_exact(2)
            .map(|pair| u64::from(pair[0]) | (u64::from(pair[1]) << 32))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // python -c "import numpy as np; print(np.random.SeedSequence(0).generate_state(4, np.uint64))"
    #[test]
    fn seed_0_u64_state_matches_numpy() {
        assert_eq!(
            SeedSequence::new(0).generate_state_u64(4),
            [
                15_793_235_383_387_715_774,
                12_390_638_538_380_655_177,
                2_361_836_109_651_742_017,
                3_188_717_715_514_472_916
            ]
        );
    }

    // python -c "import numpy as np; print(np.random.SeedSequence(1234).generate_state(8, np.uint32))"
    #[test]
    fn seed_1234_u32_state_cycles_the_pool_like_numpy() {
        assert_eq!(
            SeedSequence::new(1234).generate_state_u32(8),
            [
                2_906_597_030,
                1_602_421_836,
                216_676_975,
                2_698_621_808,
                507_409_703,
                2_825_158_027,
                3_613_074,
                1_752_862_323
            ]
        );
    }

    // python -c "import numpy as np; print(np.random.SeedSequence(2**40+5).generate_state(4, np.uint32))"
    #[test]
    fn two_word_seed_matches_numpy() {
        assert_eq!(
            SeedSequence::new((1 << 40) + 5).generate_state_u32(4),
            [3_767_146_251, 3_672_381_269, 2_127_416_108, 2_216_012_776]
        );
    }

    // python -c "import numpy as np; print(np.random.SeedSequence(2**127+2**70+9).generate_state(4, np.uint32))"
    #[test]
    fn four_word_seed_matches_numpy() {
        assert_eq!(
            SeedSequence::new((1 << 127) + (1 << 70) + 9).generate_state_u32(4),
            [208_825_556, 3_717_029_998, 1_626_419_622, 4_045_110_026]
        );
    }

    #[test]
    fn entropy_words_are_little_endian_with_a_zero_word_for_zero() {
        assert_eq!(entropy_words(0), [0]);
        assert_eq!(entropy_words((7 << 64) | 3), [3, 0, 7]);
    }
}
