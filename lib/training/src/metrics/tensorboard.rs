//! A TensorBoard event-file writer for scalars, readable by TensorBoard and by
//! `EventAccumulator` like the files of PyTorch's `SummaryWriter`, which Megatron uses.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};

use super::event::{file_version_event, scalar_event, text_event};
use super::tfrecord::write_record;

/// An open `events.out.tfevents.*` file. Records are buffered; `flush` hands them to the OS and
/// dropping the writer flushes what is left (errors on drop are lost, so call `flush` first
/// where they matter).
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardWriter {
    /// Creates `dir` if needed and a new event file in it, named as TensorFlow names them
    /// (`events.out.tfevents.<unix seconds>.<hostname>`), with `.<pid>.<n>` appended when
    /// that name is taken (two writers started in the same second).
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create TensorBoard directory {}", dir.display()))?;
        let now = wall_time();
        let base = format!("events.out.tfevents.{:010}.{}", now as u64, hostname());
        let (path, file) = create_unique(dir, &base)?;
        let mut writer = TensorBoardWriter {
            path,
            out: BufWriter::new(file),
        };
        writer.write(&file_version_event(now))?;
        Ok(writer)
    }

    /// The event file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends a scalar summary `tag` = `value` at `step`, stamped with the current time.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> Result<()> {
        self.write(&scalar_event(wall_time(), step, tag, value))
    }

    /// Appends a text summary at `step` under `<tag>/text_summary`, the tag PyTorch's
    /// `add_text` (which Megatron calls) gives it.
    pub fn add_text(&mut self, tag: &str, text: &str, step: i64) -> Result<()> {
        let tag = format!("{tag}/text_summary");
        self.write(&text_event(wall_time(), step, &tag, text))
    }

    pub fn flush(&mut self) -> Result<()> {
        self.out
            .flush()
            .with_context(|| format!("cannot write TensorBoard events to {}", self.path.display()))
    }

    fn write(&mut self, event: &[u8]) -> Result<()> {
        write_record(&mut self.out, event)
            .with_context(|| format!("cannot write TensorBoard events to {}", self.path.display()))
    }
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// The kernel's host name; only decorates the file name, so a system without procfs gets a
/// fixed stand-in rather than an error.
fn hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Creates `dir/base`, or the first free `dir/base.<pid>.<n>`, never opening an existing file.
fn create_unique(dir: &Path, base: &str) -> Result<(PathBuf, File)> {
    let candidates = std::iter::once(base.to_owned())
        .chain((1u32..).map(|n| format!("{base}.{}.{n}", std::process::id())));
    for name in candidates {
        let path = dir.join(name);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(file) => return Ok((path, file)),
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(error) => {
                return Err(error)
                    .with_context(|| format!("cannot create event file {}", path.display()))
            }
        }
    }
    unreachable!("the candidate names never run out")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::tfrecord::masked_crc32c;

    /// Splits a TFRecord file into its payloads, checking both CRCs of every record.
    fn read_records(bytes: &[u8]) -> Vec<Vec<u8>> {
        let mut records = Vec::new();
        let mut rest = bytes;
        while !rest.is_empty() {
            let (header, tail) = rest.split_at(12);
            let length = u64::from_le_bytes(header[..8].try_into().unwrap()) as usize;
            let header_crc = u32::from_le_bytes(header[8..].try_into().unwrap());
            assert_eq!(header_crc, masked_crc32c(&header[..8]));
            let (data, tail) = tail.split_at(length);
            let (crc, tail) = tail.split_at(4);
            assert_eq!(
                u32::from_le_bytes(crc.try_into().unwrap()),
                masked_crc32c(data)
            );
            records.push(data.to_vec());
            rest = tail;
        }
        records
    }

    #[test]
    fn file_starts_with_the_version_event_and_holds_scalars_after_flush() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = TensorBoardWriter::create(&dir.path().join("tb")).unwrap();
        writer.add_scalar("lm loss", 2.5, 7).unwrap();
        writer.flush().unwrap();

        let name = writer.path().file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let records = read_records(&fs::read(writer.path()).unwrap());
        assert_eq!(records.len(), 2);
        // wall_time (tag 0x09 + 8 bytes), then field 3 "brain.Event:2".
        assert_eq!(&records[0][9..11], [0x1a, 13]);
        assert_eq!(&records[0][11..], b"brain.Event:2");
        // wall_time, then step 7 and the summary.
        assert_eq!(&records[1][9..11], [0x10, 7]);
        assert!(records[1].ends_with(&[b'l', b'o', b's', b's', 0x15, 0, 0, 0x20, 0x40]));
    }

    #[test]
    fn dropping_the_writer_flushes_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = TensorBoardWriter::create(dir.path()).unwrap();
        writer.add_scalar("x", 1.0, 1).unwrap();
        let path = writer.path().to_owned();
        drop(writer);
        assert_eq!(read_records(&fs::read(path).unwrap()).len(), 2);
    }

    #[test]
    fn writers_started_together_get_distinct_files() {
        let dir = tempfile::tempdir().unwrap();
        let first = TensorBoardWriter::create(dir.path()).unwrap();
        let second = TensorBoardWriter::create(dir.path()).unwrap();
        let third = TensorBoardWriter::create(dir.path()).unwrap();
        assert_ne!(first.path(), second.path());
        assert_ne!(second.path(), third.path());
        assert_ne!(first.path(), third.path());
    }
}
