use std::io::BufRead;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver};
use std::time::{Duration, Instant};

use rayon::prelude::*;

use super::document::parse_line;
use super::{
    open_counted_input, output_prefix, EncodedField, Encoder, InputSource, Level, PreprocessError,
};
use crate::indexed::{DType, IndexedDatasetBuilder};

/// Lines per batch handed to the encoder threads; with a byte cap this bounds memory.
const BATCH_LINES: usize = 1024;
const BATCH_BYTES: usize = 4 << 20;
/// Batches read ahead of the encoder.
const BATCHES_IN_FLIGHT: usize = 2;

/// What `preprocess` does, in Megatron's terms.
#[derive(Debug, Clone)]
pub struct PreprocessOptions {
    pub inputs: Vec<InputSource>,
    pub json_keys: Vec<String>,
    pub output_prefix: PathBuf,
    /// Encoder threads (`--workers`).
    pub workers: usize,
    /// `--partitions`: with more than one (and no `--keep-sequential-samples`) documents are
    /// dealt round-robin to partitions that are concatenated in order, as Megatron does.
    pub partitions: usize,
    pub keep_sequential_samples: bool,
    /// Count and skip malformed lines instead of stopping at the first.
    pub skip_invalid: bool,
}

/// Counters reported while running.
#[derive(Debug, Clone, Copy, Default)]
pub struct Progress {
    pub documents: u64,
    /// Text of the lines processed (decompressed).
    pub bytes: u64,
    /// Bytes of the inputs as stored (compressed ones compressed) behind the lines processed:
    /// out of [`input_size`](super::input_size), how far the run is.
    pub input_bytes: u64,
    pub elapsed: Duration,
}

/// What a finished run produced.
#[derive(Debug, Clone)]
pub struct Summary {
    pub documents: u64,
    pub skipped: u64,
    pub bytes: u64,
    pub sequences: u64,
    pub tokens: u64,
    pub dtype: DType,
    pub outputs: Vec<PathBuf>,
    pub elapsed: Duration,
}

struct Line {
    source: usize,
    number: u64,
    text: String,
    /// Stored bytes of all inputs up to the end of this line.
    input_offset: u64,
}

type Batch = Result<Vec<Line>, PreprocessError>;

/// Reads all inputs on a separate thread, in bounded batches of non-blank lines.
fn spawn_reader(inputs: Vec<InputSource>) -> Receiver<Batch> {
    let (tx, rx) = sync_channel::<Batch>(BATCHES_IN_FLIGHT);
    std::thread::spawn(move || {
        let mut batch = Vec::new();
        let mut batch_bytes = 0;
        let mut earlier_inputs_bytes = 0;
        for (source, input) in inputs.iter().enumerate() {
            let mut reader = match open_counted_input(input) {
                Ok(r) => r,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let mut number = 0u64;
            let mut text_bytes = 0u64;
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match reader.lines.read_until(b'\n', &mut buf) {
                    Ok(0) => break,
                    Ok(n) => text_bytes += n as u64,
                    Err(e) => {
                        let _ = tx.send(Err(PreprocessError::Io {
                            what: format!("{}: read error after line {number}", input.name()),
                            source: e,
                        }));
                        return;
                    }
                }
                number += 1;
                if buf.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let text = match String::from_utf8(std::mem::take(&mut buf)) {
                    Ok(t) => t,
                    Err(e) => {
                        let text = String::from_utf8_lossy(e.as_bytes()).into_owned();
                        // Marked invalid by a NUL prefix, which no JSON line can start with.
                        format!("\0{text}")
                    }
                };
                batch_bytes += text.len();
                batch.push(Line {
                    source,
                    number,
                    text,
                    input_offset: earlier_inputs_bytes + reader.stored_bytes_behind(text_bytes),
                });
                if batch.len() >= BATCH_LINES || batch_bytes >= BATCH_BYTES {
                    batch_bytes = 0;
                    if tx.send(Ok(std::mem::take(&mut batch))).is_err() {
                        return;
                    }
                }
            }
            earlier_inputs_bytes += reader.stored_bytes_behind(text_bytes);
        }
        if !batch.is_empty() {
            let _ = tx.send(Ok(batch));
        }
    });
    rx
}

fn encode_line(
    line: &Line,
    keys: &[String],
    encoder: &Encoder,
) -> Result<Vec<EncodedField>, String> {
    if line.text.starts_with('\0') {
        return Err("line is not valid UTF-8".into());
    }
    let fields = parse_line(&line.text, keys)?;
    fields
        .iter()
        .zip(keys)
        .map(|(f, key)| encoder.encode(f).map_err(|e| format!("key {key:?}: {e}")))
        .collect()
}

/// One output dataset per JSON key (per partition when partitioning reorders documents).
struct Outputs {
    /// `builders[partition][key]`
    builders: Vec<Vec<IndexedDatasetBuilder>>,
    finals: Vec<PathBuf>,
    partition_prefixes: Vec<Vec<PathBuf>>,
}

/// Removes the temporary files a killed run left for `prefix` (`PREFIX.bin.tmp`,
/// `PREFIX.idx.tmp`, `PREFIX.partition-N.tmp.*`): only a finished output is ever renamed into
/// place, so nothing under these names is worth keeping.
fn remove_leftovers(prefix: &std::path::Path) -> Result<(), PreprocessError> {
    let (Some(directory), Some(base)) = (prefix.parent(), prefix.file_name()) else {
        return Ok(());
    };
    let directory = if directory.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        directory
    };
    let base = base.to_string_lossy();
    let Ok(entries) = std::fs::read_dir(directory) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(base.as_ref()) else {
            continue;
        };
        let leftover = rest == ".bin.tmp"
            || rest == ".idx.tmp"
            || (rest.starts_with(".partition-") && rest.contains(".tmp"));
        if leftover {
            std::fs::remove_file(entry.path()).map_err(|e| PreprocessError::Io {
                what: format!("removing the leftover {}", entry.path().display()),
                source: e,
            })?;
        }
    }
    Ok(())
}

impl Outputs {
    fn create(
        opts: &PreprocessOptions,
        level: Level,
        dtype: DType,
    ) -> Result<Self, PreprocessError> {
        let finals: Vec<PathBuf> = opts
            .json_keys
            .iter()
            .map(|k| output_prefix(&opts.output_prefix, k, level))
            .collect();
        for prefix in &finals {
            remove_leftovers(prefix)?;
        }
        let round_robin = opts.partitions > 1 && !opts.keep_sequential_samples;
        let partition_prefixes: Vec<Vec<PathBuf>> = if round_robin {
            (0..opts.partitions)
                .map(|p| {
                    finals
                        .iter()
                        .map(|f| {
                            let mut s = f.as_os_str().to_owned();
                            s.push(format!(".partition-{p}.tmp"));
                            PathBuf::from(s)
                        })
                        .collect()
                })
                .collect()
        } else {
            vec![finals.clone()]
        };
        let builders = partition_prefixes
            .iter()
            .map(|prefixes| {
                prefixes
                    .iter()
                    .map(|p| IndexedDatasetBuilder::new(p, dtype))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Outputs {
            builders,
            finals,
            partition_prefixes,
        })
    }

    fn add(&mut self, document: u64, fields: &[EncodedField]) -> Result<(), PreprocessError> {
        let partition = (document % self.builders.len() as u64) as usize;
        for (builder, field) in self.builders[partition].iter_mut().zip(fields) {
            builder.add_document(&field.tokens, &field.lengths)?;
        }
        Ok(())
    }

    fn finish(self) -> Result<Vec<PathBuf>, PreprocessError> {
        for partition in self.builders {
            for builder in partition {
                builder.finalize()?;
            }
        }
        if self.partition_prefixes.len() > 1 {
            for (key, final_prefix) in self.finals.iter().enumerate() {
                let parts: Vec<PathBuf> = self
                    .partition_prefixes
                    .iter()
                    .map(|p| p[key].clone())
                    .collect();
                let merged = crate::indexed::merge_datasets(&parts, final_prefix, false);
                for part in &parts {
                    let _ = std::fs::remove_file(crate::indexed::bin_path(part));
                    let _ = std::fs::remove_file(crate::indexed::idx_path(part));
                }
                merged?;
            }
        }
        Ok(self.finals)
    }
}

/// Runs the whole conversion; `on_progress` is called after every written document.
pub fn preprocess(
    opts: &PreprocessOptions,
    encoder: &Encoder,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Summary, PreprocessError> {
    if opts.json_keys.is_empty() {
        return Err(PreprocessError::Input(
            "--json-keys: at least one key is needed".into(),
        ));
    }
    let start = Instant::now();
    let level = if encoder.splits_sentences() {
        Level::Sentence
    } else {
        Level::Document
    };
    let dtype = DType::optimal_for_vocab(encoder.tokenizer().vocab_size());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers.max(1))
        .build()
        .map_err(|e| {
            PreprocessError::Input(format!("cannot start {} worker threads: {e}", opts.workers))
        })?;
    let mut outputs = Outputs::create(opts, level, dtype)?;
    let names: Vec<String> = opts.inputs.iter().map(InputSource::name).collect();
    let mut progress = Progress::default();
    let (mut skipped, mut sequences, mut tokens) = (0u64, 0u64, 0u64);
    for batch in spawn_reader(opts.inputs.clone()) {
        let batch = batch?;
        let encoded: Vec<Result<Vec<EncodedField>, String>> = pool.install(|| {
            batch
                .par_iter()
                .map(|line| encode_line(line, &opts.json_keys, encoder))
                .collect()
        });
        for (line, result) in batch.iter().zip(encoded) {
            progress.bytes += line.text.len() as u64;
            progress.input_bytes = line.input_offset;
            match result {
                Ok(fields) => {
                    for f in &fields {
                        sequences += f.lengths.len() as u64;
                        tokens += f.tokens.len() as u64;
                    }
                    outputs.add(progress.documents, &fields)?;
                    progress.documents += 1;
                    progress.elapsed = start.elapsed();
                    on_progress(&progress);
                }
                Err(_) if opts.skip_invalid => skipped += 1,
                Err(reason) => {
                    return Err(PreprocessError::BadLine {
                        source_name: names[line.source].clone(),
                        line: line.number,
                        reason,
                    })
                }
            }
        }
    }
    let outputs_written = outputs.finish()?;
    Ok(Summary {
        documents: progress.documents,
        skipped,
        bytes: progress.bytes,
        sequences,
        tokens,
        dtype,
        outputs: outputs_written,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::indexed::IndexedDataset;
    use crate::tokenizer::NullTokenizer;

    fn run(
        lines: &str,
        append_eod: bool,
        partitions: usize,
    ) -> (tempfile::TempDir, Result<Summary, PreprocessError>) {
        let dir = tempfile::tempdir().unwrap();
        let summary = run_in(dir.path(), lines, append_eod, partitions);
        (dir, summary)
    }

    fn run_in(
        dir: &std::path::Path,
        lines: &str,
        append_eod: bool,
        partitions: usize,
    ) -> Result<Summary, PreprocessError> {
        let input = dir.join("in.jsonl");
        std::fs::write(&input, lines).unwrap();
        let opts = PreprocessOptions {
            inputs: vec![InputSource::File(input)],
            json_keys: vec!["text".into(), "title".into()],
            output_prefix: dir.join("out"),
            workers: 2,
            partitions,
            keep_sequential_samples: false,
            skip_invalid: false,
        };
        let encoder = Encoder::new(Box::new(NullTokenizer::new(100)), None, append_eod).unwrap();
        preprocess(&opts, &encoder, |_| {})
    }

    /// The `input_bytes` of every progress report of a run over `inputs` (keys text, title).
    fn input_positions(dir: &std::path::Path, inputs: Vec<InputSource>) -> Vec<u64> {
        let opts = PreprocessOptions {
            inputs,
            json_keys: vec!["text".into(), "title".into()],
            output_prefix: dir.join("out"),
            workers: 2,
            partitions: 1,
            keep_sequential_samples: false,
            skip_invalid: false,
        };
        let encoder = Encoder::new(Box::new(NullTokenizer::new(100)), None, false).unwrap();
        let mut positions = Vec::new();
        preprocess(&opts, &encoder, |p| positions.push(p.input_bytes)).unwrap();
        positions
    }

    #[test]
    fn progress_counts_the_inputs_stored_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let first = "{\"text\": \"1 2\", \"title\": \"3\"}\n";
        let second = "{\"text\": \"4 5 6 7\", \"title\": \"8\"}\n";
        // A blank line is input read too: it counts toward the next document.
        let plain_text = format!("{first}\n{second}");
        let plain = dir.path().join("a.jsonl");
        std::fs::write(&plain, &plain_text).unwrap();
        let gz = dir.path().join("b.jsonl.gz");
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut encoder, second.repeat(40).as_bytes()).unwrap();
        let compressed = encoder.finish().unwrap();
        std::fs::write(&gz, &compressed).unwrap();

        let inputs = vec![InputSource::File(plain), InputSource::File(gz)];
        let total = super::super::input_size(&inputs).unwrap();
        assert_eq!(total, (plain_text.len() + compressed.len()) as u64);
        let positions = input_positions(dir.path(), inputs);
        assert_eq!(positions.len(), 42);
        assert_eq!(
            positions[..2],
            [first.len() as u64, plain_text.len() as u64]
        );
        // The decompressor takes the small file whole before the first line comes out.
        assert!(positions[2..].iter().all(|&p| p == total), "{positions:?}");
    }

    #[test]
    fn a_killed_runs_temporary_files_are_removed_by_the_next_run() {
        let dir = tempfile::tempdir().unwrap();
        let leftovers = [
            "out_text_document.bin.tmp",
            "out_text_document.idx.tmp",
            "out_title_document.partition-7.tmp.bin",
            "out_title_document.partition-7.tmp.bin.tmp",
        ];
        for name in leftovers {
            std::fs::write(dir.path().join(name), b"half written").unwrap();
        }
        std::fs::write(dir.path().join("out_text_document.keep.tmp"), b"not ours").unwrap();
        run_in(
            dir.path(),
            "{\"text\": \"1\", \"title\": \"2\"}\n",
            false,
            1,
        )
        .unwrap();
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(
            left,
            [
                "in.jsonl",
                "out_text_document.bin",
                "out_text_document.idx",
                "out_text_document.keep.tmp",
                "out_title_document.bin",
                "out_title_document.idx"
            ]
        );
    }

    #[test]
    fn empty_documents_keep_a_boundary_and_get_no_eod() {
        let lines = "{\"text\": \"1 2\", \"title\": \"7\"}\n\n{\"text\": \"\", \"title\": [\"8\", \"\", \"9 9\"]}\n{\"text\": \"3\", \"title\": \"\"}\n";
        let (dir, summary) = run(lines, true, 1);
        let summary = summary.unwrap();
        assert_eq!(
            (summary.documents, summary.sequences, summary.tokens),
            (3, 5, 11)
        );
        let text = IndexedDataset::open(dir.path().join("out_text_document")).unwrap();
        assert_eq!(text.document_indices(), [0, 1, 1, 2]);
        assert_eq!(
            (text.sequence(0), text.sequence(1)),
            (vec![1, 2, 100], vec![3, 100])
        );
        let title = IndexedDataset::open(dir.path().join("out_title_document")).unwrap();
        assert_eq!(title.document_indices(), [0, 1, 3, 3]);
        assert_eq!(title.sequence_lengths(), [2, 1, 3]);
        assert_eq!(title.sequence(2), [9, 9, 100]);
    }

    #[test]
    fn partitions_deal_documents_round_robin() {
        let lines: String = (0..5)
            .map(|i| format!("{{\"text\": \"{i}\", \"title\": \"\"}}\n"))
            .collect();
        let (dir, summary) = run(&lines, false, 2);
        summary.unwrap();
        let text = IndexedDataset::open(dir.path().join("out_text_document")).unwrap();
        let order: Vec<i64> = (0..text.len()).map(|i| text.sequence(i)[0]).collect();
        assert_eq!(order, [0, 2, 4, 1, 3]);
    }

    #[test]
    fn a_bad_token_stops_the_run_and_leaves_no_output() {
        let (dir, summary) = run(
            "{\"text\": \"1\", \"title\": \"2\"}\n{\"text\": \"1 x\", \"title\": \"2\"}\n",
            false,
            1,
        );
        let err = summary.unwrap_err().to_string();
        assert!(
            err.contains("in.jsonl:2: key \"text\": NullTokenizer expects"),
            "{err}"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["in.jsonl"]);
    }
}
