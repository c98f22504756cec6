//! Metrics as JSON lines: one object per record, easy to load with pandas or `jq`.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{Map, Value};

/// An append-only JSON-lines file. Each record goes out in one write, so a crash never leaves
/// a buffered line behind, and a resumed run continues the same file.
pub struct JsonlMetrics {
    path: PathBuf,
    file: File,
}

impl JsonlMetrics {
    /// Opens `path` for appending, creating it and its parent directories if needed.
    pub fn create(path: &Path) -> Result<Self> {
        if let Some(parent) = path
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
        {
            fs::create_dir_all(parent)
                .with_context(|| format!("cannot create directory {}", parent.display()))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open metrics file {}", path.display()))?;
        Ok(JsonlMetrics {
            path: path.to_owned(),
            file,
        })
    }

    /// Appends `record` as one line. Non-finite numbers have no JSON form and are written as
    /// `null` (serde_json's `Value` cannot hold them).
    pub fn write(&mut self, record: &Map<String, Value>) -> Result<()> {
        let mut line = serde_json::to_vec(record).context("cannot serialise a metrics record")?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .with_context(|| format!("cannot write metrics to {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(value: Value) -> Map<String, Value> {
        value.as_object().unwrap().clone()
    }

    #[test]
    fn records_are_lines_and_reopening_appends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("logs/metrics.jsonl");
        let mut metrics = JsonlMetrics::create(&path).unwrap();
        metrics
            .write(&record(json!({"iteration": 1, "lm loss": 10.5})))
            .unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"iteration\":1,\"lm loss\":10.5}\n"
        );
        drop(metrics);

        let mut resumed = JsonlMetrics::create(&path).unwrap();
        resumed.write(&record(json!({"iteration": 2}))).unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            "{\"iteration\":1,\"lm loss\":10.5}\n{\"iteration\":2}\n"
        );
    }
}
