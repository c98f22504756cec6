//! `checkpoint_convert` as a user runs it: Megatron's convert.py flags on Megatron's own
//! checkpoints (../shared/golden/megatron_checkpoints), `inspect`, `pretrain_gpt --load`
//! continuing Megatron's run with its optimizer, and bad inputs that name the file and the
//! tensor and leave no output directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{
    bin, distances, megatron_log, resume_pretrain_gpt, run_job, run_ok, shared_dir, Logged, Step,
    TINY_MOCK_GPT,
};

fn golden(name: &str) -> PathBuf {
    shared_dir().join("golden/megatron_checkpoints").join(name)
}

fn convert(load: &Path, save: &Path, extra: &[&str]) -> Command {
    let mut command = bin("checkpoint_convert");
    command
        .args([
            "--model-type",
            "GPT",
            "--loader",
            "core",
            "--saver",
            "megatron-rs",
        ])
        .arg("--load-dir")
        .arg(load)
        .arg("--save-dir")
        .arg(save)
        .args([
            "--megatron-path",
            "/nonexistent/Megatron-LM",
            "--max-queue-size",
            "50",
        ])
        .args(extra);
    command
}

fn stderr_of(command: &mut Command) -> String {
    let out = command.output().unwrap();
    assert!(!out.status.success(), "{command:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Leaves `dir` holding no converted output and no temporary directory.
fn assert_nothing_left(parent: &Path) {
    let left: Vec<_> = std::fs::read_dir(parent)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("out"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn inspect_lists_every_golden() {
    for (name, format, tensor) in [
        (
            "gpt_torch",
            "Megatron torch",
            "model/decoder.layers.1.mlp.linear_fc2.weight  bfloat16  [64, 256]",
        ),
        (
            "llama_torch",
            "Megatron torch",
            "model/output_layer.weight  bfloat16  [8320, 64]",
        ),
        (
            "gpt_torch_dist",
            "Megatron torch_dist",
            "decoder.layers.mlp.linear_fc1.weight  bfloat16  [2, 256, 64]",
        ),
    ] {
        let out = run_ok(bin("checkpoint_convert").arg("inspect").arg(golden(name)));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("format: {format}")),
            "{name}:\n{text}"
        );
        assert!(text.contains(tensor), "{name}: no {tensor}:\n{text}");
        assert!(text.contains("checkpoint_version: 3.0"), "{name}:\n{text}");
        assert!(text.contains("\"num_layers\":2"), "{name}: args:\n{text}");
    }
}

/// Megatron's pretrain_gpt.py flags of the golden run (its README), on our CPU.
fn golden_run_flags() -> Vec<&'static str> {
    vec![
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "8192",
        "--bf16",
        "--no-bias-gelu-fusion",
        "--eval-iters",
        "0",
        "--log-interval",
        "1",
        "--seed",
        "1234",
        "--device",
        "cpu",
    ]
}

#[test]
fn pretrain_gpt_continues_megatrons_run_with_its_optimizer() {
    let dir = tempfile::tempdir().unwrap();
    let ours = dir.path().join("ours");
    let out = run_ok(&mut convert(&golden("gpt_torch"), &ours, &["--verify"]));
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains("28 tensors with optimizer state"),
        "{summary}"
    );
    assert!(
        summary.contains("verify: max |Δ logits| = 0e0"),
        "{summary}"
    );
    let metrics = dir.path().join("metrics.jsonl");
    let out = run_ok(
        bin("pretrain_gpt")
            .args(golden_run_flags())
            .args(["--train-iters", "5", "--override-opt_param-scheduler"])
            .arg("--load")
            .arg(&ours)
            .arg("--metrics-file")
            .arg(&metrics),
    );
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(
        log.contains("5 iterations") || log.contains("iteration        5/"),
        "{log}"
    );
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r.get("lm loss").is_some())
        .collect();
    let iterations: Vec<u64> = records
        .iter()
        .map(|r| r["iteration"].as_u64().unwrap())
        .collect();
    assert_eq!(
        iterations,
        vec![4, 5],
        "training resumed after Megatron's iteration 3"
    );
    for record in &records {
        let loss = record["lm loss"].as_f64().unwrap();
        // Megatron logged 9.03 at iteration 3 (ln 8193 = 9.01 is a uniform guess).
        assert!((8.5..9.5).contains(&loss), "{record}");
    }
}

/// The distributed-optimizer goldens' flags (their README) on two CPU ranks.
fn distopt_run_flags() -> Vec<&'static str> {
    let mut flags = golden_run_flags();
    let batch = flags
        .iter()
        .position(|f| *f == "--global-batch-size")
        .unwrap();
    flags[batch + 1] = "8";
    flags.extend([
        "--train-iters",
        "10",
        "--lr-warmup-iters",
        "2",
        "--use-distributed-optimizer",
        "--distributed-backend",
        "gloo",
    ]);
    flags
}

/// What the distributed-optimizer goldens' logs are compared by.
const LOGGED: [Logged; 2] = [Logged::LmLoss, Logged::GradNorm];

/// pretrain_gpt with the goldens' flags and `extra`, resumed from `load` by `ranks` processes:
/// its logged iterations, which continue Megatron's after iteration 5.
fn resume_distributed_run(load: &Path, ranks: usize, extra: &[&str], dir: &Path) -> Vec<Step> {
    let flags = [distopt_run_flags().as_slice(), extra].concat();
    resume_pretrain_gpt(load, ranks, &flags, &LOGGED, 6..=10, dir)
}

/// How far `ours` is from what Megatron logged for `name`'s run: the largest and the mean
/// distance of the lm losses, and the largest relative distance of the gradient norms.
fn distance_from_megatron(name: &str, ours: &[Step]) -> (f64, f64, f64) {
    let logged = megatron_log(&golden(&format!("{name}.train.txt")), &LOGGED);
    let [lm, norm] = &distances(ours, &logged)[..] else {
        unreachable!("two values are logged")
    };
    (lm.largest, lm.mean, norm.largest_relative)
}

/// Megatron's distributed-optimizer runs (torch's distrib_optim.pt, torch_dist's
/// fully_sharded_model_space) continue here with their optimizer state: loaded directly at
/// DP=2 (and after checkpoint_convert, in one process), iterations 6–10 log Megatron's gradient
/// norms within 3% and its losses within its own dropout's noise (Megatron's masks come from
/// the GPU's generator: the loss of iteration 6, before any step of ours, already differs by
/// 1.3e-3), while the same resume without the optimizer state drifts away.
#[test]
fn pretrain_gpt_continues_megatrons_distributed_optimizer_runs() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["distopt_torch", "distopt_torch_dist"] {
        let direct = resume_distributed_run(&golden(name), 2, &[], dir.path());
        let (largest, mean, norms) = distance_from_megatron(name, &direct);
        assert!(
            largest <= 5e-3 && mean <= 3e-3 && norms <= 0.03,
            "{name}: lm loss {largest} from Megatron's at most, {mean} on average, grad norm {norms}: {direct:?}"
        );
    }
    let ours = dir.path().join("converted");
    let out = run_ok(&mut convert(&golden("distopt_torch"), &ours, &[]));
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains("28 tensors with optimizer state"),
        "{summary}"
    );
    let converted = resume_distributed_run(&ours, 1, &[], dir.path());
    let (largest, mean, norms) = distance_from_megatron("distopt_torch", &converted);
    assert!(
        largest <= 5e-3 && mean <= 3e-3 && norms <= 0.03,
        "converted: lm loss {largest} from Megatron's at most, {mean} on average, grad norm {norms}: {converted:?}"
    );
    let fresh = resume_distributed_run(
        &golden("distopt_torch"),
        2,
        &["--no-load-optim"],
        dir.path(),
    );
    let (largest, mean, _) = distance_from_megatron("distopt_torch", &fresh);
    assert!(
        largest > 2e-2 && mean > 1e-2,
        "a fresh optimizer should drift from Megatron's losses, not {largest} (mean {mean}): {fresh:?}"
    );
}

#[test]
fn llama_and_torch_dist_goldens_convert_to_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    for (name, layout) in [
        ("llama_torch", ["--target-tensor-parallel-size", "2"]),
        ("gpt_torch_dist", ["--target-pipeline-parallel-size", "2"]),
    ] {
        let ours = dir.path().join(name);
        let out = run_ok(&mut convert(
            &golden(name),
            &ours,
            &[layout[0], layout[1], "--verify"],
        ));
        let summary = String::from_utf8_lossy(&out.stdout);
        assert!(
            summary.contains("verify: max |Δ logits| = 0e0"),
            "{name}: {summary}"
        );
        let inspected = run_ok(bin("checkpoint_convert").arg("inspect").arg(&ours));
        let text = String::from_utf8_lossy(&inspected.stdout);
        assert!(text.contains("format: megatron-rs"), "{text}");
    }
}

#[test]
fn bad_inputs_name_the_file_and_leave_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    // A truncated rank file.
    let broken = dir.path().join("truncated/iter_0000003/mp_rank_00");
    std::fs::create_dir_all(&broken).unwrap();
    let bytes = std::fs::read(golden(
        "gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt",
    ))
    .unwrap();
    std::fs::write(
        broken.join("model_optim_rng.pt"),
        &bytes[..bytes.len() * 2 / 3],
    )
    .unwrap();
    std::fs::write(
        dir.path()
            .join("truncated/latest_checkpointed_iteration.txt"),
        "3",
    )
    .unwrap();
    let error = stderr_of(&mut convert(&dir.path().join("truncated"), &out, &[]));
    assert!(error.contains("mp_rank_00/model_optim_rng.pt"), "{error}");
    assert_nothing_left(dir.path());
    // A missing shard of a TP=2 PP=2 layout.
    let sharded = dir.path().join("sharded/iter_0000003");
    for rank in ["mp_rank_00_000", "mp_rank_01_001"] {
        std::fs::create_dir_all(sharded.join(rank)).unwrap();
        std::fs::write(sharded.join(rank).join("model_optim_rng.pt"), &bytes).unwrap();
    }
    std::fs::write(
        dir.path().join("sharded/latest_checkpointed_iteration.txt"),
        "3",
    )
    .unwrap();
    let error = stderr_of(&mut convert(&dir.path().join("sharded"), &out, &[]));
    assert!(error.contains("missing shard mp_rank_00_001"), "{error}");
    assert_nothing_left(dir.path());
    // A vocabulary that disagrees with --true-vocab-size.
    let vocab = dir.path().join("vocab.json");
    std::fs::write(&vocab, r#"{"a": 0, "b": 1}"#).unwrap();
    let error = stderr_of(&mut convert(
        &golden("gpt_torch"),
        &out,
        &[
            "--true-vocab-size",
            "8193",
            "--vocab-file",
            vocab.to_str().unwrap(),
        ],
    ));
    assert!(
        error.contains("--true-vocab-size 8193 disagrees with --vocab-file"),
        "{error}"
    );
    let error = stderr_of(&mut convert(
        &golden("gpt_torch"),
        &out,
        &["--true-vocab-size", "9000"],
    ));
    assert!(error.contains("9000") && error.contains("8320"), "{error}");
    assert_nothing_left(dir.path());
    // A tensor whose shape disagrees with the architecture (a HuggingFace config that lies).
    let lying = dir.path().join("lying");
    std::fs::create_dir_all(&lying).unwrap();
    let ours = dir.path().join("llama_ours");
    run_ok(&mut convert(&golden("llama_torch"), &ours, &[]));
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "megatron-rs",
                "--saver",
                "hf",
                "--load-dir",
            ])
            .arg(&ours)
            .arg("--save-dir")
            .arg(&lying),
    );
    let config_path = lying.join("config.json");
    let config = std::fs::read_to_string(&config_path)
        .unwrap()
        .replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(&config_path, config).unwrap();
    let error = stderr_of(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "hf",
                "--saver",
                "megatron-rs",
                "--load-dir",
            ])
            .arg(&lying)
            .arg("--save-dir")
            .arg(&out),
    );
    assert!(
        error.contains("model.layers.0.mlp.gate_proj.weight has shape [128, 64]")
            && error.contains("config.json implies [96, 64]"),
        "{error}"
    );
    assert_nothing_left(dir.path());
    // An unknown HuggingFace architecture.
    let hf = dir.path().join("falcon");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(
        hf.join("config.json"),
        r#"{"architectures": ["FalconForCausalLM"]}"#,
    )
    .unwrap();
    let error = stderr_of(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "hf",
                "--saver",
                "megatron-rs",
                "--load-dir",
            ])
            .arg(&hf)
            .arg("--save-dir")
            .arg(&out),
    );
    assert!(
        error.contains("FalconForCausalLM") && error.contains("config.json"),
        "{error}"
    );
    assert_nothing_left(dir.path());
}

/// pretrain_gpt on mock data, float32, without dropout: losses comparable across layouts.
fn small_run(extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args(TINY_MOCK_GPT)
        .args([
            "--train-iters",
            "4",
            "--device",
            "cpu",
            "--distributed-backend",
            "gloo",
        ])
        .args(extra);
    command
}

/// Runs `command` as both ranks of a two-process job (torchrun's variables).
fn two_ranks(make: impl Fn() -> Command) {
    run_job(2, "", |_| make());
}

fn lm_losses(metrics: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let r: serde_json::Value = serde_json::from_str(l).unwrap();
            Some((r["iteration"].as_u64()?, r.get("lm loss")?.as_f64()?))
        })
        .collect()
}

/// A two-process run in `layout` saved at iteration 2 and continued, against the same
/// checkpoint converted to one process (TP=1, plain optimizer) and continued there.
fn resumed_after_conversion_matches(layout: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let tp2 = dir.path().join("tp2");
    let path = |p: &Path| p.to_str().unwrap().to_string();
    // The two-process run saved at iteration 2, then continued in the same layout.
    two_ranks(|| {
        let mut c = small_run(&["--save-interval", "2", "--exit-interval", "2"]);
        c.args(layout).args(["--save", &path(&tp2)]);
        c
    });
    let continued = dir.path().join("continued.jsonl");
    two_ranks(|| {
        let mut c = small_run(layout);
        c.args(["--load", &path(&tp2), "--metrics-file", &path(&continued)]);
        c
    });
    // The same checkpoint reshaped to TP=1, continued by one process.
    let tp1 = dir.path().join("tp1");
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "megatron-rs",
                "--saver",
                "megatron-rs",
            ])
            .args([
                "--target-tensor-parallel-size",
                "1",
                "--load-dir",
                &path(&tp2),
                "--save-dir",
                &path(&tp1),
            ]),
    );
    let reshaped = dir.path().join("reshaped.jsonl");
    run_ok(
        small_run(&["--load", &path(&tp1), "--metrics-file", &path(&reshaped)])
            .env_remove("WORLD_SIZE"),
    );
    let (expected, got) = (lm_losses(&continued), lm_losses(&reshaped));
    assert_eq!(
        expected.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![3, 4],
        "{expected:?}"
    );
    assert_eq!(
        got.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![3, 4],
        "{got:?}"
    );
    for ((_, a), (_, b)) in expected.iter().zip(&got) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "losses after the reshape {got:?}, without it {expected:?}"
        );
    }
}

#[test]
fn training_resumed_after_a_reshape_matches_the_unreshaped_run() {
    resumed_after_conversion_matches(&["--tensor-model-parallel-size", "2"]);
}

/// The distributed optimizer's shards (several buckets, so parameters straddle the two data
/// ranks' shards) are joined into the one-process optimizer state.
#[test]
fn distributed_optimizer_state_converts_to_one_process() {
    resumed_after_conversion_matches(&["--use-distributed-optimizer", "--ddp-bucket-size", "5000"]);
}

fn torch_reference(path: &Path) -> serde_json::Value {
    let python = std::env::var_os("MEGATRON_RS_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| megatron_e2e::workspace_root().join(".venv/bin/python"));
    let out = run_ok(
        Command::new(python)
            .arg(megatron_e2e::workspace_root().join("scripts/torch_checkpoint_reference.py"))
            .arg(path),
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn megatron_torch_format_output_loads_with_torch_like_the_golden() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("for_megatron");
    let run = run_ok(&mut {
        let mut c = bin("checkpoint_convert");
        c.args([
            "--model-type",
            "GPT",
            "--loader",
            "core",
            "--saver",
            "core",
            "--verify",
            "--load-dir",
        ])
        .arg(golden("gpt_torch"))
        .arg("--save-dir")
        .arg(&out);
        c
    });
    let summary = String::from_utf8_lossy(&run.stdout);
    assert!(
        summary.contains("verify: max |Δ logits| = 0e0"),
        "{summary}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
        "3"
    );
    let ours = torch_reference(&out.join("iter_0000003/mp_rank_00/model_optim_rng.pt"));
    let theirs = torch_reference(&golden(
        "gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt",
    ));
    // The same model entries with the same dtypes, shapes and bytes, as torch.load reads them.
    let model = |reference: &serde_json::Value| -> Vec<(String, serde_json::Value)> {
        reference["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("model/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(model(&ours), model(&theirs));
    // Megatron's optimizer entry comes back bit for bit: Adam's per-parameter state under the
    // same indices, the float32 main parameters in the same groups.
    let optimizer = |reference: &serde_json::Value| -> Vec<(String, serde_json::Value)> {
        reference["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("optimizer/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(optimizer(&theirs).len(), 28 * 4, "golden optimizer entries");
    assert_eq!(optimizer(&ours), optimizer(&theirs));
    // The same parameter groups, hyperparameters included.
    assert_eq!(groups_without_lr(&ours), groups_without_lr(&theirs));
    assert_eq!(ours["scalars"]["checkpoint_version"], 3.0);
    assert_eq!(ours["scalars"]["iteration"], 3);
    for key in [
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "padded_vocab_size",
        "seq_length",
        "tokenizer_type",
        "tensor_model_parallel_size",
    ] {
        assert_eq!(ours["args"][key], theirs["args"][key], "args.{key}");
    }
    // Every key in Megatron's order, `_extra_state` entries included, as its strict
    // load_state_dict expects them.
    assert_eq!(ours["model_keys"], theirs["model_keys"]);
    let inspected = run_ok(bin("checkpoint_convert").arg("inspect").arg(&out));
    let text = String::from_utf8_lossy(&inspected.stdout);
    assert!(text.contains("format: Megatron torch"), "{text}");
}

/// `checkpoint_convert --saver core --ckpt-format torch_dist` of `load` into `save`.
fn export_torch_dist(load: &Path, save: &Path, extra: &[&str]) -> std::process::Output {
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "core",
                "--saver",
                "core",
                "--ckpt-format",
                "torch_dist",
                "--load-dir",
            ])
            .arg(load)
            .arg("--save-dir")
            .arg(save)
            .args(extra),
    )
}

/// The parameter groups of a reference, without `lr` (the scheduler's to set on resume).
fn groups_without_lr(reference: &serde_json::Value) -> Vec<serde_json::Value> {
    reference["param_groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let mut g = g.clone();
            g.as_object_mut().unwrap().remove("lr");
            g
        })
        .collect()
}

/// Megatron's torch_dist run with the distributed optimizer (`distopt_torch_dist`), and the
/// same run saved in torch format (`distopt_torch`), both re-saved as torch_dist at their
/// layout (DP=2), read by torch.distributed.checkpoint as Megatron's own save reads: the same
/// keys, dtypes, shapes and chunks in `.metadata` (all but the RNG state, which is not
/// written), every model and optimizer tensor bit for bit, and the same entries in
/// `common.pt` (the optimizer's groups and per-parameter steps, the sharding type).
#[test]
fn torch_dist_export_matches_megatrons_own_save() {
    let dir = tempfile::tempdir().unwrap();
    let theirs = torch_reference(&golden("distopt_torch_dist/iter_0000005"));
    let megatron_keys: serde_json::Map<String, serde_json::Value> = theirs["dist_metadata"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| !k.starts_with("rng_state"))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(megatron_keys.len(), 72, "golden .metadata entries");
    assert_eq!(theirs["tensors"].as_object().unwrap().len(), 64);
    for name in ["distopt_torch_dist", "distopt_torch"] {
        let out = dir.path().join(name);
        export_torch_dist(&golden(name), &out, &[]);
        assert_eq!(
            std::fs::read_to_string(out.join("latest_checkpointed_iteration.txt")).unwrap(),
            "5"
        );
        let ours = torch_reference(&out.join("iter_0000005"));
        assert_eq!(
            ours["dist_metadata"].as_object().unwrap(),
            &megatron_keys,
            "{name}"
        );
        assert_eq!(ours["tensors"], theirs["tensors"], "{name}");
        assert_eq!(ours["common_paths"], theirs["common_paths"], "{name}");
        assert_eq!(
            groups_without_lr(&ours),
            groups_without_lr(&theirs),
            "{name}"
        );
        assert_eq!(ours["scalars"], theirs["scalars"], "{name}");
        for key in [
            "num_layers",
            "hidden_size",
            "padded_vocab_size",
            "tensor_model_parallel_size",
            "use_distributed_optimizer",
            "ckpt_format",
            "data_parallel_size",
        ] {
            assert_eq!(ours["args"][key], theirs["args"][key], "{name}: args.{key}");
        }
        assert_eq!(ours["args"]["no_save_rng"], true);
        let json = std::fs::read_to_string(out.join("iter_0000005/metadata.json")).unwrap();
        let json: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(json["sharded_backend"], "torch_dist");
    }
}

/// Megatron's torch-format golden (plain optimizer) exported as torch_dist at TP=2, PP=2 and
/// two data-parallel ranks' optimizer chunks, then brought back to Megatron's torch format at
/// TP=1, PP=1: every model and optimizer tensor of the golden comes back bit for bit, so the
/// tensor-parallel, layer and data-parallel chunks tile each tensor exactly; torch reads the
/// export's 4 + 2 rank files through its `.metadata`.
#[test]
fn torch_dist_export_round_trips_through_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let exported = dir.path().join("tp2pp2");
    let out = export_torch_dist(
        &golden("gpt_torch"),
        &exported,
        &[
            "--verify",
            "--target-tensor-parallel-size",
            "2",
            "--target-pipeline-parallel-size",
            "2",
            "--target-data-parallel-size",
            "2",
        ],
    );
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(
        summary.contains("verify: max |Δ logits| = 0e0"),
        "{summary}"
    );
    let dist = torch_reference(&exported.join("iter_0000003"));
    let metadata = dist["dist_metadata"].as_object().unwrap();
    assert_eq!(
        metadata["decoder.layers.mlp.linear_fc2.weight"],
        serde_json::json!([
            "bfloat16",
            [2, 64, 256],
            [
                [[0, 0, 0], [1, 64, 128]],
                [[0, 0, 128], [1, 64, 128]],
                [[1, 0, 0], [1, 64, 128]],
                [[1, 0, 128], [1, 64, 128]]
            ]
        ])
    );
    assert_eq!(
        metadata["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"][1],
        serde_json::json!([2, 1, 2, 8192])
    );
    let back = dir.path().join("back");
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "core",
                "--saver",
                "core",
                "--target-tensor-parallel-size",
                "1",
                "--target-pipeline-parallel-size",
                "1",
                "--load-dir",
            ])
            .arg(&exported)
            .arg("--save-dir")
            .arg(&back),
    );
    let ours = torch_reference(&back.join("iter_0000003/mp_rank_00/model_optim_rng.pt"));
    let theirs = torch_reference(&golden(
        "gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt",
    ));
    let saved = |reference: &serde_json::Value| -> Vec<(String, serde_json::Value)> {
        reference["tensors"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| k.starts_with("model/") || k.starts_with("optimizer/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    assert_eq!(saved(&theirs).len(), 28 + 28 * 4);
    assert_eq!(saved(&ours), saved(&theirs));
}

/// A torch_dist export read back by our own reader and resumed at DP=2: training continues
/// exactly as from Megatron's original (iterations 6-10, losses and gradient norms equal), so
/// the weights and the distributed optimizer's state came through whole. Re-exported with the
/// chunks of one data-parallel rank, it resumes the same.
#[test]
fn training_continues_from_a_torch_dist_export_as_from_megatrons() {
    let dir = tempfile::tempdir().unwrap();
    let exported = dir.path().join("exported");
    export_torch_dist(&golden("distopt_torch"), &exported, &["--verify"]);
    let direct = resume_distributed_run(&golden("distopt_torch"), 2, &[], dir.path());
    let resumed = resume_distributed_run(&exported, 2, &[], dir.path());
    assert_eq!(resumed, direct);
    let one_rank = dir.path().join("one_rank");
    export_torch_dist(&exported, &one_rank, &["--target-data-parallel-size", "1"]);
    let again = resume_distributed_run(&one_rank, 2, &[], dir.path());
    assert_eq!(again, direct);
}

/// `docs/llama_mistral.md`'s import command runs as written (`--bf16 --loader llama_mistral
/// --checkpoint-type hf --model-size llama3 --tokenizer-model ...`), and `--fp16` instead writes
/// float16 parameters; Meta's original format is refused by name.
#[test]
fn megatrons_llama_import_command_runs_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("hf");
    run_ok(
        bin("checkpoint_convert")
            .args(["--model-type", "GPT", "--loader", "core", "--saver", "hf"])
            .arg("--load-dir")
            .arg(golden("llama_torch"))
            .arg("--save-dir")
            .arg(&hf),
    );
    let import = |precision: &str, checkpoint_type: &str, save: &Path| {
        let mut command = bin("checkpoint_convert");
        command
            .args([
                precision,
                "--model-type",
                "GPT",
                "--loader",
                "llama_mistral",
            ])
            .args(["--saver", "core", "--target-tensor-parallel-size", "1"])
            .args(["--checkpoint-type", checkpoint_type, "--load-dir"])
            .arg(&hf)
            .arg("--save-dir")
            .arg(save)
            .arg("--tokenizer-model")
            .arg(shared_dir().join("data/gpt2-tokenizer.json"))
            .args(["--model-size", "llama3"]);
        command
    };
    for (precision, dtype) in [("--bf16", "bfloat16"), ("--fp16", "float16")] {
        let save = dir.path().join(&precision[2..]);
        run_ok(&mut import(precision, "hf", &save));
        let inspected = run_ok(bin("checkpoint_convert").arg("inspect").arg(&save));
        let text = String::from_utf8_lossy(&inspected.stdout);
        let weights: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("model/decoder"))
            .collect();
        assert!(!weights.is_empty(), "{text}");
        for line in weights {
            assert!(
                line.contains(&format!("  {dtype}  ")),
                "{precision}: {line}"
            );
        }
    }
    let error = stderr_of(&mut import("--bf16", "meta", &dir.path().join("meta")));
    assert!(error.contains("--checkpoint-type meta"), "{error}");
    assert!(!dir.path().join("meta").exists());
}

/// `--load` of a Megatron checkpoint (torch or torch_dist) works in the inference tools: it is
/// imported on the fly and generates exactly what its converted copy generates.
#[test]
fn megatron_checkpoints_load_directly_for_inference() {
    let dir = tempfile::tempdir().unwrap();
    let generate = |load: &Path| {
        let out = run_ok(
            bin("generate_samples_gpt")
                .arg("--load")
                .arg(load)
                .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"])
                .args([
                    "--prompt",
                    "11 12 13 14",
                    "--greedy",
                    "--out-seq-length",
                    "8",
                ])
                .args(["--device", "cpu"]),
        );
        String::from_utf8(out.stdout).unwrap()
    };
    for name in ["gpt_torch", "gpt_torch_dist"] {
        let converted = dir.path().join(name);
        run_ok(&mut convert(&golden(name), &converted, &[]));
        let (direct, via_copy) = (generate(&golden(name)), generate(&converted));
        assert!(direct.contains("11 12 13 14"), "{name}: {direct}");
        assert_eq!(direct, via_copy, "{name}");
    }
}

/// Runs `command`, which must fail with exit code 1 and a message holding every one of
/// `needles`, and leave nothing under `parent`.
fn refused(command: &mut Command, needles: &[&str], parent: &Path) {
    let out = command.output().unwrap();
    let error = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{command:?}: {error}");
    for needle in needles {
        assert!(error.contains(needle), "{needle:?} not in: {error}");
    }
    assert!(!error.contains("panicked"), "{error}");
    assert_nothing_left(parent);
}

/// The golden GPT checkpoint with integer entries of its args replaced.
fn golden_gpt_with_args(dir: &Path, name: &str, changes: &[&str]) -> PathBuf {
    let root = dir.join(name);
    let rank = root.join("iter_0000003/mp_rank_00");
    std::fs::create_dir_all(&rank).unwrap();
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "3").unwrap();
    run_ok(
        std::process::Command::new(megatron_e2e::test_python(&["pickletools"]))
            .arg(megatron_e2e::workspace_root().join("tests/fixtures/edit_megatron_args.py"))
            .arg(golden(
                "gpt_torch/iter_0000003/mp_rank_00/model_optim_rng.pt",
            ))
            .arg(rank.join("model_optim_rng.pt"))
            .args(changes),
    );
    root
}

#[test]
fn sizes_in_megatron_args_are_checked_against_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let file = "iter_0000003/mp_rank_00/model_optim_rng.pt";
    // The golden run's embedding has 8320 rows (50257 tokens would not fit: a NullTokenizer).
    for (name, change, needles) in [
        (
            "rows",
            "padded_vocab_size=60000",
            &[
                "padded_vocab_size 60000",
                "8320 rows of embedding.word_embeddings.weight",
            ][..],
        ),
        (
            "huge",
            "padded_vocab_size=2147483647",
            &["padded_vocab_size 2147483647"][..],
        ),
        (
            "heads",
            "num_attention_heads=0",
            &["num_attention_heads 0 must be positive"][..],
        ),
        (
            "layers",
            "num_layers=1000000000",
            &["num_layers 1000000000 disagrees with the tensors, which hold 2 layers"][..],
        ),
        (
            "multiple",
            "make_vocab_size_divisible_by=2147483647",
            &[
                "make_vocab_size_divisible_by 2147483647 pads",
                "--make-vocab-size-divisible-by",
            ][..],
        ),
    ] {
        let load = golden_gpt_with_args(dir.path(), name, &[change]);
        let mut needles = needles.to_vec();
        let path = format!("{name}/{file}");
        needles.push(&path);
        refused(&mut convert(&load, &out, &[]), &needles, dir.path());
    }
    // A padding multiple given as a flag pads beyond the rows present, as Megatron's converter.
    let load = golden_gpt_with_args(
        dir.path(),
        "flag",
        &["make_vocab_size_divisible_by=2147483647"],
    );
    run_ok(&mut convert(
        &load,
        &out,
        &["--make-vocab-size-divisible-by", "8448"],
    ));
}

/// The golden GPT checkpoint exported as a HuggingFace GPT2LMHeadModel into `dir/name`.
fn golden_gpt_as_hf(dir: &Path, name: &str) -> PathBuf {
    let ours = dir.join(format!("{name}_ours"));
    let hf = dir.join(name);
    run_ok(&mut convert(&golden("gpt_torch"), &ours, &[]));
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "megatron-rs",
                "--saver",
                "hf",
                "--load-dir",
            ])
            .arg(&ours)
            .arg("--save-dir")
            .arg(&hf),
    );
    std::fs::remove_dir_all(&ours).unwrap();
    hf
}

#[test]
fn sizes_in_a_huggingface_config_are_checked_against_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let hf = golden_gpt_as_hf(dir.path(), "hf");
    let config_path = hf.join("config.json");
    let original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    assert_eq!(original["n_layer"], 2);
    for (field, value, needles) in [
        (
            "n_head",
            serde_json::json!(0),
            &["config.json: n_head 0 must be positive and divide n_embd"][..],
        ),
        (
            "n_layer",
            serde_json::json!(1_000_000_000),
            &["config.json: n_layer 1000000000 disagrees with the tensors, which hold 2 layers"][..],
        ),
        (
            "n_layer",
            serde_json::json!(-1),
            &["config.json: n_layer -1 must be positive"][..],
        ),
        (
            "vocab_size",
            serde_json::json!(60000),
            &[
                "transformer.wte.weight has shape",
                "config.json implies [60000,",
            ][..],
        ),
    ] {
        let mut config = original.clone();
        config[field] = value;
        std::fs::write(&config_path, config.to_string()).unwrap();
        refused(
            bin("checkpoint_convert")
                .args([
                    "--model-type",
                    "GPT",
                    "--loader",
                    "hf",
                    "--saver",
                    "megatron-rs",
                    "--load-dir",
                ])
                .arg(&hf)
                .arg("--save-dir")
                .arg(&out),
            needles,
            dir.path(),
        );
    }
}

/// The golden Llama checkpoint as ours, recorded as trained with `tokenizer_model`, a
/// HuggingFace tokenizer directory.
fn golden_llama_trained_with(dir: &Path, tokenizer_model: &Path) -> PathBuf {
    let ours = dir.join("llama_ours");
    run_ok(&mut convert(&golden("llama_torch"), &ours, &[]));
    let metadata_path = ours.join("iter_0000003/metadata.json");
    let mut metadata: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&metadata_path).unwrap()).unwrap();
    metadata["args"]["tokenizer_type"] = "HuggingFaceTokenizer".into();
    metadata["args"]["tokenizer_model"] = tokenizer_model.to_str().unwrap().into();
    std::fs::write(&metadata_path, metadata.to_string()).unwrap();
    ours
}

fn export_hf(load: &Path, save: &Path, extra: &[&str]) -> std::process::Output {
    run_ok(
        bin("checkpoint_convert")
            .args([
                "--model-type",
                "GPT",
                "--loader",
                "megatron-rs",
                "--saver",
                "hf",
                "--load-dir",
            ])
            .arg(load)
            .arg("--save-dir")
            .arg(save)
            .args(extra),
    )
}

#[test]
fn hf_llama_export_carries_the_tokenizer_and_stops_at_eos() {
    let dir = tempfile::tempdir().unwrap();
    let python = megatron_e2e::test_python(&["transformers", "tokenizers", "torch"]);
    let script = megatron_e2e::workspace_root().join("tests/fixtures/hf_export_tokenizer.py");
    let tokenizer = dir.path().join("tokenizer");
    run_ok(
        Command::new(&python)
            .arg(&script)
            .arg("make")
            .arg(&tokenizer),
    );
    let ours = golden_llama_trained_with(dir.path(), &tokenizer);
    let export = dir.path().join("hf");
    let out = export_hf(&ours, &export, &[]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"));
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ] {
        assert_eq!(
            std::fs::read(export.join(name)).unwrap(),
            std::fs::read(tokenizer.join(name)).unwrap(),
            "{name}"
        );
    }
    let checked = run_ok(Command::new(&python).arg(&script).arg("check").arg(&export));
    let checked: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    // <s> and </s> are 3 and 4 in this tokenizer (transformers' Llama defaults are 1 and 2).
    assert_eq!(checked["tokenizer"], serde_json::json!([3, 4]));
    assert_eq!(checked["config"], checked["tokenizer"]);
    assert_eq!(checked["generation_config"], checked["tokenizer"]);
    assert_eq!(
        checked["new_tokens"], 1,
        "generate stops at the forced </s>"
    );

    // The recorded tokenizer is gone: a warning names the missing file, and
    // --tokenizer-model points at it instead.
    let moved = dir.path().join("moved");
    let ours = golden_llama_trained_with(&dir.path().join("gone"), &moved.join("nowhere"));
    let bare = dir.path().join("bare");
    let out = export_hf(&ours, &bare, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: tokenizer file") && stderr.contains("nowhere/tokenizer.json"),
        "{stderr}"
    );
    assert!(!bare.join("tokenizer.json").exists());
    let pointed = dir.path().join("pointed");
    export_hf(
        &ours,
        &pointed,
        &["--tokenizer-model", tokenizer.to_str().unwrap()],
    );
    let checked = run_ok(
        Command::new(&python)
            .arg(&script)
            .arg("check")
            .arg(&pointed),
    );
    let checked: serde_json::Value = serde_json::from_slice(&checked.stdout).unwrap();
    assert_eq!(checked["config"], serde_json::json!([3, 4]));
    assert_eq!(checked["new_tokens"], 1);
}

/// The log-probabilities our model gives each token of `prompt` after those before it (PUT /api
/// with `tokens_to_generate` 0), served by `text_generation_server --load load` (a Megatron
/// checkpoint imported on the fly), in float32 on the CPU.
fn served_logprobs(load: &Path, prompt: &str) -> Vec<f64> {
    use std::io::BufRead;
    let mut server = bin("text_generation_server")
        .arg("--load")
        .arg(load)
        .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "8192"])
        .args(["--port", "0", "--device", "cpu"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(server.stdout.take().unwrap()).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("the server exited before serving")
            .unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let body = serde_json::json!({"prompts": [prompt], "tokens_to_generate": 0, "logprobs": true});
    let out = bin("text_generation_cli")
        .arg(&address)
        .args(["--request", &body.to_string()])
        .output()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reply: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    reply["logprobs"][0]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs in {reply}"))
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

/// Megatron's distributed-optimizer checkpoints (torch's distrib_optim.pt, torch_dist's
/// fully_sharded_model_space) export to HuggingFace in one command, --verify included, and
/// transformers loads the export as GPT2LMHeadModel and gives each token of a sequence the
/// log-probability our model gives it from the Megatron checkpoint.
#[test]
fn distributed_optimizer_goldens_export_to_huggingface_in_one_command() {
    let dir = tempfile::tempdir().unwrap();
    let python = megatron_e2e::test_python(&["transformers", "torch"]);
    let ids: Vec<String> = (0..24)
        .map(|i| (37 * i * i + 11 * i + 5) % 4096)
        .map(|i| i.to_string())
        .collect();
    for name in ["distopt_torch", "distopt_torch_dist"] {
        let hf = dir.path().join(name);
        let out = run_ok(
            bin("checkpoint_convert")
                .args(["--model-type", "GPT", "--loader", "core", "--saver", "hf"])
                .arg("--load-dir")
                .arg(golden(name))
                .arg("--save-dir")
                .arg(&hf)
                .arg("--verify"),
        );
        let summary = String::from_utf8_lossy(&out.stdout);
        let verified: f64 = summary
            .split("verify: max |Δ logits| = ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{name}: no verify line in {summary}"))
            .parse()
            .unwrap();
        assert!(verified <= 1e-5, "{name}: {summary}");
        let reference = run_ok(
            Command::new(&python)
                .arg(megatron_e2e::workspace_root().join("tests/fixtures/hf_token_logprobs.py"))
                .arg(&hf)
                .args(&ids),
        );
        let reference: serde_json::Value = serde_json::from_slice(&reference.stdout).unwrap();
        assert_eq!(reference["architecture"], "GPT2LMHeadModel", "{name}");
        let theirs: Vec<f64> = reference["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let ours = served_logprobs(&golden(name), &ids.join(" "));
        assert_eq!(ours.len(), ids.len() - 1, "{name}: {ours:?}");
        let largest = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            largest <= 1e-4,
            "{name}: log-probabilities differ by up to {largest}: ours {ours:?}, transformers' {theirs:?}"
        );
        eprintln!("{name}: largest |Δ logprob| {largest:e}, verify {verified:e}");
    }
}
