//! `find_duplicates.py`: MinHash fingerprints, an LSH index of `num_bands` bands, and an
//! exact-Jaccard check inside every bucket that holds more than one document.
//!
//! The index keeps, per document, its id, its fingerprint and where its line lies in the
//! input; texts are re-read from a memory map only for documents that share a bucket, so
//! memory is `documents × (4·num_seeds + id + 16)` bytes plus one batch of lines.
//! Everything is deterministic for a given input and `--seed`: buckets are visited by band
//! and then by their first document, and the original's random "main" document of a bucket
//! comes from a generator seeded by (seed, band, first document).

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::json::{write_string, JsonObject};
use super::jsonl::{
    for_each_parallel, parse_line, Input, InvalidLineTracker, InvalidLines, Line, LineError,
};
use super::minhash::{jaccard, shingle_set, splitmix64, JaccardKind, MinHasher};

/// Documents more similar than this to a bucket's main document are reported.
pub const PAIR_THRESHOLD: f64 = 0.5;

/// Settings of `find-duplicates` (defaults are the original's).
#[derive(Debug, Clone)]
pub struct FindDuplicatesConfig {
    pub seed: u64,
    pub num_seeds: usize,
    pub num_bands: usize,
    pub jaccard: JaccardKind,
    /// Main documents drawn per bucket; `None` repeats until the bucket is exhausted.
    pub heuristic_iter: Option<usize>,
    pub invalid: InvalidLines,
}

impl Default for FindDuplicatesConfig {
    fn default() -> Self {
        Self {
            seed: 1234,
            num_seeds: 100,
            num_bands: 10,
            jaccard: JaccardKind::Union,
            heuristic_iter: Some(1),
            invalid: InvalidLines::Fail,
        }
    }
}

/// Marks fingerprint files (`--save-fingerprints`).
const FINGERPRINTS_FORMAT: &str = "megatron-rs-minhash-1";

#[derive(Serialize, Deserialize)]
struct SavedHeader {
    format: String,
    seed: u64,
    num_seeds: usize,
    /// Absolute path and size of every input file, in index order.
    files: Vec<(String, u64)>,
    ids: Vec<String>,
    /// (file, byte offset, length) of each document's line.
    spans: Vec<(u32, u64, u32)>,
    without_shingles: u64,
}

fn absolute(name: &str) -> String {
    std::fs::canonicalize(name)
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| name.to_string())
}

/// Where a document's line sits in one of the mapped inputs.
#[derive(Debug, Clone, Copy)]
struct LineSpan {
    file: u32,
    start: u64,
    len: u32,
}

/// The in-memory index: ids, line locations and fingerprints of every document.
pub struct FingerprintIndex {
    seed: u64,
    hasher: MinHasher,
    files: Vec<(Mmap, String)>,
    ids: Vec<String>,
    spans: Vec<LineSpan>,
    /// Row-major, `num_seeds` values per document.
    fingerprints: Vec<u32>,
    /// Documents too short to have a shingle; they cannot be near-duplicates.
    pub without_shingles: u64,
    pub skipped_invalid: u64,
}

impl FingerprintIndex {
    pub fn new(config: &FindDuplicatesConfig) -> Result<Self> {
        if config.num_bands == 0 || !config.num_seeds.is_multiple_of(config.num_bands) {
            bail!(
                "--num-seeds ({}) must be a positive multiple of --num-bands ({})",
                config.num_seeds,
                config.num_bands
            );
        }
        Ok(Self {
            seed: config.seed,
            hasher: MinHasher::new(config.seed, config.num_seeds),
            files: Vec::new(),
            ids: Vec::new(),
            spans: Vec::new(),
            fingerprints: Vec::new(),
            without_shingles: 0,
            skipped_invalid: 0,
        })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Bytes held by the index (fingerprints, ids, line locations).
    pub fn memory_bytes(&self) -> usize {
        self.fingerprints.len() * 4
            + self.ids.iter().map(|s| s.len() + 24).sum::<usize>()
            + self.spans.len() * std::mem::size_of::<LineSpan>()
    }

    /// Fingerprints every document of `path`, identified by its `key` field.
    pub fn add_file(
        &mut self,
        path: &PathBuf,
        key: &str,
        invalid: InvalidLines,
        progress: &ProgressBar,
    ) -> Result<()> {
        let name = path.display().to_string();
        let file = File::open(path).with_context(|| format!("cannot open {name}"))?;
        // SAFETY: the input is only read; a concurrent writer would at worst make a
        // document's re-read text fail to parse, which is reported as an error.
        let map = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {name}"))?;
        let file_no = self.files.len() as u32;
        let input = Input::File(path.clone());
        let mut tracker = InvalidLineTracker::new(invalid, &input);
        let line_starts = LineOffsets::new(&map);
        let hasher = &self.hasher;
        for_each_parallel(
            &input,
            progress,
            |line: &Line| {
                let doc = parse_line(line)?;
                let id = doc
                    .get_str(key)
                    .map_err(|m| line_error(line, m))?
                    .to_string();
                let text = doc.get_str("text").map_err(|m| line_error(line, m))?;
                Ok::<_, LineError>((line.line_no, id, hasher.fingerprint(text)))
            },
            |r| match r {
                Ok((line_no, id, fp)) => {
                    let (start, len) = line_starts.span(line_no)?;
                    if fp.iter().all(|&v| v == u32::MAX) {
                        self.without_shingles += 1;
                    }
                    self.ids.push(id);
                    self.spans.push(LineSpan {
                        file: file_no,
                        start,
                        len,
                    });
                    self.fingerprints.extend_from_slice(&fp);
                    Ok(())
                }
                Err(e) => tracker.handle(&e),
            },
        )?;
        self.skipped_invalid += tracker.skipped;
        self.files.push((map, name));
        Ok(())
    }

    /// `--save-fingerprints`: a JSON header line (settings, the input files with their sizes,
    /// ids, line spans) followed by the fingerprints as little-endian `u32`s. The texts stay in
    /// the inputs, which must be unchanged when the file is loaded again.
    pub fn save(&self, path: &Path) -> Result<()> {
        let header = SavedHeader {
            format: FINGERPRINTS_FORMAT.to_string(),
            seed: self.seed,
            num_seeds: self.hasher.num_seeds(),
            files: self
                .files
                .iter()
                .map(|(map, name)| (absolute(name), map.len() as u64))
                .collect(),
            ids: self.ids.clone(),
            spans: self
                .spans
                .iter()
                .map(|s| (s.file, s.start, s.len))
                .collect(),
            without_shingles: self.without_shingles,
        };
        let directory = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let mut temp = tempfile::NamedTempFile::new_in(directory)
            .with_context(|| format!("creating a file beside {}", path.display()))?;
        {
            let mut out = std::io::BufWriter::new(temp.as_file_mut());
            serde_json::to_writer(&mut out, &header)?;
            out.write_all(b"\n")?;
            for value in &self.fingerprints {
                out.write_all(&value.to_le_bytes())?;
            }
            out.flush()?;
        }
        temp.as_file().sync_all()?;
        temp.persist(path)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// `--load-fingerprints`: adds a saved index (same `--seed` and `--num-seeds`), re-mapping
    /// its input files for the texts.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).with_context(|| format!("reading {name}"))?;
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .with_context(|| format!("{name}: not a fingerprint file"))?;
        let header: SavedHeader = serde_json::from_slice(&bytes[..split])
            .with_context(|| format!("{name}: not a fingerprint file"))?;
        if header.format != FINGERPRINTS_FORMAT {
            bail!(
                "{name}: format {:?} is not {FINGERPRINTS_FORMAT:?}",
                header.format
            );
        }
        if (header.seed, header.num_seeds) != (self.seed, self.hasher.num_seeds()) {
            bail!(
                "{name} was made with --seed {} --num-seeds {}, this run uses --seed {} --num-seeds {}",
                header.seed,
                header.num_seeds,
                self.seed,
                self.hasher.num_seeds()
            );
        }
        let values = &bytes[split + 1..];
        let expected = header.ids.len() * header.num_seeds * 4;
        if values.len() != expected || header.spans.len() != header.ids.len() {
            bail!(
                "{name}: truncated ({} fingerprint bytes, {expected} expected)",
                values.len()
            );
        }
        let first_file = self.files.len() as u32;
        for (file, size) in &header.files {
            let opened = File::open(file)
                .with_context(|| format!("{name} refers to {file}, which cannot be opened"))?;
            // SAFETY: read-only mapping, as in `add_file`.
            let map =
                unsafe { Mmap::map(&opened) }.with_context(|| format!("cannot map {file}"))?;
            if map.len() as u64 != *size {
                bail!(
                    "{file} changed since {name} was saved ({} bytes, {size} then)",
                    map.len()
                );
            }
            self.files.push((map, file.clone()));
        }
        self.ids.extend(header.ids);
        self.spans
            .extend(header.spans.iter().map(|&(file, start, len)| LineSpan {
                file: first_file + file,
                start,
                len,
            }));
        self.fingerprints.extend(
            values
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
        self.without_shingles += header.without_shingles;
        Ok(())
    }

    fn fingerprint(&self, doc: usize) -> &[u32] {
        let n = self.hasher.num_seeds();
        &self.fingerprints[doc * n..(doc + 1) * n]
    }

    fn text(&self, doc: usize) -> Result<String> {
        let span = self.spans[doc];
        let (map, name) = &self.files[span.file as usize];
        let bytes = &map[span.start as usize..span.start as usize + span.len as usize];
        let line = std::str::from_utf8(bytes)
            .with_context(|| format!("{name}: document {} changed on disk", self.ids[doc]))?;
        let obj = JsonObject::parse(line.trim_end_matches('\r'))
            .map_err(|e| anyhow::anyhow!("{name}: re-reading {}: {e}", self.ids[doc]))?;
        Ok(obj.get_str("text").map_err(anyhow::Error::msg)?.to_string())
    }

    /// Groups documents by band: every bucket (band, identical band values) with more
    /// than one document, members in input order, buckets ordered by band then first member.
    pub fn candidate_buckets(&self, num_bands: usize) -> Vec<Bucket> {
        let width = self.hasher.num_seeds() / num_bands;
        let docs: Vec<u32> = (0..self.len() as u32)
            .filter(|&d| self.fingerprint(d as usize).iter().any(|&v| v != u32::MAX))
            .collect();
        (0..num_bands)
            .into_par_iter()
            .flat_map_iter(|band| {
                let mut keyed: Vec<(&[u32], u32)> = docs
                    .iter()
                    .map(|&d| {
                        let fp = self.fingerprint(d as usize);
                        (&fp[band * width..(band + 1) * width], d)
                    })
                    .collect();
                keyed.sort_unstable();
                let mut buckets: Vec<Bucket> = keyed
                    .chunk_by(|a, b| a.0 == b.0)
                    .filter(|run| run.len() > 1)
                    .map(|run| Bucket {
                        band,
                        members: run.iter().map(|&(_, d)| d).collect(),
                    })
                    .collect();
                buckets.sort_unstable_by_key(|b| b.members[0]);
                buckets
            })
            .collect()
    }
}

fn line_error(line: &Line, message: String) -> LineError {
    LineError {
        line_no: line.line_no,
        message,
    }
}

/// Byte offsets of line starts in a mapped file.
struct LineOffsets<'a> {
    map: &'a [u8],
    starts: Vec<u64>,
}

impl<'a> LineOffsets<'a> {
    fn new(map: &'a [u8]) -> Self {
        let mut starts = vec![0u64];
        starts.extend(
            memchr_iter(map)
                .map(|i| i as u64 + 1)
                .filter(|&s| (s as usize) < map.len()),
        );
        Self { map, starts }
    }

    /// Start and length (without the newline) of 1-based line `line_no`.
    fn span(&self, line_no: u64) -> Result<(u64, u32)> {
        let start = *self
            .starts
            .get(line_no as usize - 1)
            .context("input changed while being read")?;
        let end = self
            .starts
            .get(line_no as usize)
            .map_or(self.map.len() as u64, |&next| next - 1);
        let len = u32::try_from(end - start).context("a single line over 4 GiB")?;
        Ok((start, len))
    }
}

fn memchr_iter(hay: &[u8]) -> impl Iterator<Item = usize> + '_ {
    hay.iter()
        .enumerate()
        .filter(|(_, &b)| b == b'\n')
        .map(|(i, _)| i)
}

/// Documents whose fingerprints agree on one band.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub band: usize,
    pub members: Vec<u32>,
}

/// One output line: a main document and the members found similar to it.
#[derive(Debug, Clone, PartialEq)]
pub struct SimilarGroup {
    pub main: String,
    pub others: Vec<(String, f64)>,
}

impl SimilarGroup {
    /// `{"main": [{"other": 0.9}, …]}` as the original writes it.
    pub fn to_python_json(&self) -> String {
        let mut out = String::from("{");
        write_string(&self.main, &mut out);
        out.push_str(": [");
        for (i, (id, sim)) in self.others.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push('{');
            write_string(id, &mut out);
            out.push_str(": ");
            out.push_str(&super::json::python_float_repr(*sim));
            out.push('}');
        }
        out.push_str("]}");
        out
    }
}

/// Checks every bucket (in parallel) and returns the similar groups in bucket order.
pub fn similar_groups(
    index: &FingerprintIndex,
    buckets: &[Bucket],
    config: &FindDuplicatesConfig,
    progress: &ProgressBar,
) -> Result<Vec<SimilarGroup>> {
    let per_bucket: Vec<Result<Vec<SimilarGroup>>> = buckets
        .par_iter()
        .map(|bucket| {
            let groups = check_bucket(index, bucket, config);
            progress.inc(1);
            groups
        })
        .collect();
    let mut all = Vec::new();
    for groups in per_bucket {
        all.extend(groups?);
    }
    Ok(all)
}

fn check_bucket(
    index: &FingerprintIndex,
    bucket: &Bucket,
    config: &FindDuplicatesConfig,
) -> Result<Vec<SimilarGroup>> {
    let mut rng = config.seed
        ^ (bucket.band as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ ((bucket.members[0] as u64) << 20);
    let sets = bucket
        .members
        .iter()
        .map(|&d| Ok(shingle_set(&index.text(d as usize)?)))
        .collect::<Result<Vec<_>>>()?;
    // Positions into `bucket.members`/`sets` of the documents still in the bucket.
    let mut remaining: Vec<usize> = (0..sets.len()).collect();
    let mut groups = Vec::new();
    let mut iteration = 0;
    while remaining.len() > 1 && config.heuristic_iter.is_none_or(|n| iteration < n) {
        let main = remaining[(splitmix64(&mut rng) % remaining.len() as u64) as usize];
        let mut others = Vec::new();
        remaining.retain(|&other| {
            if other == main {
                return false;
            }
            let sim = jaccard(&sets[main], &sets[other], config.jaccard);
            if sim > PAIR_THRESHOLD {
                others.push((index.ids[bucket.members[other] as usize].clone(), sim));
                false
            } else {
                true
            }
        });
        if !others.is_empty() {
            groups.push(SimilarGroup {
                main: index.ids[bucket.members[main] as usize].clone(),
                others,
            });
        }
        iteration += 1;
    }
    Ok(groups)
}
