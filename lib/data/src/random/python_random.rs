//! The subset of Python's `random` module that Megatron's inference examples draw from
//! (`random.seed`, `expovariate`, `randint`), reproduced draw for draw.

use super::Mt19937;

/// `random.Random(seed)` for an integer seed.
#[derive(Clone)]
pub struct PythonRandom {
    generator: Mt19937,
}

impl PythonRandom {
    /// `random.seed(seed)`: the integer's absolute value, as 32-bit words.
    pub fn new(seed: i64) -> Self {
        let mut magnitude = seed.unsigned_abs();
        let mut key = Vec::new();
        while magnitude > 0 {
            key.push(magnitude as u32);
            magnitude >>= 32;
        }
        PythonRandom {
            generator: Mt19937::from_key(&key),
        }
    }

    /// `random()`: a double in `[0, 1)` with 53 random bits.
    pub fn random(&mut self) -> f64 {
        self.generator.next_f64()
    }

    /// `expovariate(rate)`: an exponential draw of mean `1 / rate`.
    pub fn expovariate(&mut self, rate: f64) -> f64 {
        -(1.0 - self.random()).ln() / rate
    }

    /// `getrandbits(bits)` for `bits` in 1..=32.
    fn random_bits(&mut self, bits: u32) -> u32 {
        self.generator.next_u32() >> (32 - bits)
    }

    /// `randint(low, high)`: a uniform integer in `low..=high`, by rejection over the fewest
    /// bits that cover the range (`_randbelow`).
    pub fn randint(&mut self, low: i64, high: i64) -> i64 {
        assert!(low <= high, "randint needs low <= high, got {low}..={high}");
        let count = (high - low) as u64 + 1;
        let bits = 64 - count.leading_zeros();
        assert!(
            bits <= 32,
            "randint over more than 2^32 values is not needed here"
        );
        loop {
            let value = u64::from(self.random_bits(bits));
            if value < count {
                return low + value as i64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Values printed by CPython 3.11: `r = random.Random(seed)`, then `r.getrandbits(32)`,
    // `r.expovariate(8.0)` and `r.randint(...)`.
    #[test]
    fn draws_equal_cpythons() {
        let mut r = PythonRandom::new(1234);
        let words: Vec<u32> = (0..3).map(|_| r.random_bits(32)).collect();
        assert_eq!(words, [4150886329, 3342196574, 1892932127]);
        let mut r = PythonRandom::new(1234);
        assert_eq!(r.expovariate(8.0), 0.4243529758593324);
        assert_eq!(r.randint(4, 16), 11);
        assert_eq!(r.randint(0, 1000), 119);
        assert_eq!(PythonRandom::new((1 << 40) + 5).random_bits(32), 2166296868);
        assert_eq!(PythonRandom::new(0).random_bits(32), 3626764237);
    }
}
