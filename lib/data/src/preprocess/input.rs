use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::PreprocessError;

const GZIP_MAGIC: &[u8] = &[0x1f, 0x8b];
const ZSTD_MAGIC: &[u8] = &[0x28, 0xb5, 0x2f, 0xfd];

/// One input stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InputSource {
    Stdin,
    File(PathBuf),
}

impl InputSource {
    /// How errors name this input.
    pub fn name(&self) -> String {
        match self {
            InputSource::Stdin => "<stdin>".into(),
            InputSource::File(p) => p.display().to_string(),
        }
    }
}

/// Resolves `--input` values: `-` is standard input, an existing path is taken as is, and
/// anything else is a glob pattern whose matches are taken in sorted order.
pub fn expand_inputs(patterns: &[String]) -> Result<Vec<InputSource>, PreprocessError> {
    let mut out = Vec::new();
    for pattern in patterns {
        if pattern == "-" {
            out.push(InputSource::Stdin);
            continue;
        }
        let path = PathBuf::from(pattern);
        if path.is_file() {
            out.push(InputSource::File(path));
            continue;
        }
        if path.is_dir() {
            return Err(PreprocessError::Input(format!(
                "--input {pattern}: is a directory; pass files or a glob"
            )));
        }
        let matches = glob::glob(pattern).map_err(|e| {
            PreprocessError::Input(format!("--input {pattern}: bad glob pattern: {e}"))
        })?;
        let mut files = Vec::new();
        for m in matches {
            let m = m.map_err(|e| PreprocessError::Input(format!("--input {pattern}: {e}")))?;
            if m.is_file() {
                files.push(m);
            }
        }
        if files.is_empty() {
            return Err(PreprocessError::Input(format!(
                "--input {pattern}: no such file"
            )));
        }
        out.extend(files.into_iter().map(InputSource::File));
    }
    Ok(out)
}

/// The bytes `inputs` hold on disk, compressed ones as they are stored: the total of a progress
/// bar over [`Progress::input_bytes`](super::Progress::input_bytes). `None` when one of them is
/// standard input or its size cannot be read (opening it will say why).
pub fn input_size(inputs: &[InputSource]) -> Option<u64> {
    inputs
        .iter()
        .map(|input| match input {
            InputSource::Stdin => None,
            InputSource::File(path) => std::fs::metadata(path).ok().map(|m| m.len()),
        })
        .sum()
}

/// An input opened for reading lines, which knows how far into the input it is.
pub struct OpenedInput {
    pub lines: Box<dyn BufRead + Send>,
    /// Bytes taken from the file or stream, counted below the decompressor.
    stored_bytes_read: Arc<AtomicU64>,
    compressed: bool,
}

impl OpenedInput {
    /// How many of the input's stored bytes lie behind the lines read so far, given the
    /// `text_bytes` those lines held. Plain input is counted exactly; compressed input by what
    /// the decompressor has taken, which runs ahead of the lines by its buffer.
    pub fn stored_bytes_behind(&self, text_bytes: u64) -> u64 {
        if self.compressed {
            self.stored_bytes_read.load(Ordering::Relaxed)
        } else {
            text_bytes
        }
    }
}

/// Counts the bytes read through it into a shared counter.
struct Counted<R> {
    inner: R,
    read: Arc<AtomicU64>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Opens an input as a line reader, decompressing gzip or zstd when its first bytes say so.
pub fn open_input(source: &InputSource) -> Result<Box<dyn BufRead + Send>, PreprocessError> {
    Ok(open_counted_input(source)?.lines)
}

/// [`open_input`], counting how far into the input the reading is.
pub fn open_counted_input(source: &InputSource) -> Result<OpenedInput, PreprocessError> {
    let stored_bytes_read = Arc::new(AtomicU64::new(0));
    let raw: Box<dyn Read + Send> = match source {
        InputSource::Stdin => Box::new(std::io::stdin()),
        InputSource::File(p) => Box::new(File::open(p).map_err(|e| PreprocessError::Io {
            what: format!("cannot open {}", p.display()),
            source: e,
        })?),
    };
    let counted = Counted {
        inner: raw,
        read: stored_bytes_read.clone(),
    };
    let mut reader = BufReader::with_capacity(1 << 20, counted);
    let head = reader.fill_buf().map_err(|e| PreprocessError::Io {
        what: format!("cannot read {}", source.name()),
        source: e,
    })?;
    let wrap = |what: &str, e| PreprocessError::Io {
        what: format!("{}: {what}", source.name()),
        source: e,
    };
    let compressed = head.starts_with(GZIP_MAGIC) || head.starts_with(ZSTD_MAGIC);
    let lines: Box<dyn BufRead + Send> = if head.starts_with(GZIP_MAGIC) {
        Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(reader),
        ))
    } else if head.starts_with(ZSTD_MAGIC) {
        let decoder = zstd::stream::read::Decoder::with_buffer(reader)
            .map_err(|e| wrap("bad zstd stream", e))?;
        Box::new(BufReader::with_capacity(1 << 20, decoder))
    } else {
        Box::new(reader)
    };
    Ok(OpenedInput {
        lines,
        stored_bytes_read,
        compressed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn read_all(path: PathBuf) -> String {
        let mut out = String::new();
        open_input(&InputSource::File(path))
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        out
    }

    #[test]
    fn decompresses_gzip_and_zstd_by_content() {
        let dir = tempfile::tempdir().unwrap();
        let text = "{\"text\": \"a\"}\n{\"text\": \"b\"}\n";
        let gz = dir.path().join("in.jsonl.gz");
        let mut enc =
            flate2::write::GzEncoder::new(File::create(&gz).unwrap(), flate2::Compression::fast());
        enc.write_all(text.as_bytes()).unwrap();
        enc.finish().unwrap();
        let zst = dir.path().join("in.zst");
        std::fs::write(&zst, zstd::encode_all(text.as_bytes(), 3).unwrap()).unwrap();
        let plain = dir.path().join("in.jsonl");
        std::fs::write(&plain, text).unwrap();
        for p in [gz, zst, plain] {
            assert_eq!(read_all(p), text);
        }
    }

    #[test]
    fn the_input_size_is_what_the_files_hold_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("a.jsonl");
        std::fs::write(&plain, "{\"text\": \"abc\"}\n").unwrap();
        let zst = dir.path().join("b.jsonl.zst");
        let text = "{\"text\": \"de\"}\n".repeat(50);
        let compressed = zstd::encode_all(text.as_bytes(), 3).unwrap();
        assert!(compressed.len() < text.len());
        std::fs::write(&zst, &compressed).unwrap();
        let files = [InputSource::File(plain), InputSource::File(zst)];
        assert_eq!(input_size(&files), Some(16 + compressed.len() as u64));
        assert_eq!(input_size(&[files[0].clone(), InputSource::Stdin]), None);
    }

    #[test]
    fn globs_expand_sorted_and_missing_inputs_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        for n in ["b.jsonl", "a.jsonl", "c.txt"] {
            std::fs::write(dir.path().join(n), "").unwrap();
        }
        let pattern = dir.path().join("*.jsonl").display().to_string();
        let got = expand_inputs(&[pattern, "-".into()]).unwrap();
        assert_eq!(
            got,
            [
                InputSource::File(dir.path().join("a.jsonl")),
                InputSource::File(dir.path().join("b.jsonl")),
                InputSource::Stdin
            ]
        );
        let missing = dir.path().join("nope.jsonl").display().to_string();
        assert!(expand_inputs(&[missing])
            .unwrap_err()
            .to_string()
            .contains("no such file"));
    }
}
