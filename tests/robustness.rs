//! Bad inputs a user may hand the tools, each answered by a clear error that names the file,
//! document or tensor, never a panic: token ids beyond the vocabulary, corrupted checkpoint
//! bytes, NaN weights, a run that diverges, a save that runs out of space, a lost tracker file,
//! two runs saving into one directory.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

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

/// The save directory's lock file (lib/store/src/lock.rs).
const LOCK_FILE: &str = ".megatron-rs-save.lock";
const TRACKER: &str = "latest_checkpointed_iteration.txt";

/// The iterations saved under `ckpt`, oldest first.
fn saved_iterations(ckpt: &Path) -> Vec<u64> {
    let mut iterations: Vec<u64> = std::fs::read_dir(ckpt)
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix("iter_")?.parse().ok())
        .collect();
    iterations.sort_unstable();
    iterations
}

/// Checks that an iteration directory holds exactly the files its metadata lists, each with
/// the recorded CRC-32C: a whole checkpoint, not one another writer cut short.
fn assert_whole_checkpoint(directory: &Path) {
    let metadata: serde_json::Value =
        serde_json::from_slice(&std::fs::read(directory.join("metadata.json")).unwrap()).unwrap();
    let recorded = metadata["checksums"].as_object().unwrap();
    let mut present = Vec::new();
    for rank in std::fs::read_dir(directory).unwrap().flatten() {
        if rank.path().is_dir() {
            for file in std::fs::read_dir(rank.path()).unwrap().flatten() {
                present.push(format!(
                    "{}/{}",
                    rank.file_name().to_string_lossy(),
                    file.file_name().to_string_lossy()
                ));
            }
        }
    }
    present.sort();
    let listed: Vec<&String> = recorded.keys().collect();
    assert_eq!(
        present.iter().collect::<Vec<_>>(),
        listed,
        "{}",
        directory.display()
    );
    assert!(listed.len() >= 3, "{}: {listed:?}", directory.display());
    for (relative, sum) in recorded {
        let bytes = std::fs::read(directory.join(relative)).unwrap();
        assert_eq!(
            sum.as_str().unwrap(),
            format!("crc32c:{:08x}", crc32c::crc32c(&bytes)),
            "{}/{relative}",
            directory.display()
        );
    }
}

/// A writer a test started, killed and reaped if the test ends before it does.
struct Writer(Child);

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits (bounded, generously) until `ready` holds, failing with `child`'s state if it exits.
fn wait_for(child: &mut Child, what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while !ready() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the writer exited ({status}) before {what}");
        }
        assert!(Instant::now() < deadline, "never saw {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the lock file under `ckpt` names `pid` as its holder.
fn lock_held_by(ckpt: &Path, pid: u32) -> bool {
    std::fs::read_to_string(ckpt.join(LOCK_FILE))
        .is_ok_and(|text| text.starts_with(&format!("pid {pid} on ")))
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill(2) on the pid of a child this test spawned and has not reaped.
    assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
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
        .filter(|name| name != LOCK_FILE)
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn a_lost_tracker_resumes_from_the_newest_whole_checkpoint_and_history_is_never_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ck = path_str(&ckpt);
    // The command line's schedule, so that a longer run may resume a shorter one.
    let schedule = [
        "--save-interval",
        "5",
        "--save",
        ck,
        "--override-opt_param-scheduler",
    ];
    run_ok(pretrain(&schedule).args(["--load", ck, "--train-iters", "20"]));
    assert_eq!(saved_iterations(&ckpt), [5, 10, 15, 20]);
    let first = ckpt.join("iter_0000005/mp_rank_00/model.safetensors");
    let first_bytes = std::fs::read(&first).unwrap();

    // The tracker is lost and the newest checkpoint damaged: the run goes back to the newest
    // whole one and says why.
    std::fs::remove_file(ckpt.join(TRACKER)).unwrap();
    let newest = ckpt.join("iter_0000020/mp_rank_00/model.safetensors");
    let mut damaged = std::fs::read(&newest).unwrap();
    let middle = damaged.len() / 2;
    damaged[middle] ^= 1;
    std::fs::write(&newest, &damaged).unwrap();
    let resumed = run_ok(pretrain(&schedule).args(["--load", ck, "--train-iters", "25"]));
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    let stderr = String::from_utf8_lossy(&resumed.stderr);
    assert!(
        stdout.contains(&format!(
            "successfully loaded checkpoint from {ck} [ t 1/1, p 1/1 ] at iteration 15"
        )),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "warning: {ck} has no {TRACKER}; loading {ck}/iter_0000015, its newest iteration \
             directory that is complete and whose files match their checksums (newer ones are \
             not: {ck}/iter_0000020: {ck}/iter_0000020/mp_rank_00/model.safetensors is corrupt"
        )),
        "{stderr}"
    );
    assert_eq!(saved_iterations(&ckpt), [5, 10, 15, 20, 25]);
    assert_eq!(std::fs::read_to_string(ckpt.join(TRACKER)).unwrap(), "25");
    assert_eq!(std::fs::read(&first).unwrap(), first_bytes);
    assert_whole_checkpoint(&ckpt.join("iter_0000020"));

    // A run that does not resume from them may not replace them.
    let fresh = pretrain(&["--save-interval", "5", "--save", ck, "--train-iters", "10"])
        .output()
        .unwrap();
    let stderr = error_of(&fresh);
    assert!(
        stderr.contains(&format!(
            "{ck} already holds 5 checkpoint(s) of another run, up to {ck}/iter_0000025, which \
             this run (starting at iteration 0, not resumed from that directory) would replace"
        )),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&first).unwrap(), first_bytes);
    assert_eq!(std::fs::read_to_string(ckpt.join(TRACKER)).unwrap(), "25");

    // Iteration directories of which none is whole are an error, never a fresh start.
    std::fs::remove_file(ckpt.join(TRACKER)).unwrap();
    for iteration in saved_iterations(&ckpt) {
        std::fs::remove_file(ckpt.join(format!("iter_{iteration:07}/metadata.json"))).unwrap();
    }
    let out = pretrain(&["--load", ck, "--train-iters", "30"])
        .output()
        .unwrap();
    let stderr = error_of(&out);
    assert!(
        stderr.contains(&format!(
            "{ck} has no {TRACKER} and none of its iteration directories is a complete \
             checkpoint: {ck}/iter_0000025: reading {ck}/iter_0000025/metadata.json"
        )),
        "{stderr}"
    );
}

#[test]
fn a_second_writer_into_one_save_directory_is_refused_and_the_first_saves_whole_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ck = path_str(&ckpt);
    let log = std::fs::File::create(dir.path().join("first.log")).unwrap();
    let mut first = Writer(
        pretrain(&["--save", ck, "--save-interval", "2"])
            .args(["--train-iters", "1000000"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let pid = first.0.id();
    wait_for(
        &mut first.0,
        "the first writer's lock and checkpoint",
        || lock_held_by(&ckpt, pid) && ckpt.join(TRACKER).exists(),
    );
    // Frozen, it holds the lock for as long as the second writer tries.
    signal(&first.0, libc::SIGSTOP);
    let second = pretrain(&["--save", ck, "--save-interval", "1", "--train-iters", "4"])
        .output()
        .unwrap();
    signal(&first.0, libc::SIGCONT);
    signal(&first.0, libc::SIGTERM);
    let status = first.0.wait().unwrap();
    let first_log = std::fs::read_to_string(dir.path().join("first.log")).unwrap();
    assert!(status.success(), "{status}: {first_log}");

    let stderr = error_of(&second);
    assert!(
        stderr.contains(&format!(
            "error: {ck} is in use by another run saving checkpoints there (pid {pid} on "
        )) && stderr.contains(&format!(
            "give each run its own save directory (the lock is {ck}/{LOCK_FILE})"
        )),
        "{stderr}"
    );
    let saved = saved_iterations(&ckpt);
    assert!(!saved.is_empty());
    for iteration in &saved {
        assert_whole_checkpoint(&ckpt.join(format!("iter_{iteration:07}")));
    }
    let tracked: u64 = std::fs::read_to_string(ckpt.join(TRACKER))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(Some(&tracked), saved.last());
}

#[test]
fn a_killed_writer_releases_its_directory_and_its_staging_folder_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let ck = path_str(&ckpt);
    let flags = [
        "--save",
        ck,
        "--load",
        ck,
        "--save-interval",
        "1",
        "--override-opt_param-scheduler",
    ];
    let mut killed = Writer(
        pretrain(&flags)
            .args(["--train-iters", "1000000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let pid = killed.0.id();
    wait_for(&mut killed.0, "the writer's lock and checkpoint", || {
        lock_held_by(&ckpt, pid) && ckpt.join(TRACKER).exists()
    });
    signal(&killed.0, libc::SIGKILL);
    killed.0.wait().unwrap();
    let tracked: u64 = std::fs::read_to_string(ckpt.join(TRACKER))
        .unwrap()
        .parse()
        .unwrap();
    // What a save cut short leaves, whether or not the kill caught one.
    let next = tracked + 2;
    let staging = ckpt.join(format!(".iter_{:07}.tmp", next + 1));
    std::fs::create_dir_all(staging.join("mp_rank_00")).unwrap();
    std::fs::write(staging.join("mp_rank_00/model.safetensors"), b"cut short").unwrap();

    let out = run_ok(pretrain(&flags).args(["--train-iters", &next.to_string()]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("at iteration {tracked}")),
        "{stdout}"
    );
    assert!(!staging.exists());
    assert_whole_checkpoint(&ckpt.join(format!("iter_{next:07}")));
}

#[test]
fn a_checkpoint_without_checksums_loads_with_one_warning_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    run_ok(&mut pretrain(&["--save", path_str(&ckpt)]));
    let metadata_path = ckpt.join("iter_0000002/metadata.json");
    let mut metadata: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&metadata_path).unwrap()).unwrap();
    metadata
        .as_object_mut()
        .unwrap()
        .remove("checksums")
        .unwrap();
    std::fs::write(&metadata_path, metadata.to_string()).unwrap();
    let warning = format!(
        "warning: {}/iter_0000002 records no checksums in its metadata.json; its files are \
         loaded unchecked",
        path_str(&ckpt)
    );
    let out = generate(&ckpt, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches(&warning).count(), 1, "{stderr}");
    // Asked not to check (--no-checkpoint-checksums), it says nothing.
    let out = generate(&ckpt, &["--no-checkpoint-checksums"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("records no checksums"),
        "{stderr}"
    );
}

/// `--async-save`'s test hook (docs/checkpoints.md): the background writer of each save, its
/// files written and nothing committed, creates `held_<iteration>_rank0` in the directory and
/// waits for `release_<iteration>`.
const HOLD_ASYNC_SAVE: &str = "MEGATRON_RS_TEST_HOLD_ASYNC_SAVE";

fn release(hold: &Path, iteration: u64) {
    std::fs::write(hold.join(format!("release_{iteration}")), b"").unwrap();
}

fn held(hold: &Path, iteration: u64) -> bool {
    hold.join(format!("held_{iteration}_rank0")).exists()
}

fn tracked_iteration(ckpt: &Path) -> String {
    std::fs::read_to_string(ckpt.join(TRACKER)).unwrap()
}

/// A run killed while its background writer is in the middle of a save (the files of
/// iteration 2 in the staging folder, nothing committed) leaves the tracker on iteration 1,
/// whole; a resume from it continues with the same losses as a run never interrupted.
#[test]
fn a_run_killed_during_an_async_save_resumes_from_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, hold) = (dir.path().join("ckpt"), dir.path().join("hold"));
    std::fs::create_dir(&hold).unwrap();
    let ck = path_str(&ckpt);
    let straight = dir.path().join("straight.jsonl");
    run_ok(&mut pretrain(&[
        "--train-iters",
        "4",
        "--metrics-file",
        path_str(&straight),
    ]));

    let async_flags = ["--save", ck, "--save-interval", "1", "--async-save"];
    release(&hold, 1);
    let mut killed = Writer(
        pretrain(&async_flags)
            .args(["--train-iters", "4"])
            .env(HOLD_ASYNC_SAVE, &hold)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(
        &mut killed.0,
        "the writer held in the save of iteration 2",
        || held(&hold, 2),
    );
    signal(&killed.0, libc::SIGKILL);
    killed.0.wait().unwrap();
    assert_eq!(tracked_iteration(&ckpt), "1");
    assert!(ckpt
        .join(".iter_0000002.tmp/mp_rank_00/model.safetensors")
        .is_file());
    assert_eq!(saved_iterations(&ckpt), [1]);
    assert_whole_checkpoint(&ckpt.join("iter_0000001"));

    let resumed = dir.path().join("resumed.jsonl");
    let out = run_ok(
        pretrain(&async_flags)
            .args(["--load", ck, "--train-iters", "4"])
            .args(["--metrics-file", path_str(&resumed)]),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "successfully loaded checkpoint from {ck} [ t 1/1, p 1/1 ] at iteration 1"
        )),
        "{stdout}"
    );
    assert_eq!(
        megatron_e2e::metrics_losses(&resumed),
        megatron_e2e::metrics_losses(&straight)[1..]
    );
    assert_eq!(tracked_iteration(&ckpt), "4");
    assert_eq!(saved_iterations(&ckpt), [1, 2, 3, 4]);
    for iteration in 1..=4 {
        assert_whole_checkpoint(&ckpt.join(format!("iter_{iteration:07}")));
    }
    assert!(!ckpt.join(".iter_0000002.tmp").exists());
}

/// A run that ends (its last iteration, or --exit-interval) while its last save is still
/// being written finishes that save before it exits: the process waits for the held writer,
/// and once it is let go the tracker names the last iteration, whole.
#[test]
fn a_run_ending_with_an_async_save_in_flight_finishes_it() {
    let endings: [(&str, &[&str]); 2] = [
        ("the last iteration", &["--train-iters", "2"]),
        (
            "exit-interval",
            &["--train-iters", "1000", "--exit-interval", "2"],
        ),
    ];
    for (ending, schedule) in endings {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, hold) = (dir.path().join("ckpt"), dir.path().join("hold"));
        std::fs::create_dir(&hold).unwrap();
        let ck = path_str(&ckpt);
        release(&hold, 1);
        let log = dir.path().join("stderr.log");
        let mut run = Writer(
            pretrain(&["--save", ck, "--save-interval", "1", "--async-save"])
                .args(schedule)
                .env(HOLD_ASYNC_SAVE, &hold)
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .unwrap(),
        );
        wait_for(
            &mut run.0,
            "the writer held in the save of iteration 2",
            || held(&hold, 2),
        );
        assert!(
            run.0.try_wait().unwrap().is_none(),
            "{ending}: the run exited with its last save in flight"
        );
        assert_eq!(tracked_iteration(&ckpt), "1", "{ending}");
        release(&hold, 2);
        let mut stdout = String::new();
        std::io::Read::read_to_string(&mut run.0.stdout.take().unwrap(), &mut stdout).unwrap();
        let status = run.0.wait().unwrap();
        assert!(
            status.success(),
            "{ending}: {status}: {stdout}{}",
            std::fs::read_to_string(&log).unwrap()
        );
        let finished = stdout
            .find("Unfinalized async checkpoint saves. Finalizing them synchronously now.")
            .unwrap_or_else(|| panic!("{ending}: {stdout}"));
        let saved = stdout
            .find(&format!(
                "  successfully saved checkpoint from iteration       2 to {ck} ["
            ))
            .unwrap_or_else(|| panic!("{ending}: {stdout}"));
        assert!(finished < saved, "{ending}: {stdout}");
        assert_eq!(tracked_iteration(&ckpt), "2", "{ending}");
        assert_whole_checkpoint(&ckpt.join("iter_0000002"));
    }
}
