//! FP8 GEMMs (`--fp8-format`) train a small GPT like bf16 does: the losses fall and stay close
//! to bf16's step by step, with delayed and with current (tensorwise) scaling, with bf16 layers
//! at the ends, over pipeline stages with full recompute, and with tensor parallelism, where
//! each rank scales its own weight shard (as Transformer Engine does without amax reduction), so
//! TP=2 is close to TP=1 rather than equal.

mod support;

use std::sync::LazyLock;

use megatron_training::GptPretrainArgs;

const STEPS: usize = 20;

/// A 4-layer bf16 GPT whose weight shards are multiples of 16 (fp8 GEMMs need it), trained for
/// `STEPS` steps on mock data.
static BASE: LazyLock<Vec<&str>> = LazyLock::new(|| {
    let mut flags = support::tiny_training(&[support::TINY_MODEL, &["--bf16"]].concat());
    flags.extend(["--train-iters", "20", "--save-interval", "20"]);
    flags
});

/// The bf16 run every fp8 run is compared with, trained once for all tests.
static BF16: LazyLock<Vec<f64>> = LazyLock::new(|| lm_losses(1, &[]));

fn lm_losses(tensor: usize, extra: &[&str]) -> Vec<f64> {
    let world = tensor;
    let losses = support::train::<GptPretrainArgs>(&BASE, world, tensor, 1, extra).lm_losses();
    assert_eq!(losses.len(), STEPS, "{extra:?}: {losses:?}");
    losses
}

/// The run learns (the mean loss of the last five steps is well below the first step's) and
/// each step's loss is within `tolerance` (relative) of the reference run's, yet not equal to
/// it: the GEMMs did run in fp8.
fn assert_tracks(losses: &[f64], reference: &[f64], tolerance: f64, what: &str) {
    eprintln!("{what}: {losses:?}\nreference: {reference:?}");
    assert_ne!(losses, reference, "{what}: fp8 changed nothing");
    let tail: f64 = losses[STEPS - 5..].iter().sum::<f64>() / 5.0;
    assert!(
        tail < losses[0] - 0.2,
        "{what}: loss went from {} to {tail} (mean of the last five steps)",
        losses[0]
    );
    for (step, (ours, theirs)) in losses.iter().zip(reference).enumerate() {
        assert!(
            (ours - theirs).abs() <= tolerance * theirs,
            "{what}: step {} loss {ours}, reference {theirs}\n{losses:?}\n{reference:?}",
            step + 1
        );
    }
}

#[test]
fn fp8_training_tracks_bf16() {
    let bf16 = &*BF16;
    for (extra, what) in [
        (&["--fp8-format", "hybrid"][..], "hybrid, delayed"),
        (
            &["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"][..],
            "hybrid, tensorwise",
        ),
        (
            &[
                "--fp8-format",
                "e4m3",
                "--fp8-amax-history-len",
                "16",
                "--fp8-amax-compute-algo",
                "max",
                "--no-fp8-wgrad",
            ][..],
            "e4m3, delayed over 16 uses, bf16 weight gradients",
        ),
        (
            &[
                "--fp8-format",
                "hybrid",
                "--no-gradient-accumulation-fusion",
            ][..],
            "hybrid, gradients through autograd",
        ),
    ] {
        assert_tracks(&lm_losses(1, extra), bf16, 1e-3, what);
    }
}

#[test]
fn fp8_with_tensor_parallelism_tracks_one_rank() {
    let flags = ["--fp8-format", "hybrid", "--sequence-parallel"];
    let one_rank = lm_losses(1, &flags[..2]);
    assert_tracks(&lm_losses(2, &flags), &one_rank, 1e-3, "TP=2 + SP");
}

/// `--first-last-layers-bf16` keeps the named layers out of fp8: all four kept gives bf16's
/// losses exactly, one at each end still trains in fp8 in between.
#[test]
fn first_and_last_layers_in_bf16() {
    let bf16 = &*BF16;
    let fp8 = ["--fp8-format", "hybrid", "--first-last-layers-bf16"];
    let all_kept = [&fp8[..], &["--num-layers-at-start-in-bf16", "4"]].concat();
    assert_eq!(&lm_losses(1, &all_kept), bf16);
    assert_tracks(
        &lm_losses(1, &fp8),
        bf16,
        1e-3,
        "first and last layer in bf16",
    );
}

/// Pipeline stages enable fp8 in their own layers, fully recomputed layers run their fp8
/// linears again in backward, and data-parallel ranks (each scaling its own micro-batches)
/// reduce their gradients through the overlapped, hook-driven path.
#[test]
fn fp8_with_pipeline_and_data_parallelism_tracks_bf16() {
    let bf16 = &*BF16;
    let flags = [
        "--fp8-format",
        "hybrid",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
    ];
    let losses = support::train::<GptPretrainArgs>(&BASE, 2, 1, 2, &flags).lm_losses();
    assert_tracks(&losses, bf16, 1e-3, "PP=2, full recompute");
    let overlapped = ["--fp8-format", "hybrid", "--overlap-grad-reduce"];
    let losses = support::train::<GptPretrainArgs>(&BASE, 2, 1, 1, &overlapped).lm_losses();
    assert_tracks(&losses, bf16, 1e-3, "DP=2, overlapped gradient reduction");
}

/// The losses of `BASE` with `extra` on CUDA device 0 (one rank).
fn gpu_lm_losses(extra: &[&str]) -> Vec<f64> {
    let flags: Vec<&str> = BASE.iter().chain(extra).copied().collect();
    support::gpu_lm_losses::<GptPretrainArgs>(&flags)
}

/// On a GPU (cuBLASLt's fp8 GEMMs and our cast kernels) fp8 trains like bf16 too, with both
/// recipes and both weight-gradient precisions.
#[test]
fn on_a_gpu_fp8_training_tracks_bf16() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let bf16 = gpu_lm_losses(&[]);
    assert_eq!(bf16.len(), STEPS, "{bf16:?}");
    for extra in [
        &["--fp8-format", "hybrid"][..],
        &["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
        &["--fp8-format", "e4m3", "--no-fp8-wgrad"],
        &[
            "--fp8-format",
            "hybrid",
            "--fp8-amax-history-len",
            "8",
            "--fp8-amax-compute-algo",
            "max",
        ],
    ] {
        let what = extra.join(" ");
        let losses = gpu_lm_losses(extra);
        assert_eq!(losses.len(), STEPS, "{what}: {losses:?}");
        assert_tracks(&losses, &bf16, 5e-3, &what);
    }
}

/// The delayed-scaling state (amax histories, scales) is checkpointed with the model, so a
/// TP=2 + SP fp8 run stopped after two steps and resumed ends as the uninterrupted run, bit for
/// bit (three steps, a history of 4 uses with max).
#[test]
fn an_fp8_run_resumes_bitwise() {
    let mut flags = BASE.clone();
    flags.extend([
        "--train-iters",
        "3",
        "--save-interval",
        "3",
        "--fp8-format",
        "hybrid",
        "--fp8-amax-history-len",
        "4",
        "--fp8-amax-compute-algo",
        "max",
    ]);
    support::check_resuming::<GptPretrainArgs>(&flags);
}
