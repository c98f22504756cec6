//! `info` and `dump`: what is in one indexed dataset.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use megatron_data::indexed::IndexedDataset;

use crate::decode::Vocabulary;

#[derive(Args)]
pub struct InfoArgs {
    /// Dataset path prefix (PREFIX.bin and PREFIX.idx must exist).
    prefix: PathBuf,
}

#[derive(Args)]
pub struct DumpArgs {
    /// Dataset path prefix (PREFIX.bin and PREFIX.idx must exist).
    prefix: PathBuf,
    /// Index of the sequence to print (0-based).
    #[arg(long)]
    sequence: usize,
    /// Vocabulary to decode the ids with: GPT-2 `vocab.json` or a WordPiece `vocab.txt`.
    #[arg(long)]
    vocab_file: Option<PathBuf>,
}

fn open(prefix: &PathBuf) -> Result<IndexedDataset> {
    IndexedDataset::open(prefix).with_context(|| format!("opening dataset {}", prefix.display()))
}

pub fn run_info(args: &InfoArgs) -> Result<()> {
    let dataset = open(&args.prefix)?;
    let lengths = dataset.sequence_lengths();
    let total: u64 = lengths.iter().map(|&l| l as u64).sum();
    let empty = lengths.iter().filter(|&&l| l == 0).count();
    println!("prefix: {}", args.prefix.display());
    println!("dtype: {}", dataset.dtype().name());
    println!("sequences: {}", dataset.len());
    println!("documents: {}", dataset.document_count());
    println!("tokens: {total}");
    println!("empty sequences: {empty}");
    if let Some(range) = dataset.token_range() {
        println!("token ids: smallest {}, largest {}", range.min, range.max);
    }
    if let (Some(min), Some(max)) = (lengths.iter().min(), lengths.iter().max()) {
        println!(
            "sequence length: min {min}, mean {:.1}, max {max}",
            total as f64 / lengths.len() as f64
        );
    }
    println!("length histogram (tokens: sequences):");
    for (bucket, count) in length_histogram(lengths) {
        println!("  {bucket:>17}: {count}");
    }
    Ok(())
}

/// Power-of-two buckets `0`, `1`, `2-3`, `4-7`, … with their sequence counts (empty buckets
/// between the smallest and largest are shown so the shape is visible).
fn length_histogram(lengths: &[i32]) -> Vec<(String, usize)> {
    let bucket_of = |l: i32| {
        if l <= 0 {
            0
        } else {
            32 - (l as u32).leading_zeros() as usize
        }
    };
    let mut counts = [0usize; 33];
    for &l in lengths {
        counts[bucket_of(l)] += 1;
    }
    let Some(first) = counts.iter().position(|&c| c > 0) else {
        return Vec::new();
    };
    let last = counts.iter().rposition(|&c| c > 0).expect("non-empty");
    (first..=last)
        .map(|b| {
            let label = match b {
                0 => "0".to_string(),
                1 => "1".to_string(),
                b => format!("{}-{}", 1u64 << (b - 1), (1u64 << b) - 1),
            };
            (label, counts[b])
        })
        .collect()
}

pub fn run_dump(args: &DumpArgs) -> Result<()> {
    let dataset = open(&args.prefix)?;
    if args.sequence >= dataset.len() {
        bail!(
            "--sequence {} is out of range: {} has {} sequences",
            args.sequence,
            args.prefix.display(),
            dataset.len()
        );
    }
    let ids = dataset.sequence(args.sequence);
    println!("{}", serde_json::to_string(&ids)?);
    if let Some(path) = &args.vocab_file {
        println!("{}", Vocabulary::load(path)?.decode(&ids));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_by_powers_of_two() {
        let histogram = length_histogram(&[0, 1, 3, 4, 7, 8, 20]);
        let expected: Vec<(String, usize)> = [
            ("0", 1),
            ("1", 1),
            ("2-3", 1),
            ("4-7", 2),
            ("8-15", 1),
            ("16-31", 1),
        ]
        .iter()
        .map(|(l, c)| (l.to_string(), *c))
        .collect();
        assert_eq!(histogram, expected);
    }
}
