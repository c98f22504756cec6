//! `pretrain_gpt` as several processes, launched the way torchrun launches it (RANK,
//! WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) on CPUs with the gloo backend: the job
//! equals the one-process run, a missing rank is named after the timeout, and a killed rank
//! makes the others exit instead of hanging.

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use megatron_e2e::{
    bin, free_port, run_job, run_ok, spawn_rank, visible_gpus, wait_for_ranks, RANK_DEADLINE,
    TINY_MOCK_GPT,
};

/// A 2-layer GPT on mock data with the flags the parallel runs add.
fn pretrain(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command.args(TINY_MOCK_GPT).args([
        "--adam-eps",
        "1e-4",
        "--device",
        "cpu",
        "--distributed-backend",
        "gloo",
    ]);
    command.args(extra);
    command
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            serde_json::from_str::<serde_json::Value>(line).unwrap()["lm loss"].as_f64()
        })
        .collect()
}

/// Runs `pretrain_gpt` with `flags` as ranks 0 and 1 of a two-process job; both must succeed.
fn run_two_ranks(flags: &[&str], what: &str) -> Vec<Output> {
    run_ranks(2, flags, what)
}

/// Runs `pretrain_gpt` with `flags` as the `world` ranks of a job; all must succeed.
fn run_ranks(world: usize, flags: &[&str], what: &str) -> Vec<Output> {
    run_job(world, what, |_| pretrain(flags))
}

fn assert_same_losses(expected: &[f64], got: &[f64], what: &str) {
    assert_eq!(expected.len(), 3, "the one-process run logged {expected:?}");
    assert_eq!(got.len(), 3, "{what} logged {got:?}");
    for (a, b) in expected.iter().zip(got) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{what}: losses {got:?} differ from the one-process run's {expected:?}"
        );
    }
}

#[test]
fn two_processes_equal_one() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.jsonl");
    run_ok(&mut pretrain(&[
        "--train-iters",
        "3",
        "--metrics-file",
        single.to_str().unwrap(),
    ]));
    for (what, layout) in [("TP=2", "2"), ("DP=2", "1")] {
        let metrics = dir.path().join(format!("{what}.jsonl"));
        let flags = [
            "--train-iters",
            "3",
            "--metrics-file",
            metrics.to_str().unwrap(),
            "--tensor-model-parallel-size",
            layout,
        ];
        let outputs = run_two_ranks(&flags, what);
        for (rank, out) in outputs.iter().enumerate() {
            let stdout = String::from_utf8_lossy(&out.stdout);
            // Only the last rank logs, as in Megatron.
            assert_eq!(
                stdout.contains("pretrain_gpt: 3 iterations"),
                rank == 1,
                "{what} rank {rank}: {stdout}"
            );
        }
        assert_same_losses(&losses(&single), &losses(&metrics), what);
    }
}

/// Dropout on tensors every tensor-parallel rank holds whole must draw the same mask on all of
/// them (the default generator, seeded alike), so with hidden dropout TP=2 still equals TP=1.
#[test]
fn hidden_dropout_is_identical_across_tensor_parallel_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.jsonl");
    let dropout = ["--hidden-dropout", "0.1", "--train-iters", "3"];
    run_ok(pretrain(&dropout).args(["--metrics-file", single.to_str().unwrap()]));
    let metrics = dir.path().join("tp2.jsonl");
    let flags: Vec<&str> = dropout
        .iter()
        .copied()
        .chain([
            "--metrics-file",
            metrics.to_str().unwrap(),
            "--tensor-model-parallel-size",
            "2",
        ])
        .collect();
    run_two_ranks(&flags, "TP=2 with hidden dropout");
    let (expected, got) = (losses(&single), losses(&metrics));
    assert_same_losses(&expected, &got, "TP=2 with hidden dropout");
    let without = dir.path().join("without.jsonl");
    run_ok(&mut pretrain(&[
        "--train-iters",
        "3",
        "--metrics-file",
        without.to_str().unwrap(),
    ]));
    assert_ne!(losses(&without), expected, "hidden dropout changed nothing");
}

#[test]
fn a_rank_that_never_comes_is_named_after_the_timeout() {
    let port = free_port();
    let command = pretrain(&[
        "--train-iters",
        "3",
        "--distributed-timeout-minutes",
        "0.05",
    ]);
    let out = wait_for_ranks(vec![spawn_rank(command, 0, 3, &port)], RANK_DEADLINE).remove(0);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank(s) 1, 2 of 3 did not join within 3 s"),
        "{stderr}"
    );
}

#[test]
fn a_killed_rank_makes_the_others_exit() {
    for victim in [1, 0] {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let port = free_port();
        let mut ranks: Vec<Child> = (0..2)
            .map(|rank| {
                let command = pretrain(&[
                    "--train-iters",
                    "100000",
                    "--metrics-file",
                    metrics.to_str().unwrap(),
                ]);
                spawn_rank(command, rank, 2, &port)
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !metrics.exists() || std::fs::read_to_string(&metrics).unwrap().lines().count() < 2 {
            assert!(Instant::now() < deadline, "the job never trained");
            std::thread::sleep(Duration::from_millis(50));
        }
        ranks[victim].kill().unwrap();
        ranks[victim].wait().unwrap();
        let survivor = ranks.remove(1 - victim);
        let out = wait_for_ranks(vec![survivor], RANK_DEADLINE).remove(0);
        assert!(
            !out.status.success(),
            "the survivor of rank {victim}'s death exited successfully"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        // Named as a death, not as a timeout: the survivor noticed it rather than waiting out
        // --distributed-timeout-minutes.
        assert!(
            stderr.contains(&format!("rank {victim} exited unexpectedly")),
            "{stderr}"
        );
    }
}

/// The same equivalences on GPUs with NCCL; runs where there are at least two GPUs.
#[test]
fn two_gpus_with_nccl_equal_one() {
    if visible_gpus() < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    let gpu = [
        "--device",
        "cuda",
        "--distributed-backend",
        "nccl",
        "--train-iters",
        "3",
    ];
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.jsonl");
    let mut command = pretrain(&gpu);
    run_ok(command.args(["--metrics-file", single.to_str().unwrap()]));
    let layouts: [(&str, &[&str]); 6] = [
        ("TP=2", &["--tensor-model-parallel-size", "2"]),
        (
            "TP=2 + SP",
            &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ),
        ("PP=2", &["--pipeline-model-parallel-size", "2"]),
        (
            "DP=2, distributed optimizer",
            &["--use-distributed-optimizer"],
        ),
        (
            "DP=2, distributed optimizer, overlapped reduction",
            &[
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--ddp-bucket-size",
                "20000",
            ],
        ),
        (
            "DP=2, distributed optimizer, overlapped reduction and parameter gather",
            &[
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--ddp-bucket-size",
                "20000",
            ],
        ),
    ];
    for (what, layout) in layouts {
        let metrics = dir
            .path()
            .join(format!("{}.jsonl", what.replace([' ', '=', ',', '+'], "_")));
        let flags: Vec<&str> = gpu
            .iter()
            .copied()
            .chain(["--metrics-file", metrics.to_str().unwrap()])
            .chain(layout.iter().copied())
            .collect();
        run_two_ranks(&flags, what);
        let (expected, got) = (losses(&single), losses(&metrics));
        assert_same_losses(&expected, &got, what);
        eprintln!("{what}: losses {got:?} (one GPU: {expected:?})");
    }
}

/// The 4-rank layouts of the 4-GPU measurements against one rank on `device`: TP=4 with
/// sequence parallelism, TP=2 × PP=2, DP=4 with the distributed optimizer and overlapped
/// reduction and parameter gather (small buckets, so several overlap), and TP=2 × CP=2 with the
/// ring; with `every_context_exchange` also the all-gathered and Ulysses attentions across
/// processes (`lib/training/tests/context_parallel.rs` compares every exchange in one process).
fn four_ranks_equal_one(device: &[&str], every_context_exchange: bool) {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.jsonl");
    let mut command = pretrain(device);
    run_ok(command.args([
        "--train-iters",
        "3",
        "--metrics-file",
        single.to_str().unwrap(),
    ]));
    let layouts: [(&str, &[&str]); 6] = [
        (
            "TP=4 + SP",
            &["--tensor-model-parallel-size", "4", "--sequence-parallel"],
        ),
        (
            "TP=2 × PP=2",
            &[
                "--tensor-model-parallel-size",
                "2",
                "--pipeline-model-parallel-size",
                "2",
            ],
        ),
        (
            "DP=4, distributed optimizer, overlapped reduction and parameter gather",
            &[
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--overlap-param-gather",
                "--ddp-bucket-size",
                "20000",
            ],
        ),
        (
            "TP=2 × CP=2 + SP, ring attention",
            &[
                "--tensor-model-parallel-size",
                "2",
                "--sequence-parallel",
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "p2p",
            ],
        ),
        (
            "CP=2 × DP=2, all-gathered attention",
            &[
                "--context-parallel-size",
                "2",
                "--cp-comm-type",
                "allgather",
            ],
        ),
        (
            "CP=4, Ulysses attention",
            &["--context-parallel-size", "4", "--cp-comm-type", "a2a"],
        ),
    ];
    let count = if every_context_exchange {
        layouts.len()
    } else {
        4
    };
    for (index, (what, layout)) in layouts.into_iter().take(count).enumerate() {
        let metrics = dir.path().join(format!("{index}.jsonl"));
        let flags: Vec<&str> = device
            .iter()
            .copied()
            .chain([
                "--train-iters",
                "3",
                "--metrics-file",
                metrics.to_str().unwrap(),
            ])
            .chain(layout.iter().copied())
            .collect();
        let outputs = run_ranks(4, &flags, what);
        let stdout = String::from_utf8_lossy(&outputs[3].stdout);
        assert!(
            stdout.contains("pretrain_gpt: 3 iterations"),
            "{what}: {stdout}"
        );
        let (expected, got) = (losses(&single), losses(&metrics));
        assert_same_losses(&expected, &got, what);
        eprintln!("{what}: losses {got:?} (one rank: {expected:?})");
    }
}

#[test]
fn four_cpu_processes_equal_one() {
    four_ranks_equal_one(&[], false);
}

/// [`four_ranks_equal_one`] on four GPUs with NCCL; runs where there are at least four.
#[test]
fn four_gpus_with_nccl_equal_one() {
    if visible_gpus() < 4 {
        eprintln!("skipped: needs 4 GPUs");
        return;
    }
    four_ranks_equal_one(&["--device", "cuda", "--distributed-backend", "nccl"], true);
}

/// On two GPUs, TP=2 with sequence parallelism, bf16, hidden and attention dropout, rotary
/// embeddings (the fused kernel) and the fused loss: a run whose micro-batches replay from CUDA
/// graphs (the NCCL collectives and the model-parallel random stream inside them) logs the
/// losses and saves the weights of the same run without graphs, bit for bit, and says nothing of
/// training without them. Runs where there are at least two GPUs.
#[test]
fn two_gpus_with_cuda_graphs_train_bitwise_like_eager() {
    graphs_train_bitwise_like_eager(
        &["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        2,
    );
}

/// The same at DP=2 with the distributed optimizer and both overlap flags, which a graphed run
/// sets aside (its gradients are reduced after the micro-batches): the same losses and weights,
/// bit for bit, as the eager run that overlaps them. Runs where there are at least two GPUs.
#[test]
fn two_gpus_data_parallel_with_cuda_graphs_train_bitwise_like_eager_overlap() {
    graphs_train_bitwise_like_eager(
        &["--use-distributed-optimizer", "--overlap-param-gather"],
        1,
    );
}

/// Trains 6 iterations on two GPUs under `layout`, with and without `--enable-cuda-graph`, and
/// compares the logged losses and the weights the `model_parallel_ranks` save, bit for bit. Both
/// runs ask for `--overlap-grad-reduce`.
fn graphs_train_bitwise_like_eager(layout: &[&str], model_parallel_ranks: usize) {
    if visible_gpus() < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let metrics = dir.path().join(format!("{name}.jsonl"));
        let save = dir.path().join(name);
        let flags: Vec<&str> = [
            "--device",
            "cuda",
            "--distributed-backend",
            "nccl",
            "--bf16",
            "--hidden-dropout",
            "0.1",
            "--attention-dropout",
            "0.1",
            "--cross-entropy-loss-fusion",
            "--position-embedding-type",
            "rope",
            "--train-iters",
            "6",
            "--save-interval",
            "6",
            "--save",
            save.to_str().unwrap(),
            "--metrics-file",
            metrics.to_str().unwrap(),
        ]
        .into_iter()
        .chain(layout.iter().copied())
        .chain(extra.iter().copied())
        .collect();
        let outputs = run_two_ranks(&flags, name);
        for out in &outputs {
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!stderr.contains("without CUDA graphs"), "{name}: {stderr}");
        }
        let weights: Vec<Vec<u8>> = (0..model_parallel_ranks)
            .map(|rank| {
                let file = save.join(format!("iter_0000006/mp_rank_0{rank}/model.safetensors"));
                std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            })
            .collect();
        (losses(&metrics), weights)
    };
    let (eager_losses, eager_weights) = run("eager", &["--overlap-grad-reduce", "--no-cuda-graph"]);
    // With one data-parallel rank --overlap-grad-reduce has nothing to reduce; with more, the
    // graphed run reduces after the micro-batches. Either way graphs stay on.
    let (graphed_losses, graphed_weights) = run(
        "graphed",
        &[
            "--enable-cuda-graph",
            "--cuda-graph-warmup-steps",
            "2",
            "--overlap-grad-reduce",
        ],
    );
    eprintln!("losses with graphs {graphed_losses:?}, without {eager_losses:?}");
    assert_eq!(eager_losses.len(), 6);
    assert_eq!(graphed_losses, eager_losses);
    for rank in 0..model_parallel_ranks {
        assert!(
            graphed_weights[rank] == eager_weights[rank],
            "rank {rank}'s saved weights differ with graphs"
        );
    }
}

/// A corpus of short documents of 1 to 13 words, so that with `--eod-mask-loss` the micro-batches
/// of a 32-token sequence keep very different numbers of tokens (one end-of-document token
/// masked per document).
fn short_documents(dir: &Path) -> Vec<String> {
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "away",
    ];
    let documents: String = (0..400)
        .map(|i| {
            let length = if i % 5 == 4 { 40 } else { 1 };
            let text: Vec<&str> = (0..length).map(|j| words[(i + j) % words.len()]).collect();
            format!("{}\n", serde_json::json!({ "text": text.join(" ") }))
        })
        .collect();
    let input = dir.join("short.jsonl");
    std::fs::write(&input, documents).unwrap();
    let data = megatron_e2e::workspace_root().join("data");
    let (vocab, merges) = (
        data.join("quickstart-vocab.json"),
        data.join("quickstart-merges.txt"),
    );
    let prefix = dir.join("short");
    run_ok(
        bin("preprocess_data")
            .arg("--input")
            .arg(&input)
            .arg("--output-prefix")
            .arg(&prefix)
            .args([
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--append-eod",
                "--workers",
                "1",
            ])
            .arg("--vocab-file")
            .arg(&vocab)
            .arg("--merge-file")
            .arg(&merges),
    );
    vec![
        "--data-path".into(),
        format!("{}_text_document", prefix.display()),
        "--vocab-file".into(),
        vocab.display().to_string(),
        "--merge-file".into(),
        merges.display().to_string(),
    ]
}

/// A 2-layer GPT trained 3 SGD steps on [`short_documents`] with the end-of-document tokens
/// masked out of the loss.
fn pretrain_short_documents(data: &[String], extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args([
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
        ])
        .args(["--seq-length", "32", "--max-position-embeddings", "32"])
        .args([
            "--global-batch-size",
            "8",
            "--train-iters",
            "3",
            "--eod-mask-loss",
        ])
        .args([
            "--optimizer",
            "sgd",
            "--sgd-momentum",
            "0",
            "--lr",
            "0.5",
            "--clip-grad",
            "0",
        ])
        .args([
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--split",
            "100,0,0",
        ])
        .args([
            "--log-interval",
            "1",
            "--eval-iters",
            "0",
            "--device",
            "cpu",
        ])
        .args(["--distributed-backend", "gloo"])
        .args(data)
        .args(extra);
    command
}

/// With `--calculate-per-token-loss` the summed token losses are divided by the tokens of the
/// whole global batch: eight micro-batches of one sample, on one rank or on two tensor- or
/// pipeline-parallel ranks, and two data-parallel ranks of two micro-batches of two, train as
/// one micro-batch of all eight samples without the flag (whose loss is
/// that global per-token mean by definition). Without the flag, eight micro-batches of one
/// sample weigh each micro-batch's mean alike and train differently.
#[test]
fn per_token_loss_averages_over_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let data = short_documents(dir.path());
    let run_one = |name: &str, flags: &[&str]| {
        let metrics = dir.path().join(format!("{name}.jsonl"));
        run_ok(
            pretrain_short_documents(&data, flags)
                .args(["--metrics-file", metrics.to_str().unwrap()]),
        );
        losses(&metrics)
    };
    let whole_batch = run_one("whole", &["--micro-batch-size", "8"]);
    let per_token = run_one(
        "per-token",
        &["--micro-batch-size", "1", "--calculate-per-token-loss"],
    );
    assert_same_losses(
        &whole_batch,
        &per_token,
        "per-token loss over 8 micro-batches",
    );
    // Two ranks as two data-parallel ranks of two micro-batches of two samples, or two tensor-
    // or pipeline-parallel ranks of eight micro-batches of one.
    let layouts: [(&str, &[&str]); 3] = [
        ("DP=2", &["--micro-batch-size", "2"]),
        (
            "TP=2",
            &[
                "--micro-batch-size",
                "1",
                "--tensor-model-parallel-size",
                "2",
            ],
        ),
        (
            "PP=2",
            &[
                "--micro-batch-size",
                "1",
                "--pipeline-model-parallel-size",
                "2",
            ],
        ),
    ];
    for (what, layout) in layouts {
        let metrics = dir.path().join(format!("{what}.jsonl"));
        run_job(2, what, |_| {
            let mut command = pretrain_short_documents(&data, layout);
            command.args(["--calculate-per-token-loss", "--metrics-file"]);
            command.arg(&metrics);
            command
        });
        assert_same_losses(&whole_batch, &losses(&metrics), what);
    }
    let per_micro_batch = run_one("per-micro-batch", &["--micro-batch-size", "1"]);
    // The first loss is logged before any step, as the global per-token mean in every mode.
    assert!((per_micro_batch[0] - whole_batch[0]).abs() <= 1e-6 * whole_batch[0]);
    let apart = (1..3)
        .map(|i| (per_micro_batch[i] - whole_batch[i]).abs() / whole_batch[i])
        .fold(0.0, f64::max);
    assert!(
        apart > 5e-4,
        "averaging per micro-batch trained like the global mean ({per_micro_batch:?} vs {whole_batch:?}): the masks do not differ enough"
    );
}

/// The files under `directory` (relative path → bytes), `metadata.json` aside.
fn checkpoint_files(directory: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    for rank in std::fs::read_dir(directory).unwrap().flatten() {
        if rank.path().is_dir() {
            for file in std::fs::read_dir(rank.path()).unwrap().flatten() {
                let name = format!(
                    "{}/{}",
                    rank.file_name().to_string_lossy(),
                    file.file_name().to_string_lossy()
                );
                files.insert(name, std::fs::read(file.path()).unwrap());
            }
        }
    }
    files
}

/// A checkpoint's metadata without the flags it records (which name --async-save).
fn metadata_without_args(directory: &Path) -> serde_json::Value {
    let mut metadata: serde_json::Value =
        serde_json::from_slice(&std::fs::read(directory.join("metadata.json")).unwrap()).unwrap();
    metadata.as_object_mut().unwrap().remove("args").unwrap();
    metadata
}

/// `lm loss: ...` of each iteration line the logging rank printed.
fn loss_fields(stdout: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(stdout)
        .lines()
        .filter_map(|line| {
            let at = line.find("lm loss:")?;
            Some(line[at..].split('|').next()?.trim().to_string())
        })
        .collect()
}

/// `(iteration, lm loss, grad norm)` of each training iteration a run logged.
fn losses_and_grad_norms(metrics: &Path) -> Vec<(u64, f64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            Some((
                record["iteration"].as_u64()?,
                record["lm loss"].as_f64()?,
                record["grad-norm"].as_f64()?,
            ))
        })
        .collect()
}

/// At DP=2 with the distributed optimizer, --async-save writes the same checkpoints, byte for
/// byte (each rank's optimizer shard included), with the same metadata and checksums, and
/// trains with the same losses as synchronous saves.
#[test]
fn async_saves_equal_synchronous_ones_at_dp2_with_the_distributed_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for (what, extra) in [("sync", &[][..]), ("async", &["--async-save"][..])] {
        let (ckpt, metrics) = (
            dir.path().join(what),
            dir.path().join(format!("{what}.jsonl")),
        );
        let mut flags = vec![
            "--train-iters",
            "4",
            "--save-interval",
            "2",
            "--use-distributed-optimizer",
            "--save",
            ckpt.to_str().unwrap(),
            "--metrics-file",
            metrics.to_str().unwrap(),
        ];
        flags.extend(extra);
        let outputs = run_two_ranks(&flags, what);
        runs.push((
            ckpt,
            losses(&metrics),
            loss_fields(&outputs[1].stdout),
            outputs,
        ));
    }
    let (sync, asynchronous) = (&runs[0], &runs[1]);
    assert_eq!(sync.1.len(), 4, "{:?}", sync.1);
    assert_eq!(sync.1, asynchronous.1);
    assert_eq!(sync.2.len(), 4, "{:?}", sync.2);
    assert_eq!(sync.2, asynchronous.2);
    let rank0 = String::from_utf8_lossy(&asynchronous.3[0].stdout);
    for iteration in [2, 4] {
        assert!(
            rank0.contains(&format!(
                "  scheduled an async checkpoint save at iteration {iteration:7} to {}",
                asynchronous.0.display()
            )),
            "{rank0}"
        );
        let name = format!("iter_{iteration:07}");
        let (a, b) = (sync.0.join(&name), asynchronous.0.join(&name));
        let files = checkpoint_files(&a);
        assert!(
            files.contains_key("mp_rank_00/optimizer_dp001.safetensors"),
            "{:?}",
            files.keys()
        );
        assert!(files == checkpoint_files(&b), "{name} differs");
        assert_eq!(metadata_without_args(&a), metadata_without_args(&b));
    }
    for (ckpt, ..) in &runs {
        let tracked = std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"));
        assert_eq!(tracked.unwrap(), "4");
    }
}

/// Runs `pretrain_gpt` (fp32, deterministic, a 15-iteration schedule) on `world` ranks with
/// `layout`'s flags, from `load` where given, until iteration `until`, where it saves into
/// `dir/name`; returns what it logged and rank 0's standard output.
fn resume_in(
    dir: &Path,
    name: &str,
    load: Option<&Path>,
    world: usize,
    layout: &[&str],
    until: &str,
) -> (Vec<(u64, f64, f64)>, String) {
    let metrics = dir.join(format!("{name}.jsonl"));
    let save = dir.join(name);
    let load: Vec<&str> = load.map_or(vec![], |l| vec!["--load", l.to_str().unwrap()]);
    let flags: Vec<&str> = [
        "--deterministic-mode",
        "--train-iters",
        "15",
        "--exit-interval",
        until,
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        until,
        "--metrics-file",
        metrics.to_str().unwrap(),
    ]
    .into_iter()
    .chain(load)
    .chain(layout.iter().copied())
    .collect();
    let outputs = run_ranks(world, &flags, name);
    let stdout = String::from_utf8_lossy(&outputs[0].stdout).into_owned();
    (losses_and_grad_norms(&metrics), stdout)
}

/// The five iterations after a resume under another layout equal those resumed in the saved
/// layout: losses and gradient norms within 1e-5.
fn assert_same_iterations(expected: &[(u64, f64, f64)], got: &[(u64, f64, f64)], what: &str) {
    assert_eq!(
        expected.len(),
        5,
        "the run in the saved layout logged {expected:?}"
    );
    assert_eq!(
        got.iter().map(|r| r.0).collect::<Vec<_>>(),
        expected.iter().map(|r| r.0).collect::<Vec<_>>(),
        "{what}: iterations"
    );
    for (a, b) in expected.iter().zip(got) {
        assert!(
            (a.1 - b.1).abs() <= 1e-5 * a.1.abs() && (a.2 - b.2).abs() <= 1e-5 * a.2.abs(),
            "{what}: (iteration, loss, grad norm) {got:?} differ from the saved layout's {expected:?}"
        );
    }
}

/// `--load` of one of our checkpoints saved under another layout reshapes it, with its
/// (distributed) optimizer state, into the run's layout: TP1·PP1·DP2 with the distributed
/// optimizer resumes at TP2·PP2·DP1 and at TP2·DP1 with the distributed optimizer, and
/// TP2·PP2 resumes at TP1·DP2 with the distributed optimizer, each as the run resumed in the
/// saved layout. A different architecture is still refused.
#[test]
fn resume_under_another_layout_equals_the_saved_layout() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let distributed = ["--use-distributed-optimizer"];
    let tp2_pp2 = [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
    ];
    let tp2_distributed = [
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
    ];
    resume_in(dir, "first", None, 2, &distributed, "5");
    let first = dir.join("first");
    assert!(first.join("iter_0000005").is_dir());

    let (saved_layout, _) = resume_in(dir, "own", Some(&first), 2, &distributed, "10");
    let (reshaped, stdout) = resume_in(dir, "tp2_pp2", Some(&first), 4, &tp2_pp2, "10");
    assert!(
        stdout.contains("from TP=1 PP=1 DP=2, distributed optimizer to TP=2 PP=2"),
        "no log line of the reshape: {stdout}"
    );
    assert_same_iterations(&saved_layout, &reshaped, "TP1·PP1·DP2 → TP2·PP2·DP1");
    let (reshaped, _) = resume_in(dir, "tp2_dp1", Some(&first), 2, &tp2_distributed, "10");
    assert_same_iterations(
        &saved_layout,
        &reshaped,
        "TP1·PP1·DP2 → TP2·DP1, distributed optimizer",
    );

    let second = dir.join("tp2_pp2");
    let (saved_layout, _) = resume_in(dir, "own_tp2_pp2", Some(&second), 4, &tp2_pp2, "15");
    let (reshaped, stdout) = resume_in(dir, "back", Some(&second), 2, &distributed, "15");
    assert!(
        stdout.contains("from TP=2 PP=2 DP=1 to TP=1 PP=1, distributed optimizer over DP=2"),
        "no log line of the reshape: {stdout}"
    );
    assert_same_iterations(
        &saved_layout,
        &reshaped,
        "TP2·PP2·DP1 → TP1·DP2, distributed optimizer",
    );

    let port = free_port();
    let wider: Vec<Child> = (0..2)
        .map(|rank| {
            let mut command = pretrain(&[
                "--train-iters",
                "15",
                "--tensor-model-parallel-size",
                "2",
                "--load",
                first.to_str().unwrap(),
            ]);
            command.args(["--hidden-size", "128"]);
            spawn_rank(command, rank, 2, &port)
        })
        .collect();
    // Rank 0 rewrites the checkpoint for the node and rank 1 reads that copy: both name the
    // difference, and rank 0, which removes the copy as it fails, waits for rank 1 to have read it.
    for (rank, out) in wait_for_ranks(wider, RANK_DEADLINE).iter().enumerate() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "rank {rank}: another hidden size was loaded"
        );
        assert!(
            stderr.contains("different architecture") && stderr.contains("hidden_size"),
            "rank {rank}: {stderr}"
        );
    }
}
