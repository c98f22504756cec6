//! Context parallelism splits each sequence over ranks without changing the arithmetic's
//! result: a small GPT (and a Llama-style one) trained for three steps with CP = 2 and 4, each
//! `--cp-comm-type`, with tensor and pipeline parallelism and the distributed optimizer, ranks
//! as threads, logs the one-rank run's losses and gradient norms and ends with its weights
//! (within 1e-5); checkpoints move between CP sizes, which do not change their shards.

mod support;

use std::path::Path;
use std::sync::LazyLock;

use megatron_training::GptPretrainArgs;

/// A 4-layer GPT (learned absolute positions) on mock data, fp32, no dropout, 4 micro-batches
/// of 2 per step, sequences of 32.
static BASE: LazyLock<Vec<&str>> = LazyLock::new(|| {
    support::tiny_training(
        &[
            support::TINY_MODEL,
            &["--min-lr", "1e-4", "--lr-decay-style", "cosine"],
        ]
        .concat(),
    )
});

/// Llama-style: RoPE, SwiGLU, RMSNorm, grouped-query attention, untied output, no biases.
static LLAMA: LazyLock<Vec<&str>> = LazyLock::new(|| {
    [
        BASE.as_slice(),
        &[
            "--swiglu",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ],
    ]
    .concat()
});

const COMM_TYPES: [&str; 3] = ["p2p", "allgather", "a2a"];

/// A run's outcome with the gradient norm of every step.
struct Run {
    outcome: support::Outcome,
    grad_norms: Vec<f64>,
}

fn grad_norms(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            record.get("grad-norm")?.as_f64()
        })
        .collect()
}

fn run(flags: &[&str], world: usize, tensor: usize, pipeline: usize, extra: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let outcome =
        support::train_in::<GptPretrainArgs>(dir.path(), flags, world, tensor, pipeline, extra)
            .unwrap();
    Run {
        outcome,
        grad_norms: grad_norms(&dir.path().join("metrics.jsonl")),
    }
}

fn assert_same(reference: &Run, parallel: &Run, what: &str) {
    support::assert_equivalent(&reference.outcome, &parallel.outcome, what);
    assert_eq!(
        reference.grad_norms.len(),
        3,
        "{what}: {:?}",
        reference.grad_norms
    );
    assert_eq!(
        parallel.grad_norms.len(),
        3,
        "{what}: {:?}",
        parallel.grad_norms
    );
    for (step, (a, b)) in reference
        .grad_norms
        .iter()
        .zip(&parallel.grad_norms)
        .enumerate()
    {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{what}: grad norm of step {} is {b}, the reference's {a}",
            step + 1
        );
    }
}

fn context(size: &'static str, comm: &'static str) -> Vec<&'static str> {
    vec!["--context-parallel-size", size, "--cp-comm-type", comm]
}

/// `a2a+p2p` over 4 ranks: a2a within pairs, p2p across them.
const HIERARCHICAL: [&str; 7] = [
    "--context-parallel-size",
    "4",
    "--cp-comm-type",
    "a2a+p2p",
    "--hierarchical-context-parallel-sizes",
    "2",
    "2",
];

/// CP = 2 and CP = 4 with each exchange, and `a2a+p2p` at CP = 2 × 2, equal the one-rank run.
fn check_every_exchange(flags: &[&str], model: &str) {
    let reference = run(flags, 1, 1, 1, &[]);
    let lm = reference.outcome.lm_losses();
    assert!(
        lm[2] < lm[0],
        "{model}: the reference did not learn: {lm:?}"
    );
    for comm in COMM_TYPES {
        for size in ["2", "4"] {
            let world = size.parse().unwrap();
            let parallel = run(flags, world, 1, 1, &context(size, comm));
            assert_same(&reference, &parallel, &format!("{model}, CP={size} {comm}"));
        }
    }
    let hierarchical = run(flags, 4, 1, 1, &HIERARCHICAL);
    assert_same(
        &reference,
        &hierarchical,
        &format!("{model}, CP=2×2 a2a+p2p"),
    );
}

#[test]
fn gpt_context_parallel_equals_one_rank() {
    check_every_exchange(&BASE, "GPT");
}

#[test]
fn llama_context_parallel_equals_one_rank() {
    check_every_exchange(&LLAMA, "Llama-style");
}

/// CP = 2 × TP = 2 (with sequence parallelism) equals TP = 2, each exchange.
#[test]
fn context_and_tensor_parallel_equal_tensor_parallel() {
    let sequence_parallel = ["--sequence-parallel"];
    let reference = run(&LLAMA, 2, 2, 1, &sequence_parallel);
    for comm in COMM_TYPES {
        let flags = [context("2", comm).as_slice(), &sequence_parallel].concat();
        let parallel = run(&LLAMA, 4, 2, 1, &flags);
        assert_same(&reference, &parallel, &format!("TP=2 CP=2 {comm}"));
    }
}

/// CP = 2 × PP = 2 with data parallelism and the distributed optimizer equals one rank: the
/// gradients are averaged, and the optimizer sharded, over data × context.
#[test]
fn context_parallel_composes_with_pipeline_data_and_distributed_optimizer() {
    let reference = run(&BASE, 1, 1, 1, &[]);
    let flags = [
        context("2", "p2p").as_slice(),
        &["--use-distributed-optimizer"],
    ]
    .concat();
    let parallel = run(&BASE, 8, 1, 2, &flags);
    assert_same(
        &reference,
        &parallel,
        "CP=2 PP=2 DP=2, distributed optimizer",
    );
}

/// A checkpoint saved under CP = 2 resumes at CP = 1 and one saved at CP = 1 resumes under
/// CP = 2, each ending as the uninterrupted run: context parallelism does not change what a
/// rank saves (every context-parallel rank holds the whole model of its tensor and pipeline
/// rank, and one of them writes it).
#[test]
fn checkpoints_move_between_context_parallel_sizes() {
    let straight = run(&LLAMA, 1, 1, 1, &[]);
    let stop_after_two = ["--exit-interval", "2", "--save-interval", "1"];
    for (first, then) in [(2, 1), (1, 2)] {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = dir.path().join("ckpt").display().to_string();
        let size = |cp: usize| if cp == 2 { "2" } else { "1" };
        let first_flags = [context(size(first), "p2p").as_slice(), &stop_after_two].concat();
        support::train_in::<GptPretrainArgs>(dir.path(), &LLAMA, first, 1, 1, &first_flags)
            .unwrap();
        let resume = [context(size(then), "p2p").as_slice(), &["--load", &ckpt]].concat();
        let resumed =
            support::train_in::<GptPretrainArgs>(dir.path(), &LLAMA, then, 1, 1, &resume).unwrap();
        let what = format!("saved at CP={first}, resumed at CP={then}");
        assert_eq!(resumed.losses.len(), 3, "{what}: {:?}", resumed.losses);
        support::assert_equivalent(&straight.outcome, &resumed, &what);
    }
}

fn parse_error(extra: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let world = 2;
    let error = support::train_in::<GptPretrainArgs>(dir.path(), &BASE, world, 1, 1, extra)
        .err()
        .expect("refused");
    format!("{error:#}")
}

#[test]
fn what_context_parallelism_cannot_run_is_refused_by_name() {
    let uneven = parse_error(&[
        "--context-parallel-size",
        "2",
        "--seq-length",
        "30",
        "--max-position-embeddings",
        "30",
    ]);
    assert!(
        uneven.contains("--seq-length 30 is not divisible by 2 × --context-parallel-size 2"),
        "{uneven}"
    );
    let experts = parse_error(&[
        "--context-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--disable-bias-linear",
    ]);
    assert!(
        experts.contains("--num-experts is not supported yet"),
        "{experts}"
    );
    let graphs = parse_error(&["--context-parallel-size", "2", "--enable-cuda-graph"]);
    assert!(
        graphs.contains("--enable-cuda-graph is not supported"),
        "{graphs}"
    );
    let hierarchical = parse_error(&["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"]);
    assert!(
        hierarchical.contains("a2a+p2p needs --hierarchical-context-parallel-sizes"),
        "{hierarchical}"
    );
    let levels = parse_error(&[
        "--context-parallel-size",
        "2",
        "--hierarchical-context-parallel-sizes",
        "2",
        "2",
    ]);
    assert!(
        levels.contains("their product is not --context-parallel-size 2"),
        "{levels}"
    );
    let heads = parse_error(&[
        "--context-parallel-size",
        "2",
        "--cp-comm-type",
        "a2a",
        "--num-attention-heads",
        "1",
    ]);
    assert!(
        heads.contains("1 heads per rank are not divisible by the 2 ranks that trade heads"),
        "{heads}"
    );
}
