//! `checkpoint_convert` holds about one tensor at a time: its peak resident memory (the
//! child's `ru_maxrss`) converting a checkpoint of over a gigabyte (weights and Adam state) is
//! within a small margin of converting a tiny one, for a TP1 → TP2 reshape with the optimizer,
//! Megatron's torch format out and back in (optimizer included), a HuggingFace export and its
//! import back.

use std::path::Path;
use std::process::Command;

use megatron_e2e::{bin, run_ok};

/// A one-iteration float32 run of `layers × hidden` saved under `save`, with its optimizer.
fn make_checkpoint(save: &Path, layers: usize, hidden: usize) {
    run_ok(
        bin("pretrain_gpt")
            .args(["--num-layers", &layers.to_string()])
            .args(["--hidden-size", &hidden.to_string()])
            .args(["--num-attention-heads", "8"])
            .args(["--seq-length", "16", "--max-position-embeddings", "16"])
            .args(["--micro-batch-size", "1", "--global-batch-size", "1"])
            .args(["--lr", "1e-4", "--train-iters", "1", "--mock-data"])
            .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])
            .args([
                "--eval-iters",
                "0",
                "--log-interval",
                "1",
                "--device",
                "cpu",
            ])
            .arg("--save")
            .arg(save)
            .args(["--save-interval", "1"]),
    );
}

/// Runs `command` to success; its peak resident set in bytes.
fn peak_rss(command: &mut Command) -> u64 {
    let child = command
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut status = 0;
    // SAFETY: plain libc call on our own child's pid, with valid out-pointers.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        let pid = libc::wait4(child.id() as i32, &mut status, 0, &mut usage);
        assert_eq!(pid, child.id() as i32, "wait4");
        usage
    };
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{command:?} failed"
    );
    // Linux reports ru_maxrss in KiB.
    usage.ru_maxrss as u64 * 1024
}

fn directory_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| {
            let path = e.path();
            if path.is_dir() {
                directory_bytes(&path)
            } else {
                e.metadata().unwrap().len()
            }
        })
        .sum()
}

/// Peak RSS of a TP1 → TP2 reshape (optimizer included), of Megatron's torch format written
/// and read back at TP2, of a HuggingFace export of the checkpoint under `input` and of that
/// export's import at TP2.
fn conversions(input: &Path, scratch: &Path) -> [u64; 5] {
    let convert = |loader: &str, saver: &str, save: &str, extra: &[&str]| {
        let mut command = bin("checkpoint_convert");
        let load = match loader {
            "hf" => scratch.join("hf"),
            "core" => scratch.join("megatron"),
            _ => input.to_path_buf(),
        };
        command
            .args(["--model-type", "GPT", "--loader", loader, "--saver", saver])
            .arg("--load-dir")
            .arg(load)
            .arg("--save-dir")
            .arg(scratch.join(save))
            .args(extra);
        let peak = peak_rss(&mut command);
        assert!(scratch.join(save).is_dir());
        peak
    };
    let tp2 = ["--target-tensor-parallel-size", "2"];
    [
        convert("megatron-rs", "megatron-rs", "tp2", &tp2),
        convert("megatron-rs", "core", "megatron", &[]),
        convert("core", "megatron-rs", "from_megatron", &tp2),
        convert("megatron-rs", "hf", "hf", &["--no-optimizer"]),
        convert("hf", "megatron-rs", "imported", &tp2),
    ]
}

#[test]
fn peak_memory_does_not_grow_with_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let (tiny, large) = (dir.path().join("tiny"), dir.path().join("large"));
    make_checkpoint(&tiny.join("ckpt"), 1, 64);
    // 24 layers of hidden 512: 76M parameters, 1.2 GB with the float32 Adam state.
    make_checkpoint(&large.join("ckpt"), 24, 512);
    let input = directory_bytes(&large.join("ckpt"));
    assert!(
        input > 1_000_000_000,
        "the large checkpoint holds {input} bytes"
    );
    let small = conversions(&tiny.join("ckpt"), &tiny);
    let big = conversions(&large.join("ckpt"), &large);
    let mib = |b: u64| b / (1 << 20);
    // A conversion that held the model would grow by at least the input's size; one tensor
    // at a time grows by a few of the largest tensors (4 MiB here) and the writer's buffer.
    let margin = 128 << 20;
    let names = [
        "TP1 → TP2 reshape",
        "Megatron torch export",
        "Megatron torch import at TP2",
        "HuggingFace export",
        "HuggingFace import at TP2",
    ];
    for (what, (tiny, large)) in names.into_iter().zip(small.into_iter().zip(big)) {
        eprintln!(
            "{what}: peak RSS {} MiB from a checkpoint of {} MiB, {} MiB for a tiny model",
            mib(large),
            mib(input),
            mib(tiny)
        );
        assert!(
            large < tiny + margin && large < 1 << 30,
            "{what}: peak RSS {} MiB from a checkpoint of {} MiB, {} MiB for a tiny model",
            mib(large),
            mib(input),
            mib(tiny)
        );
    }
}
