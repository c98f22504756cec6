//! Line-oriented I/O shared by every step: inputs are files or `-` (stdin), read in
//! batches that rayon processes in parallel while output order stays input order; outputs
//! are files written under a temporary name and renamed when complete, or `-` (stdout).

use anyhow::{bail, Context, Result};
use indicatif::ProgressBar;
use rayon::prelude::*;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::json::JsonObject;

/// Lines handed to the workers at once; bounds memory to one batch per step.
const BATCH_LINES: usize = 4096;

/// What to do with a line that is not a JSON object (or lacks a required field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InvalidLines {
    /// Stop with an error naming the file and line.
    #[default]
    Fail,
    /// Drop the line and count it.
    Skip,
}

/// One input line with where it came from.
#[derive(Debug, Clone)]
pub struct Line {
    pub line_no: u64,
    pub text: String,
}

/// An input: a named file or stdin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Stdin,
    File(PathBuf),
}

impl Input {
    pub fn from_arg(arg: &Path) -> Self {
        if arg.as_os_str() == "-" {
            Input::Stdin
        } else {
            Input::File(arg.to_path_buf())
        }
    }

    pub fn name(&self) -> String {
        match self {
            Input::Stdin => "<stdin>".to_string(),
            Input::File(p) => p.display().to_string(),
        }
    }

    pub fn open(&self) -> Result<Box<dyn BufRead + Send>> {
        Ok(match self {
            Input::Stdin => Box::new(BufReader::with_capacity(1 << 20, io::stdin())),
            Input::File(p) => Box::new(BufReader::with_capacity(
                1 << 20,
                File::open(p).with_context(|| format!("cannot open {}", p.display()))?,
            )),
        })
    }

    /// Size in bytes when known (files), for progress bars.
    pub fn size_bytes(&self) -> Option<u64> {
        match self {
            Input::Stdin => None,
            Input::File(p) => std::fs::metadata(p).ok().map(|m| m.len()),
        }
    }
}

/// Reads lines in batches. Lines end at `\n`; a trailing `\r` is dropped, as Python's
/// text mode does for `\r\n` files.
pub struct LineBatches {
    input: Input,
    reader: Box<dyn BufRead + Send>,
    next_line: u64,
    bytes_read: u64,
}

impl LineBatches {
    pub fn open(input: &Input) -> Result<Self> {
        Ok(Self {
            reader: input.open()?,
            input: input.clone(),
            next_line: 1,
            bytes_read: 0,
        })
    }

    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// The next batch, empty at end of input.
    pub fn next_batch(&mut self) -> Result<Vec<Line>> {
        let mut batch = Vec::with_capacity(BATCH_LINES);
        let mut buf = Vec::new();
        while batch.len() < BATCH_LINES {
            buf.clear();
            let n = self
                .reader
                .read_until(b'\n', &mut buf)
                .with_context(|| format!("reading {}", self.input.name()))?;
            if n == 0 {
                break;
            }
            self.bytes_read += n as u64;
            if buf.last() == Some(&b'\n') {
                buf.pop();
                if buf.last() == Some(&b'\r') {
                    buf.pop();
                }
            }
            let line_no = self.next_line;
            self.next_line += 1;
            let text = String::from_utf8(std::mem::take(&mut buf)).map_err(|_| {
                anyhow::anyhow!("{}:{line_no}: line is not valid UTF-8", self.input.name())
            })?;
            batch.push(Line { line_no, text });
        }
        Ok(batch)
    }
}

/// A parse or field error on one line; `--skip-invalid` turns these into a count.
#[derive(Debug, Clone)]
pub struct LineError {
    pub line_no: u64,
    pub message: String,
}

/// Counts invalid lines or turns the first one into an error, per the chosen policy.
#[derive(Debug)]
pub struct InvalidLineTracker {
    policy: InvalidLines,
    input_name: String,
    pub skipped: u64,
}

impl InvalidLineTracker {
    pub fn new(policy: InvalidLines, input: &Input) -> Self {
        Self {
            policy,
            input_name: input.name(),
            skipped: 0,
        }
    }

    pub fn handle(&mut self, err: &LineError) -> Result<()> {
        match self.policy {
            InvalidLines::Fail => bail!(
                "{}:{}: {} (use --skip-invalid to drop such lines)",
                self.input_name,
                err.line_no,
                err.message
            ),
            InvalidLines::Skip => {
                self.skipped += 1;
                Ok(())
            }
        }
    }
}

/// Parses a line into a JSON object, mapping failures to a [`LineError`].
pub fn parse_line(line: &Line) -> Result<JsonObject, LineError> {
    JsonObject::parse(&line.text).map_err(|message| LineError {
        line_no: line.line_no,
        message: format!("invalid JSON: {message}"),
    })
}

/// Streams `input` through `work` in parallel batches and hands each result, in input
/// order, to `sink`; `progress` follows the bytes read.
pub fn for_each_parallel<R, W, S>(
    input: &Input,
    progress: &ProgressBar,
    work: W,
    mut sink: S,
) -> Result<()>
where
    R: Send,
    W: Fn(&Line) -> R + Sync,
    S: FnMut(R) -> Result<()>,
{
    let mut batches = LineBatches::open(input)?;
    loop {
        let batch = batches.next_batch()?;
        if batch.is_empty() {
            return Ok(());
        }
        let results: Vec<R> = batch.par_iter().map(&work).collect();
        for r in results {
            sink(r)?;
        }
        progress.set_position(batches.bytes_read());
    }
}

/// An output file that only appears under its name once [`AtomicOutput::finish`] succeeds;
/// `-` writes to stdout.
pub struct AtomicOutput {
    target: Option<PathBuf>,
    temp: Option<tempfile::NamedTempFile>,
    writer: Box<dyn Write>,
}

impl AtomicOutput {
    pub fn create(path: &Path) -> Result<Self> {
        if path.as_os_str() == "-" {
            return Ok(Self {
                target: None,
                temp: None,
                writer: Box::new(BufWriter::with_capacity(1 << 20, io::stdout())),
            });
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let file_name = path
            .file_name()
            .with_context(|| format!("output path {} has no file name", path.display()))?;
        let temp = tempfile::Builder::new()
            .prefix(&format!(".{}.", file_name.to_string_lossy()))
            .suffix(".partial")
            .tempfile_in(&dir)
            .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
        let file = temp.reopen().context("reopening the temporary output")?;
        Ok(Self {
            target: Some(path.to_path_buf()),
            temp: Some(temp),
            writer: Box::new(BufWriter::with_capacity(1 << 20, file)),
        })
    }

    /// Writes one line (a `\n` is appended).
    pub fn write_line(&mut self, line: &str) -> Result<()> {
        self.writer
            .write_all(line.as_bytes())
            .and_then(|_| self.writer.write_all(b"\n"))
            .with_context(|| format!("writing {}", self.name()))
    }

    pub fn name(&self) -> String {
        self.target
            .as_ref()
            .map_or("<stdout>".to_string(), |p| p.display().to_string())
    }

    /// Flushes and moves the file to its final name.
    pub fn finish(mut self) -> Result<()> {
        let name = self.name();
        self.writer
            .flush()
            .with_context(|| format!("writing {name}"))?;
        drop(self.writer);
        if let (Some(temp), Some(target)) = (self.temp.take(), self.target.take()) {
            temp.as_file()
                .sync_all()
                .with_context(|| format!("syncing {name}"))?;
            temp.persist(&target)
                .with_context(|| format!("renaming the finished output to {name}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_appears_only_when_finished() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        let mut out = AtomicOutput::create(&path).unwrap();
        out.write_line("{}").unwrap();
        assert!(!path.exists());
        out.finish().unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{}\n");

        let mut abandoned = AtomicOutput::create(&dir.path().join("gone.json")).unwrap();
        abandoned.write_line("{}").unwrap();
        drop(abandoned);
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "no partial file may remain");
    }

    #[test]
    fn lines_are_numbered_and_crlf_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.json");
        std::fs::write(&path, "{\"a\": 1}\r\nnot json\n").unwrap();
        let input = Input::File(path);
        let mut batches = LineBatches::open(&input).unwrap();
        let batch = batches.next_batch().unwrap();
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[0].text, "{\"a\": 1}");
        let err = parse_line(&batch[1]).unwrap_err();
        let mut strict = InvalidLineTracker::new(InvalidLines::Fail, &input);
        let msg = strict.handle(&err).unwrap_err().to_string();
        assert!(msg.contains("in.json:2:"), "{msg}");
        let mut lenient = InvalidLineTracker::new(InvalidLines::Skip, &input);
        lenient.handle(&err).unwrap();
        assert_eq!(lenient.skipped, 1);
    }
}
