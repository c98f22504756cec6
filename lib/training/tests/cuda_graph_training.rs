//! `--enable-cuda-graph`: after the warm-up steps each micro-batch's forward and backward is
//! replayed from one CUDA graph. A replay runs the very kernels of an eager step on the same
//! inputs, so a run with graphs must give the losses and weights of the same run without them,
//! bit for bit: with gradient accumulation over micro-batches, the fused loss, dropout (the graph
//! draws the same random numbers as the eager step, attention dropout from the model-parallel
//! stream), fp16 loss scaling, fp8, for BERT, and for Mixture-of-Experts layers whose experts run
//! as grouped GEMMs (their logged auxiliary losses and expert biases included). The same holds
//! for the graphs GPT and BERT runs replay by default, against `--no-cuda-graph`. Settings the
//! graph cannot hold (activation recomputation) train without graphs, and Megatron's graph flags
//! are accepted everywhere.

mod support;

use std::path::Path;

use megatron_training::{BertPretrainArgs, GptPretrainArgs};
use support::{assert_bitwise_identical, Outcome, Pretrain};

/// A 4-layer model, 4 micro-batches of 2 per step, 8 steps: graphs from the third step on.
fn flags(extra: &[&'static str]) -> Vec<&'static str> {
    let mut flags = support::tiny_training(support::TINY_MODEL);
    flags.extend(["--train-iters", "8", "--save-interval", "8"]);
    flags.extend(extra);
    flags
}

const GRAPHS: &[&str] = &["--enable-cuda-graph", "--cuda-graph-warmup-steps", "2"];

/// Trains with `--no-cuda-graph`, with `--enable-cuda-graph` and with neither (the default,
/// graphed after 3 warm-up steps); the last two must equal the first bit for bit.
fn with_and_without_graphs<P: Pretrain>(extra: &[&'static str]) -> (Outcome, Outcome) {
    let eager = support::gpu_train::<P>(&[flags(extra).as_slice(), &["--no-cuda-graph"]].concat());
    let by_default = support::gpu_train::<P>(&flags(extra));
    assert_bitwise_identical(&eager, &by_default);
    let graphed = support::gpu_train::<P>(&[flags(extra).as_slice(), GRAPHS].concat());
    (eager, graphed)
}

#[test]
fn on_a_gpu_graphs_train_bitwise_like_eager() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    for extra in [
        &["--bf16"][..],
        &["--bf16", "--cross-entropy-loss-fusion"],
        &["--bf16", "--hidden-dropout", "0.1"],
        &[
            "--bf16",
            "--hidden-dropout",
            "0.1",
            "--attention-dropout",
            "0.1",
        ],
        &[
            "--fp16",
            "--initial-loss-scale",
            "65536",
            "--loss-scale-window",
            "2",
        ],
        &["--bf16", "--fp8-format", "hybrid"],
    ] {
        let (eager, graphed) = with_and_without_graphs::<GptPretrainArgs>(extra);
        eprintln!("{extra:?}: {:?}", graphed.lm_losses());
        assert_bitwise_identical(&eager, &graphed);
        // fp16 skips the steps whose gradients overflow (and logs no loss for them).
        let losses = graphed.lm_losses();
        assert!(losses.len() >= 6, "{extra:?}: {losses:?}");
        assert!(
            losses[losses.len() - 3..]
                .iter()
                .all(|&l| l < losses[0] - 0.05),
            "{extra:?}: the run did not learn"
        );
    }
    let (eager, graphed) = with_and_without_graphs::<BertPretrainArgs>(&["--bf16"]);
    assert_bitwise_identical(&eager, &graphed);
}

/// The tiny MoE (`support::TINY_MOE`) in bf16, its experts as grouped GEMMs.
fn moe() -> Vec<&'static str> {
    [support::TINY_MOE, &["--bf16", "--moe-grouped-gemm"]].concat()
}

/// The MoE columns of every iteration in the metrics file, as logged.
fn moe_columns(metrics: &Path) -> Vec<Vec<(String, f64)>> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let columns: Vec<(String, f64)> = ["load_balancing_loss", "z_loss"]
                .iter()
                .filter_map(|name| Some((name.to_string(), record.get(*name)?.as_f64()?)))
                .collect();
            (!columns.is_empty()).then_some(columns)
        })
        .collect()
}

/// MoE layers whose experts run as grouped GEMMs keep every count on the device, so their
/// micro-batches replay from graphs: the losses, the logged auxiliary losses (tracked inside
/// the graph) and the weights equal the eager run's bit for bit, with softmax routing and with
/// sigmoid routing steered by expert biases (updated after each step, outside the graph).
#[test]
fn on_a_gpu_moe_graphs_train_bitwise_like_eager() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let expert_bias = [
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "1e-2",
    ];
    for extra in [&[][..], &expert_bias] {
        let runs: Vec<(support::Outcome, Vec<Vec<(String, f64)>>)> =
            [&["--no-cuda-graph"][..], &[][..], GRAPHS]
                .into_iter()
                .map(|graphs| {
                    let dir = tempfile::tempdir().unwrap();
                    let outcome = support::gpu_train_in::<GptPretrainArgs>(
                        dir.path(),
                        &[flags(&moe()).as_slice(), extra, graphs].concat(),
                    );
                    (outcome, moe_columns(&dir.path().join("metrics.jsonl")))
                })
                .collect();
        let (eager, eager_moe) = &runs[0];
        let lm = eager.lm_losses();
        assert_eq!(lm.len(), 8, "{extra:?}: {lm:?}");
        assert!(lm[7] < lm[0], "{extra:?}: the run did not learn: {lm:?}");
        assert_eq!(eager_moe.len(), 8, "{extra:?}: {eager_moe:?}");
        for (outcome, moe) in &runs[1..] {
            eprintln!("{extra:?}: {:?}\n{moe:?}", outcome.lm_losses());
            assert_bitwise_identical(eager, outcome);
            assert_eq!(eager_moe, moe, "{extra:?}: the auxiliary losses");
        }
    }
}

/// Activation recomputation swaps generator states on the host in the backward, which a graph
/// cannot hold: the run warns and trains without graphs, as it would without the flag.
#[test]
fn on_a_gpu_recomputation_trains_without_graphs() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let recompute = [
        "--bf16",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    ];
    let (eager, graphed) = with_and_without_graphs::<GptPretrainArgs>(&recompute);
    assert_bitwise_identical(&eager, &graphed);
}

/// On the CPU the flags of Megatron's CUDA-graph scripts are accepted and change nothing.
#[test]
fn megatron_graph_flags_are_accepted_on_a_cpu() {
    let reference = support::train::<GptPretrainArgs>(&flags(&[]), 1, 1, 1, &[]);
    let extra = [
        "--enable-cuda-graph",
        "--cuda-graph-scope",
        "full_iteration",
        "--cuda-graph-warmup-steps",
        "1",
        "--external-cuda-graph",
    ];
    let graphed = support::train::<GptPretrainArgs>(&flags(&[]), 1, 1, 1, &extra);
    assert_bitwise_identical(&reference, &graphed);
}
