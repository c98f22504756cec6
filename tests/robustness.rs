//! Bad inputs a user may hand the tools, each answered by a clear error that names the file,
//! document or tensor, never a panic: token ids beyond the vocabulary, corrupted checkpoint
//! bytes, NaN weights, a run that diverges, a save that runs out of space.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use megatron_e2e::{bin, quickstart_tokenizer_flags, run_ok, shared_dir};

/// A tiny GPT on mock data with the bundled tokenizer; `extra` adds or overrides flags.
fn pretrain(extra: &[&str]) -> Command {
    let mut command = pretrain_without_data(extra);
    command.arg("--mock-data");
    command
}

fn pretrain_without_data(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args(["--num-layers", "2", "--hidden-size", "32"])
        .args(["--num-attention-heads", "4", "--seq-length", "32"])
        .args(["--max-position-embeddings", "32", "--micro-batch-size", "2"])
        .args(["--global-batch-size", "2", "--lr", "1e-3"])
        .args(["--eval-iters", "0", "--device", "cpu", "--train-iters", "2"])
        .args(quickstart_tokenizer_flags())
        .args(extra);
    command
}

fn generate(checkpoint: &Path, extra: &[&str]) -> Output {
    bin("generate_samples_gpt")
        .arg("--load")
        .arg(checkpoint)
        .args(quickstart_tokenizer_flags())
        .args([
            "--prompt",
            "The data",
            "--out-seq-length",
            "4",
            "--device",
            "cpu",
        ])
        .args(extra)
        .output()
        .unwrap()
}

/// A runtime error: exit code 1 and one `error:` line, never a panic or a Debug dump.
fn error_of(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("Os {") && !stderr.contains("Error("),
        "{stderr}"
    );
    stderr
}

fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn ids_beyond_the_vocabulary_are_refused_naming_the_file_and_document() {
    // Megatron's GPT-2 golden dataset holds ids up to 50256; the bundled tokenizer has 4096.
    let prefix = shared_dir().join("golden/preprocess/gpt2/small_gpt2_text_document");
    let cache = tempfile::tempdir().unwrap();
    let out = pretrain_without_data(&["--split", "98,2,0"])
        .args(["--data-cache-path", path_str(cache.path())])
        .args(["--data-path", path_str(&prefix)])
        .output()
        .unwrap();
    let stderr = error_of(&out);
    assert!(
        stderr.contains("small_gpt2_text_document.bin: token id ")
            && stderr.contains(" in document ")
            && stderr.contains("vocabulary of 4096"),
        "{stderr}"
    );
    let info = run_ok(bin("inspect_dataset").arg("info").arg(&prefix));
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains(", largest 50256"), "{info}");
}

/// `(data offset, byte length)` of tensor `name` in a safetensors file.
fn tensor_bytes(file: &Path, name: &str) -> (usize, usize) {
    let bytes = std::fs::read(file).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let offsets = &header[name]["data_offsets"];
    let (start, end) = (
        offsets[0].as_u64().unwrap() as usize,
        offsets[1].as_u64().unwrap() as usize,
    );
    (8 + header_len + start, end - start)
}

#[test]
fn corrupted_bytes_and_nan_weights_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    run_ok(&mut pretrain(&["--save", path_str(&ckpt)]));
    let metadata: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("iter_0000002/metadata.json")).unwrap())
            .unwrap();
    assert!(
        metadata["checksums"]["mp_rank_00/model.safetensors"]
            .as_str()
            .unwrap()
            .starts_with("crc32c:"),
        "{metadata}"
    );
    let model = ckpt.join("iter_0000002/mp_rank_00/model.safetensors");
    let pristine = std::fs::read(&model).unwrap();

    // One flipped bit in the lowest mantissa byte of a weight: still a finite number, so only
    // the checksum can tell.
    let name = "decoder.layers.0.mlp.linear_fc1.weight";
    let (start, length) = tensor_bytes(&model, name);
    let mut flipped = pristine.clone();
    flipped[start + length / 2 / 4 * 4] ^= 1;
    std::fs::write(&model, &flipped).unwrap();
    let corrupt = "mp_rank_00/model.safetensors is corrupt";
    let resumed = pretrain(&["--load", path_str(&ckpt), "--train-iters", "3"])
        .output()
        .unwrap();
    let stderr = error_of(&resumed);
    assert!(stderr.contains(corrupt), "{stderr}");
    let stderr = error_of(&generate(&ckpt, &[]));
    assert!(stderr.contains(corrupt), "{stderr}");
    run_ok(
        bin("generate_samples_gpt")
            .arg("--load")
            .arg(&ckpt)
            .args(quickstart_tokenizer_flags())
            .args(["--prompt", "x", "--out-seq-length", "2", "--device", "cpu"])
            .arg("--no-checkpoint-checksums"),
    );
    // checkpoint_convert reads our checkpoints too, and takes the flag its message names.
    let convert = |extra: &[&str], output: &str| {
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "megatron-rs"])
            .args(["--load-dir", path_str(&ckpt)])
            .arg("--save-dir")
            .arg(dir.path().join(output))
            .args(extra)
            .output()
            .unwrap()
    };
    let stderr = error_of(&convert(&[], "refused"));
    assert!(
        stderr.contains(corrupt) && stderr.contains("(--no-checkpoint-checksums loads it anyway)"),
        "{stderr}"
    );
    let converted = convert(&["--no-checkpoint-checksums"], "converted");
    let stderr = String::from_utf8_lossy(&converted.stderr);
    assert!(converted.status.success(), "{stderr}");
    assert!(dir
        .path()
        .join("converted/latest_checkpointed_iteration.txt")
        .is_file());

    // NaN weights (checksums off, as for a checkpoint saved without them): the tensor is named.
    let mut poisoned = pristine;
    poisoned[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&model, &poisoned).unwrap();
    let stderr = error_of(&generate(&ckpt, &["--no-checkpoint-checksums"]));
    assert!(
        stderr.contains(&format!("tensor {name} holds 1 NaN or infinite values")),
        "{stderr}"
    );
}

#[test]
fn a_diverging_run_names_the_last_checkpoint_saved_before_the_loss_spiked() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let out = pretrain(&["--lr", "1e6", "--save-interval", "1", "--train-iters", "50"])
        .args(["--save", path_str(&ckpt)])
        .output()
        .unwrap();
    let stderr = error_of(&out);
    let stopped_at: u64 = stderr
        .split(" at iteration ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no iteration in {stderr}"));
    let spike: u64 = stderr
        .split("left its recent range at iteration ")
        .nth(1)
        .or_else(|| {
            stderr
                .split("the loss was ")
                .nth(1)
                .and_then(|r| r.split(" at iteration ").nth(1))
        })
        .and_then(|rest| rest.split([' ', ';']).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no spike named in {stderr}"));
    assert!(spike <= stopped_at, "{stderr}");
    // Checkpoint k holds the weights the loss of iteration k + 1 measured: only those before
    // the spike's weights can be trusted.
    match stderr
        .split("the last checkpoint saved before that is ")
        .nth(1)
    {
        Some(rest) => {
            let named = PathBuf::from(rest.split(", resume").next().unwrap());
            let iteration: u64 = named
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .trim_start_matches("iter_")
                .parse()
                .unwrap();
            assert!(iteration + 1 < spike, "{stderr}");
        }
        None => assert!(
            stderr.contains("no checkpoint was saved before that") && spike <= 2,
            "{stderr}"
        ),
    }
}

#[test]
fn a_save_that_runs_out_of_space_says_why_and_leaves_no_staging_directory() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let mut command = pretrain(&["--save", path_str(&ckpt)]);
    // SAFETY: only async-signal-safe calls between fork and exec. Files larger than 64 KiB
    // cannot be written (EFBIG instead of SIGXFSZ, which is ignored), like a full disk.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let limit = libc::rlimit {
                rlim_cur: 64 << 10,
                rlim_max: 64 << 10,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let stderr = error_of(&command.output().unwrap());
    assert!(
        stderr.contains("model.safetensors: File too large (os error 27)"),
        "{stderr}"
    );
    assert_eq!(stderr.matches("File too large").count(), 1, "{stderr}");
    let left: Vec<String> = std::fs::read_dir(&ckpt)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
