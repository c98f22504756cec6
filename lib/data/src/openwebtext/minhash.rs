//! MinHash fingerprints and exact Jaccard similarity over character 5-gram shingles.
//!
//! A shingle is five consecutive Unicode characters packed losslessly into a `u128`
//! (21 bits each), so exact Jaccard needs no hashing. For MinHash each shingle is mixed
//! once to 64 bits and then permuted by `num_seeds` multiply-shift hash functions
//! (`(a·x + b) >> 32`), far cheaper than the original's one MurmurHash3 call per shingle
//! and seed. Unlike the original's exact-similarity helper (which skips the last 5-gram),
//! every shingle counts, so MinHash and exact Jaccard measure the same sets.

/// Characters per shingle (`char_ngram=5` in the original).
pub const SHINGLE_CHARS: usize = 5;

/// The sorted, de-duplicated shingle set of a text (empty below five characters).
pub fn shingle_set(text: &str) -> Vec<u128> {
    let mut set: Vec<u128> = shingles(text).collect();
    set.sort_unstable();
    set.dedup();
    set
}

fn shingles(text: &str) -> impl Iterator<Item = u128> + '_ {
    let mut window: u128 = 0;
    let mut seen = 0usize;
    let mask: u128 = (1u128 << (21 * SHINGLE_CHARS)) - 1;
    text.chars().filter_map(move |c| {
        window = ((window << 21) | c as u128) & mask;
        seen += 1;
        (seen >= SHINGLE_CHARS).then_some(window)
    })
}

/// How two shingle sets' overlap is normalised (`--jaccard union|min|max`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JaccardKind {
    #[default]
    Union,
    Min,
    Max,
}

/// Exact similarity of two sorted shingle sets; 0 when either is empty.
pub fn jaccard(a: &[u128], b: &[u128], kind: JaccardKind) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let (mut i, mut j, mut common) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                common += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let denominator = match kind {
        JaccardKind::Union => a.len() + b.len() - common,
        JaccardKind::Min => a.len().min(b.len()),
        JaccardKind::Max => a.len().max(b.len()),
    };
    common as f64 / denominator as f64
}

/// `splitmix64`: seeds the hash family from one integer.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn mix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn shingle_hash(shingle: u128) -> u64 {
    mix64(shingle as u64 ^ mix64((shingle >> 64) as u64 ^ 0x5851_F42D_4C95_7F2D))
}

/// A family of `num_seeds` hash functions drawn from one seed.
#[derive(Debug, Clone)]
pub struct MinHasher {
    multipliers: Vec<u64>,
    offsets: Vec<u64>,
}

impl MinHasher {
    pub fn new(seed: u64, num_seeds: usize) -> Self {
        let mut state = seed;
        let multipliers = (0..num_seeds).map(|_| splitmix64(&mut state) | 1).collect();
        let offsets = (0..num_seeds).map(|_| splitmix64(&mut state)).collect();
        Self {
            multipliers,
            offsets,
        }
    }

    pub fn num_seeds(&self) -> usize {
        self.multipliers.len()
    }

    /// The minimum of each hash function over the text's shingles (`u32::MAX` each when
    /// the text has no shingle).
    pub fn fingerprint(&self, text: &str) -> Vec<u32> {
        let mut mins = vec![u32::MAX; self.num_seeds()];
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            unsafe { self.fold_avx2(text, &mut mins) };
            return mins;
        }
        self.fold(text, &mut mins);
        mins
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn fold_avx2(&self, text: &str, mins: &mut [u32]) {
        self.fold(text, mins)
    }

    #[inline(always)]
    fn fold(&self, text: &str, mins: &mut [u32]) {
        for shingle in shingles(text) {
            let x = shingle_hash(shingle);
            for ((m, &a), &b) in mins.iter_mut().zip(&self.multipliers).zip(&self.offsets) {
                let h = (a.wrapping_mul(x).wrapping_add(b) >> 32) as u32;
                *m = (*m).min(h);
            }
        }
    }
}

/// MinHash estimate of Jaccard similarity: the fraction of positions where two
/// fingerprints agree.
pub fn estimated_jaccard(a: &[u32], b: &[u32]) -> f64 {
    let same = a.iter().zip(b).filter(|(x, y)| x == y).count();
    same as f64 / a.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shingles_are_character_5grams() {
        assert!(shingle_set("abcd").is_empty());
        assert_eq!(shingle_set("abcde").len(), 1);
        assert_eq!(shingle_set("ababababab").len(), 2);
        assert_eq!(shingle_set("héllo wörld").len(), 7);
    }

    #[test]
    fn jaccard_kinds() {
        let a = shingle_set("abcdefg");
        let b = shingle_set("abcdefgh");
        assert_eq!(jaccard(&a, &b, JaccardKind::Union), 3.0 / 4.0);
        assert_eq!(jaccard(&a, &b, JaccardKind::Min), 1.0);
        assert_eq!(jaccard(&a, &b, JaccardKind::Max), 3.0 / 4.0);
        assert_eq!(jaccard(&a, &[], JaccardKind::Union), 0.0);
    }

    #[test]
    fn identical_texts_share_fingerprints_and_seed_matters() {
        let h = MinHasher::new(1234, 100);
        let text = "It was the best of times, it was the worst of times.";
        assert_eq!(h.fingerprint(text), h.fingerprint(text));
        assert_eq!(
            estimated_jaccard(&h.fingerprint(text), &h.fingerprint(text)),
            1.0
        );
        let other = MinHasher::new(1235, 100);
        assert_ne!(h.fingerprint(text), other.fingerprint(text));
    }

    /// Real text pairs over a range of similarities: WikiText paragraphs and copies
    /// with every k-th word replaced.
    fn sampled_pairs() -> Vec<(String, String)> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/wikitext2_valid.jsonl");
        let data = std::fs::read_to_string(&path).expect("shared WikiText corpus");
        let mut pairs = Vec::new();
        for (i, line) in data.lines().take(20).enumerate() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let text: String = v["text"].as_str().unwrap().chars().take(3000).collect();
            let every = 2 + i % 10;
            let copy: Vec<&str> = text
                .split(' ')
                .enumerate()
                .map(|(j, w)| if j % every == 0 { "edit" } else { w })
                .collect();
            pairs.push((text.clone(), copy.join(" ")));
        }
        pairs
    }

    #[test]
    fn estimates_track_exact_jaccard() {
        let pairs = sampled_pairs();
        let errors = |num_seeds: usize| -> Vec<f64> {
            let h = MinHasher::new(1234, num_seeds);
            pairs
                .iter()
                .map(|(a, b)| {
                    let exact = jaccard(&shingle_set(a), &shingle_set(b), JaccardKind::Union);
                    (estimated_jaccard(&h.fingerprint(a), &h.fingerprint(b)) - exact).abs()
                })
                .collect()
        };
        let default = errors(100);
        let mean = default.iter().sum::<f64>() / default.len() as f64;
        assert!(mean < 0.05, "mean |error| with 100 seeds: {mean}");
        let fine = errors(1000);
        let worst = fine.iter().cloned().fold(0.0, f64::max);
        assert!(worst < 0.05, "worst |error| with 1000 seeds: {worst}");
    }
}
