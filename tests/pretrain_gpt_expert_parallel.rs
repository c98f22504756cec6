//! `pretrain_gpt` with Mixture-of-Experts layers split over processes (expert parallelism),
//! launched as torchrun launches it: on CPUs over gloo, EP=2 with either dispatcher equals the
//! data-parallel job that holds every expert on every rank; on GPUs over NCCL the same, and
//! EP=4 on four GPUs.

use std::path::Path;
use std::process::Command;

use megatron_e2e::{bin, run_job, visible_gpus, TINY_MOCK_GPT};

/// The tiny GPT with four experts (top-2, load balancing) in each layer.
fn pretrain(device: &[&str], extra: &[&str]) -> Command {
    let mut command = bin("pretrain_gpt");
    command
        .args(TINY_MOCK_GPT)
        .args([
            "--adam-eps",
            "1e-4",
            "--train-iters",
            "3",
            "--disable-bias-linear",
            "--num-experts",
            "4",
            "--moe-router-topk",
            "2",
            "--moe-aux-loss-coeff",
            "1e-2",
        ])
        .args(device)
        .args(extra);
    command
}

/// Runs `world` ranks with `flags`, all of which must succeed; returns the `lm loss` and
/// `load_balancing_loss` of each iteration the last rank logged.
fn run(world: usize, device: &[&str], flags: &[&str], metrics: &Path, what: &str) -> Vec<[f64; 2]> {
    run_job(world, what, |_| {
        let mut command = pretrain(device, flags);
        command.args(["--metrics-file", metrics.to_str().unwrap()]);
        command
    });
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            Some([
                record["lm loss"].as_f64()?,
                record["load_balancing_loss"].as_f64()?,
            ])
        })
        .collect()
}

/// Each layout of `layouts` over `world` ranks equals the data-parallel job over as many.
fn expert_parallel_equals_data_parallel(world: usize, device: &[&str], layouts: &[&[&str]]) {
    let dir = tempfile::tempdir().unwrap();
    let reference = run(world, device, &[], &dir.path().join("dp.jsonl"), "DP");
    assert_eq!(
        reference.len(),
        3,
        "the data-parallel job logged {reference:?}"
    );
    for (i, layout) in layouts.iter().enumerate() {
        let what = layout.join(" ");
        let got = run(
            world,
            device,
            layout,
            &dir.path().join(format!("{i}.jsonl")),
            &what,
        );
        assert_eq!(got.len(), 3, "{what} logged {got:?}");
        for (a, b) in reference.iter().flatten().zip(got.iter().flatten()) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{what}: {got:?} against the data-parallel job's {reference:?}"
            );
        }
        eprintln!("{what}: {got:?}");
    }
}

const CPU: &[&str] = &["--device", "cpu", "--distributed-backend", "gloo"];
const GPU: &[&str] = &["--device", "cuda", "--distributed-backend", "nccl"];

fn over(ranks: &'static str, dispatcher: &'static str) -> [&'static str; 4] {
    [
        "--expert-model-parallel-size",
        ranks,
        "--moe-token-dispatcher-type",
        dispatcher,
    ]
}

#[test]
fn two_cpu_processes_with_expert_parallelism_equal_data_parallelism() {
    expert_parallel_equals_data_parallel(
        2,
        CPU,
        &[&over("2", "alltoall"), &over("2", "allgather")],
    );
}

/// On two GPUs over NCCL (grouped send/recv for the all-to-all); runs where there are two.
#[test]
fn two_gpus_with_expert_parallelism_equal_data_parallelism() {
    if visible_gpus() < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    expert_parallel_equals_data_parallel(
        2,
        GPU,
        &[&over("2", "alltoall"), &over("2", "allgather")],
    );
}

/// EP=4 and EP=2 × DP=2 on four GPUs, with the distributed optimizer; runs where there are
/// four.
#[test]
fn four_gpus_with_expert_parallelism_equal_data_parallelism() {
    if visible_gpus() < 4 {
        eprintln!("skipped: needs 4 GPUs");
        return;
    }
    let distributed = "--use-distributed-optimizer";
    let ep4 = [&over("4", "alltoall")[..], &[distributed]].concat();
    let ep2 = [&over("2", "alltoall")[..], &[distributed]].concat();
    expert_parallel_equals_data_parallel(4, GPU, &[&ep4, &ep2]);
}
