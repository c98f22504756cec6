//! `--split` strings ("969,30,1") → per-split bookends → index ranges.

use std::ops::Range;

use anyhow::{bail, Result};
use regex::Regex;

use crate::cache::PyJson;

/// The three dataset splits, in Megatron's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Valid,
    Test,
}

impl Split {
    pub const ALL: [Split; 3] = [Split::Train, Split::Valid, Split::Test];

    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Valid => "valid",
            Split::Test => "test",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    pub fn from_name(name: &str) -> Result<Split> {
        match name {
            "train" => Ok(Split::Train),
            "valid" | "validation" => Ok(Split::Valid),
            "test" => Ok(Split::Test),
            other => bail!("unknown split {other:?}; expected train, valid or test"),
        }
    }
}

/// A split's `[begin, end)` as fractions of the low-level dataset. `begin_is_int_zero` records
/// that Python kept the literal integer `0` there, which the cache description prints as `0`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bookend {
    pub begin: f64,
    pub end: f64,
    pub begin_is_int_zero: bool,
}

impl Bookend {
    /// The whole dataset, as per-split blends use it.
    pub fn whole() -> Bookend {
        Bookend {
            begin: 0.0,
            end: 1.0,
            begin_is_int_zero: false,
        }
    }

    /// Element range `round(begin·n)..round(end·n)` with Python's half-to-even rounding.
    pub fn range(&self, num_elements: usize) -> Range<usize> {
        let n = num_elements as f64;
        let begin = (self.begin * n).round_ties_even() as usize;
        let end = (self.end * n).round_ties_even() as usize;
        begin..end.max(begin)
    }

    fn to_json(self) -> PyJson {
        let begin = if self.begin_is_int_zero {
            PyJson::Int(0)
        } else {
            PyJson::Float(self.begin)
        };
        PyJson::List(vec![begin, PyJson::Float(self.end)])
    }
}

/// One optional bookend per split.
#[derive(Debug, Clone, PartialEq)]
pub struct SplitMatrix(pub [Option<Bookend>; 3]);

impl SplitMatrix {
    /// Parses a `--split` string: every `[.0-9]+` is a weight, missing ones are 0, weights are
    /// normalised by their float64 sum and accumulated into bookends.
    pub fn parse(split: &str) -> Result<SplitMatrix> {
        let number = Regex::new(r"[.0-9]+").expect("valid regex");
        let mut weights = Vec::new();
        for found in number.find_iter(split) {
            let weight: f64 = found.as_str().parse().map_err(|_| {
                anyhow::anyhow!("--split {split:?}: {:?} is not a number", found.as_str())
            })?;
            weights.push(weight);
        }
        if weights.len() > 3 {
            bail!(
                "--split {split:?} has {} weights; at most 3 (train, valid, test) are allowed",
                weights.len()
            );
        }
        weights.resize(3, 0.0);
        let total = crate::blend::numpy_sum(&weights);
        if total.is_nan() || total <= 0.0 {
            bail!("--split {split:?} must have a positive weight");
        }
        let normalized: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let mut bookends = [None; 3];
        let mut begin = 0.0;
        for (i, weight) in normalized.iter().enumerate() {
            let end = begin + weight;
            if end > begin {
                bookends[i] = Some(Bookend {
                    begin,
                    end,
                    begin_is_int_zero: i == 0,
                });
            }
            begin = end;
        }
        Ok(SplitMatrix(bookends))
    }

    /// Only `split` present, covering everything (per-split blends).
    pub fn only(split: Split) -> SplitMatrix {
        let mut bookends = [None; 3];
        bookends[split.index()] = Some(Bookend::whole());
        SplitMatrix(bookends)
    }

    pub fn get(&self, split: Split) -> Option<Bookend> {
        self.0[split.index()]
    }

    pub fn to_json(&self) -> PyJson {
        PyJson::List(
            self.0
                .iter()
                .map(|b| b.map_or(PyJson::Null, Bookend::to_json))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_split_ranges_follow_half_to_even_rounding() {
        let matrix = SplitMatrix::parse("969, 30, 1").unwrap();
        let n = 1_000_003;
        let ranges: Vec<_> = Split::ALL
            .iter()
            .map(|s| matrix.get(*s).unwrap().range(n))
            .collect();
        assert_eq!(ranges, [0..969_003, 969_003..999_003, 999_003..1_000_003]);
        // 0.5 rounds to even: 2.5 → 2.
        let half = SplitMatrix::parse("50,50").unwrap();
        assert_eq!(half.get(Split::Train).unwrap().range(5), 0..2);
        assert_eq!(half.get(Split::Valid).unwrap().range(5), 2..5);
        assert_eq!(half.get(Split::Test), None);
    }

    #[test]
    fn matrix_prints_like_megatron() {
        let matrix = SplitMatrix::parse("969,30,1").unwrap();
        assert_eq!(
            matrix.to_json().dumps().replace([' ', '\n'], ""),
            "[[0,0.969],[0.969,0.999],[0.999,1.0]]"
        );
        let skipping = SplitMatrix::parse("0/5/5").unwrap();
        assert_eq!(
            skipping.to_json().dumps().replace([' ', '\n'], ""),
            "[null,[0.0,0.5],[0.5,1.0]]"
        );
    }

    #[test]
    fn rejects_bad_split_strings() {
        assert!(SplitMatrix::parse("1,2,3,4").is_err());
        assert!(SplitMatrix::parse("0,0,0").is_err());
        assert!(SplitMatrix::parse("1..2").is_err());
    }
}
