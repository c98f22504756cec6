//! Helpers for end-to-end tests: locate the workspace's built binaries and the shared
//! reference material, and run binaries the way a user would.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, PoisonError};

mod megatron_logs;
mod ranks;
pub use megatron_logs::{
    distances, megatron_log, metrics_steps, resume_pretrain_gpt, Distance, Logged, Step,
};
pub use ranks::{run_job, spawn_rank, wait_for_ranks, RANK_DEADLINE};

/// The workspace root (the directory holding the top-level Cargo.toml).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives inside the workspace")
        .to_path_buf()
}

/// `../shared` beside the checkout: vocabularies, corpora and Megatron goldens, read in place.
pub fn shared_dir() -> PathBuf {
    let dir = std::env::var_os("MEGATRON_RS_SHARED")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared"));
    assert!(
        dir.is_dir(),
        "reference material not found at {} (set MEGATRON_RS_SHARED)",
        dir.display()
    );
    dir
}

/// Path of a workspace binary built in the same profile as the running test.
/// `scripts/test.sh` builds every binary before the tests run.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test-exe> -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable sits in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.is_file(),
        "binary {} not built; run `cargo build --workspace --bins` (scripts/test.sh does)",
        path.display()
    );
    path
}

/// GPUs `nvidia-smi -L` lists (0 without a driver): GPU tests skip below what they need.
pub fn visible_gpus() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map_or(0, |out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU "))
                .count()
        })
}

/// A command for a workspace binary.
pub fn bin(name: &str) -> Command {
    Command::new(bin_path(name))
}

/// Runs a command and returns its output, failing the test with stderr if it did not succeed.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("failed to start {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `$MEGATRON_RS_TEST_PYTHON`, else the project's `.venv`; the test fails with the way to set
/// it up when it cannot import `modules` (scripts/test-requirements.txt lists them).
pub fn test_python(modules: &[&str]) -> PathBuf {
    // Importing torch takes seconds: each module list is checked once per test process.
    static CHECKED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    let wanted = modules.join(", ");
    if CHECKED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .contains(&wanted)
    {
        return python;
    }
    let imports = Command::new(&python)
        .args(["-c", &format!("import {wanted}")])
        .output()
        .is_ok_and(|out| out.status.success());
    assert!(
        imports,
        "{} cannot import {wanted}: run scripts/test.sh, which installs scripts/test-requirements.txt \
         into .venv (or point MEGATRON_RS_TEST_PYTHON at a python that has them)",
        python.display(),
    );
    CHECKED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(wanted);
    python
}

/// A TCP port on loopback for MASTER_PORT or a rendezvous endpoint, free together with the port
/// after it (torchrun's store and ours). Ports come from below Linux's ephemeral range
/// (32768–60999), which the kernel hands to port-0 binds and outgoing connections: a port
/// released there may be given to another test's gloo socket before the job binds it. Each
/// process walks its own sequence (seeded by its id), never offers a port twice, and holds a lock
/// on each port it offers until it exits, so test binaries running side by side never share one.
pub fn free_port() -> String {
    const FIRST: u32 = 12_000;
    const PAIRS: u32 = 10_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let seed = std::process::id().wrapping_mul(2_654_435_761) % PAIRS;
    loop {
        let pair = (seed + NEXT.fetch_add(1, Ordering::Relaxed) * 7_919) % PAIRS;
        let port = (FIRST + 2 * pair) as u16;
        let both_free = std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("0.0.0.0", port + 1)).is_ok();
        if both_free && reserve_port(port) {
            return port.to_string();
        }
    }
}

/// Takes `port` for this process: an exclusive lock on a file named after it, which the kernel
/// releases when the process exits; false where another process holds it.
fn reserve_port(port: u16) -> bool {
    static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());
    let directory = std::env::temp_dir().join("megatron-rs-test-ports");
    std::fs::create_dir_all(&directory).unwrap();
    let file = File::create(directory.join(port.to_string())).unwrap();
    // SAFETY: flock(2) on a descriptor this function owns.
    let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
    if locked {
        HELD.lock().unwrap().push(file);
    }
    locked
}

/// A 2-layer GPT of width 64 on mock data (NullTokenizer, 1000 ids), sequence 32, micro-batch 2
/// of a global batch of 8, lr 1e-3, no dropout, a log line per iteration and no evaluation: the
/// model the parallel-equivalence tests train.
pub const TINY_MOCK_GPT: &[&str] = &[
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
];

/// `lm loss` of every training iteration in a `--metrics-file`, as exact JSON text (the
/// evaluation records, which carry a `split`, are left out).
pub fn metrics_losses(metrics: &std::path::Path) -> Vec<(u64, String)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            if record.get("split").is_some() {
                return None;
            }
            Some((
                record["iteration"].as_u64().unwrap(),
                record.get("lm loss")?.to_string(),
            ))
        })
        .collect()
}

/// The flags of the bundled quickstart tokenizer (a GPT-2 BPE of 4096 tokens in `data/`).
pub fn quickstart_tokenizer_flags() -> Vec<String> {
    let data = workspace_root().join("data");
    vec![
        "--tokenizer-type".into(),
        "GPT2BPETokenizer".into(),
        "--vocab-file".into(),
        data.join("quickstart-vocab.json").display().to_string(),
        "--merge-file".into(),
        data.join("quickstart-merges.txt").display().to_string(),
    ]
}

/// A GPT trained by `pretrain_gpt` for two steps on mock data on the CPU, saved to `dir`, with
/// the `architecture` and `tokenizer` flags (for the inference tools to load).
pub fn mock_gpt_checkpoint(dir: &Path, architecture: &[&str], tokenizer: &[String]) {
    run_ok(
        bin("pretrain_gpt")
            .args(architecture)
            .args(["--micro-batch-size", "2", "--global-batch-size", "2"])
            .args(["--train-iters", "2", "--lr", "1e-3", "--mock-data"])
            .args(["--eval-iters", "0", "--device", "cpu", "--save"])
            .arg(dir)
            .args(tokenizer),
    );
}
