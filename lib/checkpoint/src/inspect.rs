//! `checkpoint_convert inspect`: a readable listing of any supported checkpoint — layout,
//! scalar entries and args, and every tensor with its dtype and shape.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use crate::layout::{detect, rank_directories, rank_file, Format};
use crate::pickle::Value;
use crate::safetensors_file::SafetensorsFile;
use crate::torch_dist::DistCheckpoint;
use crate::torch_file::TorchFile;

/// Describes the checkpoint under `root`.
pub fn inspect(root: &Path) -> Result<String> {
    let (format, directory) = detect(root)?;
    let mut out = String::new();
    writeln!(out, "format: {}", format.name())?;
    writeln!(out, "directory: {}", directory.display())?;
    match format {
        Format::MegatronTorch => {
            let ranks = rank_directories(&directory)?;
            let tp = ranks.iter().map(|r| r.tensor_rank).max().unwrap_or(0) + 1;
            let pp = ranks.iter().map(|r| r.pipeline_rank).max().unwrap_or(0) + 1;
            writeln!(out, "layout: TP={tp} PP={pp} ({} rank files)", ranks.len())?;
            for (i, rank) in ranks.iter().enumerate() {
                let path = rank_file(rank)?;
                let file = TorchFile::open(&path)?;
                writeln!(out, "\n{}", path.display())?;
                describe_pickle(&file, &mut out, i == 0)?;
            }
        }
        Format::TorchDist => {
            let checkpoint = DistCheckpoint::open(&directory)?;
            writeln!(out, "\ncommon.pt")?;
            describe_pickle(&checkpoint.common, &mut out, true)?;
            writeln!(out, "\n.metadata: {} tensors", checkpoint.tensors.len())?;
            for (name, tensor) in &checkpoint.tensors {
                writeln!(
                    out,
                    "  {name}  {}  {:?}  ({} chunks)",
                    tensor.dtype,
                    tensor.shape,
                    tensor.chunks.len()
                )?;
            }
            for name in &checkpoint.byte_items {
                writeln!(out, "  {name}  bytes")?;
            }
        }
        Format::MegatronRs => {
            let metadata = std::fs::read_to_string(directory.join("metadata.json"))?;
            writeln!(out, "metadata.json:\n{metadata}")?;
            list_safetensors_under(&directory, &mut out)?;
        }
        Format::HuggingFace => {
            let config = std::fs::read_to_string(directory.join("config.json"))?;
            writeln!(out, "config.json:\n{config}")?;
            list_safetensors_under(&directory, &mut out)?;
            let mut bins: Vec<_> = std::fs::read_dir(&directory)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "bin"))
                .collect();
            bins.sort();
            for path in bins {
                let file = TorchFile::open(&path)?;
                writeln!(out, "\n{}", path.display())?;
                describe_pickle(&file, &mut out, false)?;
            }
        }
    }
    Ok(out)
}

fn list_safetensors_under(directory: &Path, out: &mut String) -> Result<()> {
    let mut files = Vec::new();
    let mut pending = vec![directory.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "safetensors") {
                files.push(path);
            }
        }
    }
    files.sort();
    for path in files {
        let file = SafetensorsFile::open(&path)?;
        writeln!(out, "\n{}", path.display())?;
        for (name, info) in file.tensors() {
            writeln!(out, "  {name}  {}  {:?}", info.dtype, info.shape)?;
        }
    }
    Ok(())
}

fn describe_pickle(file: &TorchFile, out: &mut String, with_args: bool) -> Result<()> {
    if let Some(entries) = file.root.entries() {
        for (key, value) in entries {
            let key = key
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| key.describe());
            match value {
                Value::Dict(_) | Value::List(_) | Value::Tensor(_) => {}
                Value::Object { module, name, .. }
                    if module == "argparse" && name == "Namespace" =>
                {
                    if with_args {
                        let args = value.to_json();
                        writeln!(
                            out,
                            "  {key}: {}",
                            serde_json::to_string(&args).context("args")?
                        )?;
                    } else {
                        writeln!(out, "  {key}: argparse.Namespace")?;
                    }
                }
                other => writeln!(out, "  {key}: {}", other.describe())?,
            }
        }
    }
    for (name, tensor) in file.tensors() {
        writeln!(
            out,
            "  {name}  {}  {:?}",
            tensor.storage.dtype, tensor.shape
        )?;
    }
    Ok(())
}
