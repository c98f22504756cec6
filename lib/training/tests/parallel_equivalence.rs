//! Model and data parallelism change where the arithmetic happens, not its result: a small GPT
//! trained for three steps with TP, SP, PP (1F1B and interleaved), DP and the distributed
//! optimizer, ranks as threads, gives the losses and (merged) weights of the one-rank run
//! (within 1e-5: splitting a GEMM's inner dimension or summing over ranks rounds differently).

mod support;

use std::sync::LazyLock;

use megatron_training::GptPretrainArgs;

/// A 4-layer GPT on mock data, fp32, no dropout, 4 micro-batches of 2 per step, cosine decay.
static BASE: LazyLock<Vec<&str>> = LazyLock::new(|| {
    support::tiny_training(
        &[
            support::TINY_MODEL,
            &["--min-lr", "1e-4", "--lr-decay-style", "cosine"],
        ]
        .concat(),
    )
});

/// A Llama-style variant: SwiGLU (strided fc1 split), grouped-query attention, RoPE, RMSNorm,
/// untied output layer, no biases.
const LLAMA_LIKE: &[&str] = &[
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
];

fn train(
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> support::Outcome {
    support::train::<GptPretrainArgs>(flags, world, tensor, pipeline, extra)
}

fn train_in(
    dir: &std::path::Path,
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> anyhow::Result<support::Outcome> {
    support::train_in::<GptPretrainArgs>(dir, flags, world, tensor, pipeline, extra)
}

fn check(flags: &[&str], world: usize, tensor: usize, pipeline: usize, extra: &[&str], what: &str) {
    support::check::<GptPretrainArgs>(flags, world, tensor, pipeline, extra, what);
}

#[test]
fn tensor_parallel_equals_one_rank() {
    check(&BASE, 2, 2, 1, &[], "TP=2");
}

/// Every run here fuses gradient accumulation (the default); the unfused path must agree,
/// with tensor and sequence parallelism too.
#[test]
fn gradient_accumulation_fusion_equals_separate_gradients() {
    let unfused = ["--no-gradient-accumulation-fusion"];
    let reference = train(&BASE, 1, 1, 1, &unfused);
    support::assert_equivalent(&reference, &train(&BASE, 1, 1, 1, &[]), "fused, one rank");
    let sequence_parallel = ["--sequence-parallel"];
    support::assert_equivalent(
        &reference,
        &train(&BASE, 2, 2, 1, &sequence_parallel),
        "fused, TP=2 + SP",
    );
}

/// `--cross-entropy-loss-fusion` (the chunked output layer + cross entropy) trains as the
/// unfused loss: tied output weights on one rank, with TP=2 + SP (vocab-parallel reductions per
/// chunk) and split over two pipeline stages (the last stage's copy of the embeddings); an
/// untied output layer with TP=2 + SP; without gradient-accumulation fusion; and with data
/// parallelism's overlapped reduction.
#[test]
fn cross_entropy_loss_fusion_equals_the_unfused_loss() {
    let reference = train(&BASE, 1, 1, 1, &[]);
    let fused = "--cross-entropy-loss-fusion";
    support::assert_equivalent(
        &reference,
        &train(&BASE, 1, 1, 1, &[fused]),
        "fused, one rank",
    );
    support::assert_equivalent(
        &reference,
        &train(&BASE, 2, 2, 1, &[fused, "--sequence-parallel"]),
        "fused, TP=2 + SP",
    );
    support::assert_equivalent(
        &reference,
        &train(
            &BASE,
            2,
            1,
            2,
            &[fused, "--cross-entropy-fusion-impl", "te"],
        ),
        "fused (te), PP=2",
    );
    support::assert_equivalent(
        &reference,
        &train(
            &BASE,
            1,
            1,
            1,
            &[fused, "--no-gradient-accumulation-fusion"],
        ),
        "fused, separate gradients",
    );
    // Overlapped reduction counts the layers' additions into the main-gradient views.
    support::assert_equivalent(
        &reference,
        &train(
            &BASE,
            2,
            1,
            1,
            &[fused, "--overlap-grad-reduce", "--ddp-bucket-size", "20000"],
        ),
        "fused, DP=2, overlapped reduction",
    );
    let untied: Vec<&str> = BASE.iter().chain(LLAMA_LIKE).copied().collect();
    support::assert_equivalent(
        &train(&untied, 1, 1, 1, &[]),
        &train(&untied, 2, 2, 1, &[fused, "--sequence-parallel"]),
        "fused, untied, TP=2 + SP",
    );
}

#[test]
fn sequence_parallel_equals_one_rank() {
    check(&BASE, 2, 2, 1, &["--sequence-parallel"], "TP=2 + SP");
}

#[test]
fn tensor_parallel_llama_variant_equals_one_rank() {
    let flags: Vec<&str> = BASE.iter().chain(LLAMA_LIKE).copied().collect();
    check(
        &flags,
        2,
        2,
        1,
        &["--sequence-parallel"],
        "TP=2 + SP, SwiGLU/GQA/RoPE/RMSNorm",
    );
}

#[test]
fn pipeline_1f1b_equals_one_rank() {
    check(&BASE, 2, 1, 2, &[], "PP=2 (1F1B)");
}

#[test]
fn pipeline_interleaved_equals_one_rank() {
    check(
        &BASE,
        2,
        1,
        2,
        &["--num-layers-per-virtual-pipeline-stage", "1"],
        "PP=2 interleaved (2 virtual stages)",
    );
}

#[test]
fn uneven_pipeline_with_recompute_equals_one_rank() {
    let extra = [
        "--decoder-first-pipeline-num-layers",
        "1",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    check(&BASE, 2, 1, 2, &extra, "PP=2 (1+3 layers), full recompute");
}

#[test]
fn data_parallel_equals_one_rank() {
    check(&BASE, 2, 1, 1, &[], "DP=2");
}

#[test]
fn distributed_optimizer_equals_one_rank() {
    check(
        &BASE,
        2,
        1,
        1,
        &["--use-distributed-optimizer"],
        "DP=2, distributed optimizer",
    );
}

#[test]
fn tensor_and_pipeline_parallel_equal_one_rank() {
    check(&BASE, 4, 2, 2, &[], "TP=2 × PP=2");
}

#[test]
fn all_dimensions_together_equal_one_rank() {
    let extra = [
        "--sequence-parallel",
        "--use-distributed-optimizer",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
    ];
    check(
        &BASE,
        8,
        2,
        2,
        &extra,
        "TP=2 + SP × PP=2 interleaved × DP=2, distributed optimizer",
    );
}

#[test]
fn sharded_checkpoints_resume_in_their_layout_and_refuse_another() {
    let extra = ["--use-distributed-optimizer"];
    let straight = train(&BASE, 4, 2, 1, &extra);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let first: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["--exit-interval", "2", "--save-interval", "1"])
        .collect();
    train_in(dir.path(), &BASE, 4, 2, 1, &first).unwrap();
    let rank_files = std::fs::read_dir(dir.path().join("ckpt/iter_0000002/mp_rank_01"))
        .unwrap()
        .count();
    assert_eq!(
        rank_files, 4,
        "model, rng and one optimizer shard per data-parallel rank"
    );
    let second: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["--load", ckpt.as_str()])
        .collect();
    let resumed = train_in(dir.path(), &BASE, 4, 2, 1, &second).unwrap();
    support::assert_bitwise_identical(&straight, &resumed);

    let other = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(other.path()).unwrap();
    let error = train_in(other.path(), &BASE, 2, 1, 1, &["--load", ckpt.as_str()])
        .err()
        .expect("a TP=2 checkpoint refuses TP=1");
    let message = format!("{error:#}");
    assert!(message.contains("TP=2"), "{message}");
}

#[test]
fn overlapped_grad_reduce_equals_one_rank() {
    let small_buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"];
    check(&BASE, 2, 1, 1, &small_buckets, "DP=2, overlapped reduction");
    let extra: Vec<&str> = small_buckets
        .iter()
        .copied()
        .chain([
            "--use-distributed-optimizer",
            "--overlap-param-gather",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ])
        .collect();
    check(
        &BASE,
        4,
        1,
        2,
        &extra,
        "PP=2 interleaved × DP=2, distributed optimizer, overlapped reduction and gather",
    );
}

/// The 4-rank layouts of the 4-GPU measurements, ranks as CPU threads: TP=4 (one head per
/// rank), and DP=4 with everything data parallelism overlaps (one micro-batch per rank per step).
/// TP=2 × PP=2 is `tensor_and_pipeline_parallel_equal_one_rank`.
#[test]
fn four_ranks_equal_one_rank() {
    check(&BASE, 4, 4, 1, &["--sequence-parallel"], "TP=4 + SP");
    let overlapped = [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "20000",
    ];
    check(
        &BASE,
        4,
        1,
        1,
        &overlapped,
        "DP=4, distributed optimizer, overlapped reduction and gather",
    );
}

#[test]
fn overlap_param_gather_needs_the_distributed_optimizer_and_overlapped_reduction() {
    let dir = tempfile::tempdir().unwrap();
    for (flags, message) in [
        (
            &["--overlap-param-gather", "--overlap-grad-reduce"][..],
            "--overlap-param-gather only supported with distributed optimizer",
        ),
        (
            &["--overlap-param-gather", "--use-distributed-optimizer"][..],
            "--overlap-grad-reduce should be turned on when using --overlap-param-gather",
        ),
    ] {
        let error = train_in(dir.path(), &BASE, 2, 1, 1, flags)
            .err()
            .expect("refused");
        assert!(format!("{error:#}").contains(message), "{error:#}");
    }
}
