//! Model and data parallelism change where the arithmetic happens, not its result: a small GPT
//! trained for three steps with TP, SP, PP (1F1B and interleaved), DP and the distributed
//! optimizer, ranks as threads, gives the losses and (merged) weights of the one-rank run.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use clap::Parser;
use megatron_core::args::GptPretrainArgs;
use megatron_core::checkpoint::{find_checkpoint, merge_model_parallel_ranks};
use megatron_core::parallel::{ParallelLayout, ParallelState, ThreadWorld};
use megatron_core::training::{pretrain_gpt, Runtime};
use tch::{Device, Tensor};

#[derive(Parser)]
#[command(args_override_self = true)]
struct Flags {
    #[command(flatten)]
    args: GptPretrainArgs,
}

/// A 4-layer GPT on mock data, fp32, no dropout, 4 micro-batches of 2 per step.
const BASE: &[&str] = &[
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "1",
    "--weight-decay",
    "0.1",
    "--clip-grad",
    "1.0",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--adam-eps",
    "1e-4",
    "--log-interval",
    "1",
    "--save-interval",
    "3",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--seed",
    "1234",
];

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

struct Outcome {
    losses: Vec<f64>,
    weights: HashMap<String, Tensor>,
}

fn parse(flags: &[&str], extra: &[String]) -> GptPretrainArgs {
    let argv = std::iter::once("pretrain_gpt".to_string())
        .chain(flags.iter().map(|s| s.to_string()))
        .chain(extra.iter().cloned());
    Flags::try_parse_from(argv).expect("valid flags").args
}

fn losses(metrics: &Path) -> Vec<f64> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            record
                .get("split")
                .is_none()
                .then(|| record["lm loss"].as_f64())
                .flatten()
        })
        .collect()
}

/// Trains with `world` thread ranks in a TP × PP layout and returns the logged losses and the
/// merged weights of the final checkpoint.
fn train(flags: &[&str], world: usize, tensor: usize, pipeline: usize, extra: &[&str]) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    train_in(dir.path(), flags, world, tensor, pipeline, extra).unwrap()
}

/// [`train`] saving under `dir/ckpt` and appending to `dir/metrics.jsonl`.
fn train_in(
    dir: &Path,
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> anyhow::Result<Outcome> {
    let save = dir.join("ckpt");
    let metrics = dir.join("metrics.jsonl");
    let mut more: Vec<String> = vec![
        "--tensor-model-parallel-size".into(),
        tensor.to_string(),
        "--pipeline-model-parallel-size".into(),
        pipeline.to_string(),
        "--save".into(),
        save.display().to_string(),
        "--metrics-file".into(),
        metrics.display().to_string(),
    ];
    more.extend(extra.iter().map(|s| s.to_string()));
    let args = parse(flags, &more);
    let layout = ParallelLayout::new(world, tensor, pipeline).unwrap();
    let threads = ThreadWorld::new(world, Duration::from_secs(120));
    threads.run(|rank| {
        let parallel =
            ParallelState::threads(&threads, layout, rank, args.parallel.sequence_parallel)?;
        pretrain_gpt(
            &args,
            &Runtime {
                parallel,
                device: Device::Cpu,
            },
        )
    })?;
    let checkpoint = find_checkpoint(&save)?.expect("a checkpoint was saved");
    Ok(Outcome {
        losses: losses(&metrics),
        weights: merge_model_parallel_ranks(&checkpoint, Device::Cpu)?,
    })
}

fn assert_equivalent(reference: &Outcome, parallel: &Outcome, what: &str) {
    assert_eq!(
        reference.losses.len(),
        3,
        "{what}: reference logged {:?}",
        reference.losses
    );
    assert_eq!(
        parallel.losses.len(),
        3,
        "{what}: logged {:?}",
        parallel.losses
    );
    for (step, (a, b)) in reference.losses.iter().zip(&parallel.losses).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{what}: loss of step {} is {b}, the one-rank run's {a}",
            step + 1
        );
    }
    let mut names: Vec<&String> = reference.weights.keys().collect();
    names.sort();
    assert_eq!(names, {
        let mut theirs: Vec<&String> = parallel.weights.keys().collect();
        theirs.sort();
        theirs
    });
    for name in names {
        let (a, b) = (&reference.weights[name], &parallel.weights[name]);
        assert_eq!(a.size(), b.size(), "{what}: {name}");
        let scale = a.abs().max().double_value(&[]).max(1e-12);
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(
            diff <= 1e-5 * scale,
            "{what}: {name} differs by {diff:e} (largest weight {scale:e})"
        );
    }
}

fn check(flags: &[&str], world: usize, tensor: usize, pipeline: usize, extra: &[&str], what: &str) {
    let reference = train(flags, 1, 1, 1, &[]);
    assert!(
        reference.losses[2] < reference.losses[0],
        "{what}: the reference run did not learn: {:?}",
        reference.losses
    );
    let parallel = train(flags, world, tensor, pipeline, extra);
    assert_equivalent(&reference, &parallel, what);
}

#[test]
fn tensor_parallel_equals_one_rank() {
    check(BASE, 2, 2, 1, &[], "TP=2");
}

#[test]
fn sequence_parallel_equals_one_rank() {
    check(BASE, 2, 2, 1, &["--sequence-parallel"], "TP=2 + SP");
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
    check(BASE, 2, 1, 2, &[], "PP=2 (1F1B)");
}

#[test]
fn pipeline_interleaved_equals_one_rank() {
    check(
        BASE,
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
    check(BASE, 2, 1, 2, &extra, "PP=2 (1+3 layers), full recompute");
}

#[test]
fn data_parallel_equals_one_rank() {
    check(BASE, 2, 1, 1, &[], "DP=2");
}

#[test]
fn distributed_optimizer_equals_one_rank() {
    check(
        BASE,
        2,
        1,
        1,
        &["--use-distributed-optimizer"],
        "DP=2, distributed optimizer",
    );
}

#[test]
fn tensor_and_pipeline_parallel_equal_one_rank() {
    check(BASE, 4, 2, 2, &[], "TP=2 × PP=2");
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
        BASE,
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
    let straight = train(BASE, 4, 2, 1, &extra);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let first: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["--exit-interval", "2", "--save-interval", "1"])
        .collect();
    train_in(dir.path(), BASE, 4, 2, 1, &first).unwrap();
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
    let resumed = train_in(dir.path(), BASE, 4, 2, 1, &second).unwrap();
    assert_eq!(straight.losses, resumed.losses);
    for (name, tensor) in &straight.weights {
        assert!(
            tensor.equal(&resumed.weights[name]),
            "{name} differs after resuming"
        );
    }

    let other = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(other.path()).unwrap();
    let error = train_in(other.path(), BASE, 2, 1, 1, &["--load", ckpt.as_str()])
        .err()
        .expect("a TP=2 checkpoint refuses TP=1");
    let message = format!("{error:#}");
    assert!(message.contains("TP=2"), "{message}");
}

#[test]
fn overlapped_grad_reduce_equals_one_rank() {
    let small_buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", "20000"];
    check(BASE, 2, 1, 1, &small_buckets, "DP=2, overlapped reduction");
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
        BASE,
        4,
        1,
        2,
        &extra,
        "PP=2 interleaved × DP=2, distributed optimizer, overlapped reduction and gather",
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
        let error = train_in(dir.path(), BASE, 2, 1, 1, flags)
            .err()
            .expect("refused");
        assert!(format!("{error:#}").contains(message), "{error:#}");
    }
}
