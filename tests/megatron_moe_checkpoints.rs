//! Megatron's Mixture-of-Experts checkpoints (../shared/golden/megatron_checkpoints `moe_torch`,
//! `moe_torch_dist`: 4 experts top-2 over EP=2 × DP=4, distributed optimizer, iteration 5 of 10)
//! read by `checkpoint_convert --loader core` and `pretrain_gpt --load`, and continued here at
//! EP=1; checkpoints whose experts disagree with their args refused by name.

use std::path::{Path, PathBuf};
use std::process::Command;

use megatron_e2e::{
    bin, distances, megatron_log, resume_pretrain_gpt, run_ok, test_python, workspace_root, Logged,
    Step,
};

fn golden(name: &str) -> PathBuf {
    megatron_e2e::shared_dir()
        .join("golden/megatron_checkpoints")
        .join(name)
}

fn convert(load: &Path, save: &Path) -> Command {
    let mut command = bin("checkpoint_convert");
    command
        .args(["--model-type", "GPT", "--loader", "core", "--saver"])
        .arg("megatron-rs")
        .arg("--load-dir")
        .arg(load)
        .arg("--save-dir")
        .arg(save);
    command
}

/// The MoE goldens' pretrain_gpt.py flags (their README), on CPU ranks at EP=1.
fn moe_run_flags() -> Vec<&'static str> {
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
        "8",
        "--train-iters",
        "10",
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "2",
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
        "--use-distributed-optimizer",
        "--disable-bias-linear",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        "128",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--moe-router-load-balancing-type",
        "aux_loss",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--device",
        "cpu",
        "--distributed-backend",
        "gloo",
    ]
}

/// What the MoE goldens' logs are compared by.
const LOGGED: [Logged; 3] = [Logged::LmLoss, Logged::LoadBalancingLoss, Logged::GradNorm];

/// Megatron's log of the golden `name`.
fn golden_log(name: &str) -> Vec<Step> {
    megatron_log(&golden(&format!("{name}.train.txt")), &LOGGED)
}

/// pretrain_gpt with the goldens' flags and `extra`, resumed from `load` by `ranks` data-parallel
/// CPU processes: its logged iterations, which continue Megatron's after iteration 5.
fn resume(load: &Path, ranks: usize, extra: &[&str], dir: &Path) -> Vec<Step> {
    let flags = [moe_run_flags().as_slice(), extra].concat();
    resume_pretrain_gpt(load, ranks, &flags, &LOGGED, 6..=10, dir)
}

/// Megatron's MoE runs (torch: one `mp_rank_00_EEE` folder per expert-parallel rank with its
/// `distrib_optim.pt`; torch_dist: experts as global tensors with an expert axis, the optimizer
/// in `fully_sharded_model_space`) continue here at EP=1 on four data-parallel CPU ranks, as
/// Megatron's four GPUs were, loaded directly.
///
/// Megatron's run had dropout 0.1, whose masks come from the GPU's generator: on these weights
/// dropout alone moves the loss by about 1e-2, so the 2e-3 is checked where no dropout
/// mask enters, iteration 6 resumed without dropout: its loss is the imported weights' forward on
/// Megatron's batch (measured 4e-4 from Megatron's) and its gradient norm within 3% (0.6%).
/// With the golden's own dropout, iterations 6–10 stay within that noise (measured: 9.8e-3 at
/// most, 3.8e-3 on average) and the load-balancing loss within 2e-3 (9.5e-4), and without the
/// optimizer state the losses drift away.
#[test]
fn pretrain_gpt_continues_megatrons_moe_runs() {
    let dir = tempfile::tempdir().unwrap();
    let logged = golden_log("moe_torch");
    assert_eq!(
        logged,
        golden_log("moe_torch_dist"),
        "one run in two formats"
    );
    for name in ["moe_torch", "moe_torch_dist"] {
        let ours = resume(
            &golden(name),
            4,
            &["--hidden-dropout", "0", "--attention-dropout", "0"],
            dir.path(),
        );
        let [lm, _, norm] = &distances(&ours[..1], &logged)[..] else {
            unreachable!("three values are logged")
        };
        let (first, norm) = (lm.largest, norm.largest_relative);
        eprintln!(
            "{name} without dropout: iteration 6 lm loss {first} from Megatron's, grad norm {norm}"
        );
        assert!(
            first <= 2e-3 && norm <= 0.03,
            "{name}: iteration 6 lm loss {first} and grad norm {norm} (relative) from Megatron's: {ours:?}"
        );
        let ours = resume(&golden(name), 4, &[], dir.path());
        let [lm, balance, _] = &distances(&ours, &logged)[..] else {
            unreachable!("three values are logged")
        };
        let (mean, lm, balance) = (lm.mean, lm.largest, balance.largest);
        eprintln!(
            "{name}: lm loss within {lm} (mean {mean}), load_balancing_loss within {balance}"
        );
        assert!(
            lm <= 1.5e-2 && mean <= 5e-3 && balance <= 2e-3,
            "{name}: lm loss {lm} (mean {mean}) and load_balancing_loss {balance} from Megatron's at most: {ours:?}"
        );
    }
    let fresh = resume(&golden("moe_torch"), 4, &["--no-load-optim"], dir.path());
    let lm = &distances(&fresh, &logged)[0];
    let (lm, mean) = (lm.largest, lm.mean);
    eprintln!("fresh optimizer: lm loss within {lm} (mean {mean})");
    assert!(
        mean > 7e-3,
        "a fresh optimizer should drift from Megatron's losses, not {mean} on average: {fresh:?}"
    );
}

/// A copy of the golden `name` (iteration 5) under `dir/label` whose args (in the first rank's
/// file, or torch_dist's common.pt, which is where they are read) have integer entries replaced;
/// the other files are links to the golden's.
fn golden_with_args(dir: &Path, name: &str, label: &str, changes: &[&str]) -> PathBuf {
    let root = dir.join(label);
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "5").unwrap();
    let source = golden(name).join("iter_0000005");
    let target = root.join("iter_0000005");
    let edited = match name {
        "moe_torch" => "mp_rank_00_000/model_optim_rng.pt",
        _ => "common.pt",
    };
    for entry in walk(&source) {
        let relative = entry.strip_prefix(&source).unwrap();
        let copy = target.join(relative);
        std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
        if relative == Path::new(edited) {
            run_ok(
                Command::new(test_python(&["pickletools"]))
                    .arg(workspace_root().join("tests/fixtures/edit_megatron_args.py"))
                    .arg(&entry)
                    .arg(&copy)
                    .args(changes),
            );
        } else {
            std::os::unix::fs::symlink(&entry, &copy).unwrap();
        }
    }
    root
}

/// The files under `directory`, recursively.
fn walk(directory: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(directory).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// Checkpoints whose experts disagree with their args, or whose experts do not divide over
/// their expert-parallel ranks, are refused with the tensor or field named and nothing written.
#[test]
fn moe_checkpoints_whose_experts_disagree_with_their_args_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (name, change, needles) in [
        (
            "moe_torch",
            "num_experts=8",
            &[
                "layer 0 has 4 routed experts",
                "decoder.layers.0.mlp.experts.local_experts.*",
                "num_experts is 8",
            ][..],
        ),
        (
            "moe_torch",
            "num_experts=3",
            &["num_experts 3 is not divisible by the 2 expert-parallel ranks"][..],
        ),
        (
            "moe_torch",
            "expert_model_parallel_size=4",
            &[
                "2 expert-parallel rank(s)",
                "expert_model_parallel_size is 4",
            ][..],
        ),
        (
            "moe_torch_dist",
            "num_experts=8",
            &[
                "tensor decoder.layers.mlp.experts.experts.linear_fc1.weight",
                "4 experts, the args' num_experts is 8",
            ][..],
        ),
    ] {
        let label = format!("{name}-{}", change.replace('=', "-"));
        let load = golden_with_args(dir.path(), name, &label, &[change]);
        let save = dir.path().join(format!("{label}-converted"));
        let out = convert(&load, &save).output().unwrap();
        let error = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{label}: {error}");
        for needle in needles {
            assert!(
                error.contains(needle),
                "{label}: {needle:?} not in: {error}"
            );
        }
        assert!(!error.contains("panicked"), "{error}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("converted"))
            .collect();
        assert!(left.is_empty(), "{label}: left behind: {left:?}");
    }
}

/// Every `*.safetensors` file under `directory`, by path relative to it, with its bytes.
fn safetensors_files(directory: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut files: Vec<_> = walk(directory)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p.strip_prefix(directory).unwrap().to_path_buf(), bytes)
        })
        .collect();
    files.sort();
    files
}

/// Megatron's expert-parallel MoE checkpoint written back as Megatron's torch format at its
/// layout (`--target-expert-parallel-size 2`): the same `mp_rank_00_EEE` folders, each with the
/// same model entries in Megatron's order, its own experts numbered from 0, bit for bit, and
/// the same MoE args; and the export, read again, gives the same weights and optimizer state
/// as the golden itself (the chained optimizer's dense and expert states round trip).
#[test]
fn moe_torch_export_matches_megatrons_expert_parallel_layout() {
    let dir = tempfile::tempdir().unwrap();
    let exported = dir.path().join("exported");
    let mut export = bin("checkpoint_convert");
    export
        .args(["--model-type", "GPT", "--loader", "core", "--saver", "core"])
        .args(["--target-expert-parallel-size", "2"])
        .arg("--load-dir")
        .arg(golden("moe_torch"))
        .arg("--save-dir")
        .arg(&exported);
    run_ok(&mut export);
    let out = run_ok(
        Command::new(test_python(&["torch"]))
            .arg(workspace_root().join("tests/fixtures/compare_megatron_torch.py"))
            .arg(exported.join("iter_0000005"))
            .arg(golden("moe_torch/iter_0000005"))
            .args([
                "num_experts",
                "moe_ffn_hidden_size",
                "moe_router_topk",
                "expert_model_parallel_size",
            ]),
    );
    let compared = String::from_utf8_lossy(&out.stdout);
    for rank in ["mp_rank_00_000", "mp_rank_00_001"] {
        assert!(
            compared.contains(&format!("{rank}: 39 entries equal")),
            "{compared}"
        );
    }
    let direct = dir.path().join("direct");
    let again = dir.path().join("again");
    run_ok(&mut convert(&golden("moe_torch"), &direct));
    run_ok(&mut convert(&exported, &again));
    let (direct, again) = (safetensors_files(&direct), safetensors_files(&again));
    assert!(
        direct.len() >= 2,
        "{:?}",
        direct.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert_eq!(
        direct.iter().map(|f| &f.0).collect::<Vec<_>>(),
        again.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    for ((name, a), (_, b)) in direct.iter().zip(&again) {
        assert!(a == b, "{} differs after the round trip", name.display());
    }
}

/// The two goldens are one deterministic run saved in both formats: imported (weights and the
/// distributed optimizer's state: torch's per-expert-rank `distrib_optim.pt` lists, torch_dist's
/// `fully_sharded_model_space` with an expert axis) they give the same bytes, every expert in
/// its place.
#[test]
fn moe_goldens_import_alike_from_torch_and_torch_dist() {
    let dir = tempfile::tempdir().unwrap();
    let mut imported = Vec::new();
    for name in ["moe_torch", "moe_torch_dist"] {
        let save = dir.path().join(name);
        let out = run_ok(&mut convert(&golden(name), &save));
        let summary = String::from_utf8_lossy(&out.stdout);
        assert!(
            summary.contains("34 tensors with optimizer state"),
            "{summary}"
        );
        imported.push(safetensors_files(&save));
    }
    let names =
        |files: &[(PathBuf, Vec<u8>)]| files.iter().map(|f| f.0.clone()).collect::<Vec<_>>();
    assert_eq!(
        names(&imported[0]),
        vec![
            PathBuf::from("iter_0000005/mp_rank_00/model.safetensors"),
            PathBuf::from("iter_0000005/mp_rank_00/optimizer.safetensors"),
        ]
    );
    assert_eq!(names(&imported[0]), names(&imported[1]));
    for ((name, a), (_, b)) in imported[0].iter().zip(&imported[1]) {
        assert!(a == b, "{} differs between the formats", name.display());
    }
}
