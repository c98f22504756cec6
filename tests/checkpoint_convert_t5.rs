//! `checkpoint_convert --model-type T5`: a T5 trained by `pretrain_t5` on two tensor-parallel
//! processes goes TP2 → TP1 → TP2 and comes back bitwise (weights and optimizer buffers); the
//! reshaped model's logits equal the original's (`--verify`), and training resumed from the
//! TP1 reshape equals training resumed from the TP2 original; vocabulary padding is cut and
//! padded with the tensor-parallel size; pipeline stages, HuggingFace export and Megatron
//! loaders are refused by name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use megatron_e2e::{bin, run_job, run_ok};

/// A 2+1-layer T5 on mock span corruption over `vocabulary` tokens.
fn pretrain(vocabulary: &str, extra: &[&str]) -> Command {
    let mut command = bin("pretrain_t5");
    command
        .args(["--encoder-num-layers", "2", "--decoder-num-layers", "1"])
        .args(["--hidden-size", "32", "--num-attention-heads", "4"])
        .args(["--encoder-seq-length", "32", "--decoder-seq-length", "16"])
        .args(["--max-position-embeddings", "32"])
        .args(["--micro-batch-size", "2", "--global-batch-size", "4"])
        .args(["--lr", "1e-3", "--adam-eps", "1e-4", "--log-interval", "1"])
        .args(["--hidden-dropout", "0", "--attention-dropout", "0"])
        .args(["--eval-iters", "0", "--device", "cpu"])
        .args(["--mock-data", "--tokenizer-type", "NullTokenizer"])
        .args(["--vocab-size", vocabulary])
        .args(extra);
    command
}

/// Runs `command` as two processes of a torchrun-style launch; returns the last rank's output.
fn two_processes(command: impl Fn() -> Command) -> Output {
    run_job(2, "", |_| command()).pop().unwrap()
}

fn convert(from: &Path, to: &Path, extra: &[&str]) -> Output {
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "T5", "--loader", "megatron-rs"])
            .args(["--saver", "megatron-rs", "--verify"])
            .arg("--load-dir")
            .arg(from)
            .arg("--save-dir")
            .arg(to)
            .args(extra),
    )
}

/// Every tensor of a safetensors file: name → (dtype, shape, bytes).
fn tensors(path: &Path) -> BTreeMap<String, (String, Vec<u64>, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let data = &bytes[8 + header..];
    json.as_object()
        .unwrap()
        .iter()
        .filter(|(name, _)| *name != "__metadata__")
        .map(|(name, entry)| {
            let offsets: Vec<usize> = entry["data_offsets"]
                .as_array()
                .unwrap()
                .iter()
                .map(|o| o.as_u64().unwrap() as usize)
                .collect();
            let shape = entry["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            (
                name.clone(),
                (
                    entry["dtype"].as_str().unwrap().to_string(),
                    shape,
                    data[offsets[0]..offsets[1]].to_vec(),
                ),
            )
        })
        .collect()
}

fn verified_difference(out: &Output) -> f64 {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.starts_with("verify: max |Δ logits| = "))
        .unwrap_or_else(|| panic!("no verify line in {stdout}"));
    line["verify: max |Δ logits| = ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// `lm loss` of iteration `iteration` in a training log.
fn loss_at(stdout: &str, iteration: u32) -> f64 {
    let marker = format!("iteration {iteration:>8}/");
    let line = stdout
        .lines()
        .find(|l| l.contains(&marker))
        .unwrap_or_else(|| panic!("no iteration {iteration} in {stdout}"));
    let rest = &line[line.find(" lm loss: ").unwrap() + " lm loss: ".len()..];
    rest[..rest.find(' ').unwrap()].parse().unwrap()
}

fn iteration_dir(root: &Path) -> PathBuf {
    root.join("iter_0000002")
}

/// A T5 trained for 2 steps by two tensor-parallel processes, saved under `dir/tp2`.
fn trained_on_two_ranks(dir: &Path, vocabulary: &str) -> PathBuf {
    trained_on_two_ranks_with(dir, vocabulary, &[])
}

fn trained_on_two_ranks_with(dir: &Path, vocabulary: &str, extra: &[&str]) -> PathBuf {
    let original = dir.join("tp2");
    two_processes(|| {
        let mut command = pretrain(
            vocabulary,
            &["--train-iters", "2", "--tensor-model-parallel-size", "2"],
        );
        command.args(extra);
        command.arg("--save").arg(&original);
        command
    });
    original
}

/// Asserts that the files of `ranks` in both checkpoints hold the same tensors, bitwise (of
/// optimizer files, the Adam state our reshapes write).
fn same_files(first: &Path, second: &Path, ranks: &[&str]) {
    for rank in ranks {
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let path = Path::new(rank).join(file);
            let mut want = tensors(&iteration_dir(first).join(&path));
            want.retain(|name, _| {
                file == "model.safetensors"
                    || ["main", "exp_avg", "exp_avg_sq", "step"].contains(&name.as_str())
            });
            assert!(want.len() >= 4, "{}: {want:?}", path.display());
            let got = tensors(&iteration_dir(second).join(&path));
            assert_eq!(
                want.keys().collect::<Vec<_>>(),
                got.keys().collect::<Vec<_>>()
            );
            for (name, tensor) in &want {
                assert!(
                    tensor == &got[name],
                    "{} and {}: {} {name} differs",
                    first.display(),
                    second.display(),
                    path.display()
                );
            }
        }
    }
}

#[test]
fn tp2_to_tp1_to_tp2_is_bitwise_and_resumes_alike() {
    // 255 tokens pad to 256 rows for one rank and for two: nothing of the run is padding.
    let dir = tempfile::tempdir().unwrap();
    let original = trained_on_two_ranks(dir.path(), "255");
    let single = dir.path().join("tp1");
    let out = convert(&original, &single, &["--target-tensor-parallel-size", "1"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("with optimizer state"), "{stdout}");
    assert_eq!(verified_difference(&out), 0.0);
    let metadata: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(iteration_dir(&single).join("metadata.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(metadata["model_type"], "T5");
    assert_eq!(metadata["tensor_model_parallel_size"], 1);
    assert_eq!(metadata["consumed_train_samples"], 8);

    let back = dir.path().join("tp2-again");
    let out = convert(&single, &back, &["--target-tensor-parallel-size", "2"]);
    assert_eq!(verified_difference(&out), 0.0);
    same_files(&original, &back, &["mp_rank_00", "mp_rank_01"]);

    // Two more steps from the TP1 reshape equal two more from the TP2 original.
    let resume = |extra: &[&str], from: &Path| {
        let mut command = pretrain("255", &["--train-iters", "4"]);
        command
            .args(extra)
            .arg("--use-checkpoint-opt_param-scheduler")
            .arg("--load")
            .arg(from);
        command
    };
    let two = two_processes(|| resume(&["--tensor-model-parallel-size", "2"], &original));
    let one = run_ok(&mut resume(&[], &single));
    let (two, one) = (
        String::from_utf8_lossy(&two.stdout),
        String::from_utf8_lossy(&one.stdout),
    );
    for iteration in [3, 4] {
        let (a, b) = (loss_at(&two, iteration), loss_at(&one, iteration));
        eprintln!("iteration {iteration}: lm loss {a} (TP2 original) vs {b} (TP1 reshape)");
        assert!(
            (a - b).abs() < 1e-5 * a,
            "iteration {iteration}: {a} vs {b}"
        );
    }
}

#[test]
fn vocabulary_padding_is_cut_and_padded() {
    // 300 tokens pad to 384 rows for one rank and to 512 for two.
    let dir = tempfile::tempdir().unwrap();
    let original = trained_on_two_ranks(dir.path(), "300");
    let single = dir.path().join("tp1");
    assert_eq!(
        verified_difference(&convert(
            &original,
            &single,
            &["--target-tensor-parallel-size", "1"]
        )),
        0.0
    );
    let bias = &tensors(&iteration_dir(&single).join("mp_rank_00/model.safetensors"))
        ["lm_head.output_layer.bias"];
    assert_eq!(bias.1, [384]);
    let back = dir.path().join("tp2-again");
    convert(&single, &back, &["--target-tensor-parallel-size", "2"]);
    // Rows past one rank's padding (384..512, never a token) come back as zeros, like every
    // reshape's new padding; the rest bitwise.
    for rank in ["mp_rank_00", "mp_rank_01"] {
        let file = Path::new(rank).join("model.safetensors");
        let want = tensors(&iteration_dir(&original).join(&file));
        let got = tensors(&iteration_dir(&back).join(&file));
        for (name, (dtype, shape, bytes)) in &want {
            let other = &got[name];
            assert_eq!((dtype, shape), (&other.0, &other.1), "{name}");
            // Rank 1 holds vocabulary rows 256..512, of which 256..384 are kept.
            let kept = match name.as_str() {
                "embedding.word_embeddings.weight" | "lm_head.output_layer.bias"
                    if rank == "mp_rank_01" =>
                {
                    bytes.len() / 2
                }
                _ => bytes.len(),
            };
            assert!(bytes[..kept] == other.2[..kept], "{rank}: {name} differs");
            assert!(
                other.2[kept..].iter().all(|&b| b == 0),
                "{rank}: {name} padding"
            );
        }
    }
    // From there on the round trip is bitwise, optimizer buffers included.
    let single_again = dir.path().join("tp1-again");
    convert(
        &back,
        &single_again,
        &["--target-tensor-parallel-size", "1"],
    );
    same_files(&single, &single_again, &["mp_rank_00"]);
    let back_again = dir.path().join("tp2-third");
    convert(
        &single_again,
        &back_again,
        &["--target-tensor-parallel-size", "2"],
    );
    same_files(&back, &back_again, &["mp_rank_00", "mp_rank_01"]);
}

#[test]
fn untied_output_layer_round_trips() {
    // The untied head `lm_head.output_layer.weight` is a parameter of its own (not a stage's
    // copy of the embeddings): reshaped with its optimizer state.
    let dir = tempfile::tempdir().unwrap();
    let original = trained_on_two_ranks_with(
        dir.path(),
        "255",
        &["--untie-embeddings-and-output-weights"],
    );
    let single = dir.path().join("tp1");
    let out = convert(&original, &single, &["--target-tensor-parallel-size", "1"]);
    assert_eq!(verified_difference(&out), 0.0);
    let head = &tensors(&iteration_dir(&single).join("mp_rank_00/model.safetensors"))
        ["lm_head.output_layer.weight"];
    assert_eq!(head.1, [256, 32]);
    let back = dir.path().join("tp2-again");
    convert(&single, &back, &["--target-tensor-parallel-size", "2"]);
    same_files(&original, &back, &["mp_rank_00", "mp_rank_01"]);
}

/// `checkpoint_convert --model-type T5` with `extra` exits `code` (2: a usage error, 1: a
/// failure of the work) with `message`, and writes nothing.
fn refused(extra: &[&str], code: i32, message: &str) {
    let dir = tempfile::tempdir().unwrap();
    let out = bin("checkpoint_convert")
        .args(["--model-type", "T5"])
        .arg("--load-dir")
        .arg(dir.path())
        .arg("--save-dir")
        .arg(dir.path().join("out"))
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{stderr}");
    assert!(stderr.contains(message), "expected {message:?} in {stderr}");
    assert!(!dir.path().join("out").exists());
}

#[test]
fn what_t5_cannot_do_is_refused_by_name() {
    refused(
        &["--loader", "megatron-rs", "--saver", "hf"],
        2,
        "Megatron's T5 has no HuggingFace form",
    );
    refused(
        &[
            "--loader",
            "megatron-rs",
            "--target-pipeline-parallel-size",
            "2",
        ],
        2,
        "--target-pipeline-parallel-size 2: T5 runs without pipeline parallelism",
    );
    refused(
        &["--loader", "core"],
        2,
        "--model-type T5 reads megatron-rs checkpoints only: give --loader megatron-rs",
    );
    refused(
        &["--loader", "megatron-rs"],
        1,
        "holds no megatron-rs checkpoint",
    );

    // A T5 checkpoint converted as a GPT is named.
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("ckpt");
    run_ok(
        pretrain("255", &["--train-iters", "1"])
            .arg("--save")
            .arg(&checkpoint),
    );
    let out = bin("checkpoint_convert")
        .args(["--model-type", "GPT", "--loader", "megatron-rs"])
        .arg("--load-dir")
        .arg(&checkpoint)
        .arg("--save-dir")
        .arg(dir.path().join("out"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("convert it with --model-type T5"),
        "{stderr}"
    );
    // inspect shows it.
    let out = run_ok(bin("checkpoint_convert").arg("inspect").arg(&checkpoint));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("\"model_type\": \"T5\""), "{stdout}");
    assert!(stdout.contains("lm_head.output_layer.bias"), "{stdout}");
}
