//! What the equivalence tests of every model family share: a run of a pretraining entry point
//! with ranks as threads, the losses it logged and its merged weights, and the comparison of a
//! parallel run with the one-rank run; and (in [`reference`]) the Python reference scripts the
//! parity tests compare against.

// Every test crate that declares `mod support` uses only part of it.
#![allow(dead_code)]

pub mod reference;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};
use megatron_parallel::Placement;
use megatron_parallel::{ParallelLayout, ParallelState, ThreadWorld};
use megatron_store::{find_checkpoint, merge_model_parallel_ranks};
use megatron_training::{pretrain_bert, pretrain_gpt, TrainingSummary};
use megatron_training::{t5_flags, BertPretrainArgs, GptPretrainArgs, T5PretrainArgs};
use tch::{Device, Tensor};

/// A binary's flags `A` alone, parsed as the binary parses them (a later flag overrides an
/// earlier one).
#[derive(clap::Parser)]
#[command(args_override_self = true)]
pub struct Flags<A: clap::Args> {
    #[command(flatten)]
    args: A,
}

/// `argv` (program name first) parsed as `A`.
pub fn parse_flags<A: clap::Args>(argv: Vec<String>) -> A {
    Flags::<A>::try_parse_from(argv).expect("valid flags").args
}

/// `argv` (program name first) parsed as `pretrain_t5` does, with Megatron's T5 flags.
pub fn parse_t5_flags(argv: Vec<String>) -> T5PretrainArgs {
    let matches = t5_flags(Flags::<T5PretrainArgs>::command())
        .try_get_matches_from(argv)
        .expect("valid flags");
    Flags::<T5PretrainArgs>::from_arg_matches(&matches)
        .expect("valid flags")
        .args
}

/// A pretraining binary's flags and entry point, as the tests drive it.
pub trait Pretrain: Sized + Sync {
    /// Parses `argv` (program name first) as the binary would.
    fn parse(argv: Vec<String>) -> Self;
    fn sequence_parallel(&self) -> bool;
    /// `--context-parallel-size`, for the layout of the ranks.
    fn context_parallel(&self) -> usize {
        1
    }
    /// `--expert-model-parallel-size` of a model with Mixture-of-Experts layers.
    fn expert_parallel(&self) -> Option<usize> {
        None
    }
    fn run(&self, placement: &Placement) -> anyhow::Result<TrainingSummary>;
}

impl Pretrain for GptPretrainArgs {
    fn parse(argv: Vec<String>) -> Self {
        parse_flags(argv)
    }

    fn sequence_parallel(&self) -> bool {
        self.parallel.sequence_parallel
    }

    fn context_parallel(&self) -> usize {
        self.parallel.context_parallel_size
    }

    fn expert_parallel(&self) -> Option<usize> {
        self.model.moe.expert_parallel()
    }

    fn run(&self, placement: &Placement) -> anyhow::Result<TrainingSummary> {
        pretrain_gpt(self, placement)
    }
}

impl Pretrain for BertPretrainArgs {
    fn parse(argv: Vec<String>) -> Self {
        parse_flags(argv)
    }

    fn sequence_parallel(&self) -> bool {
        self.common.parallel.sequence_parallel
    }

    fn run(&self, placement: &Placement) -> anyhow::Result<TrainingSummary> {
        pretrain_bert(self, placement)
    }
}

/// Adam at 1e-3 after one warm-up step, weight decay, clipping, no dropout, on the CPU, logging
/// every step: the optimization flags of every equivalence test (pretraining and finetuning).
pub const TINY_OPTIMIZATION: &[&str] = &[
    "--lr",
    "1e-3",
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
    "--adam-eps",
    "1e-4",
    "--log-interval",
    "1",
    "--eval-iters",
    "0",
    "--device",
    "cpu",
    "--seed",
    "1234",
];

/// Three steps of 4 micro-batches of 2 on mock data over 1000 tokens, a checkpoint after the
/// last.
const MOCK_PRETRAINING: &[&str] = &[
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    "3",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "1000",
    "--save-interval",
    "3",
];

/// [`TINY_MODEL`] made a Llama-style MoE: layers 0, 2 and 3 with 4 experts of width 48 (top-2),
/// the load-balancing loss and the z-loss.
pub const TINY_MOE: &[&str] = &[
    "--swiglu",
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "48",
    "--moe-layer-freq",
    "[1,0,1,1]",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--moe-z-loss-coeff",
    "1e-3",
];

/// The model of most equivalence tests: 4 layers of width 64 with 4 heads, sequences of 32.
pub const TINY_MODEL: &[&str] = &[
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
];

/// `model`'s flags followed by [`MOCK_PRETRAINING`] and [`TINY_OPTIMIZATION`]: the flags of a
/// pretraining equivalence test.
pub fn tiny_training(model: &[&'static str]) -> Vec<&'static str> {
    model
        .iter()
        .chain(MOCK_PRETRAINING)
        .chain(TINY_OPTIMIZATION)
        .copied()
        .collect()
}

pub struct Outcome {
    /// Every loss the run logged per iteration (`lm loss`, `sop loss`, ...), by name.
    pub losses: Vec<Vec<(String, f64)>>,
    pub weights: HashMap<String, Tensor>,
}

impl Outcome {
    /// `lm loss` of every iteration.
    pub fn lm_losses(&self) -> Vec<f64> {
        self.losses
            .iter()
            .map(|row| row.iter().find(|(k, _)| k == "lm loss").expect("lm loss").1)
            .collect()
    }
}

fn logged_losses(metrics: &Path) -> Vec<Vec<(String, f64)>> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            if record.get("split").is_some() {
                return None;
            }
            let mut losses: Vec<(String, f64)> = record
                .as_object()?
                .iter()
                .filter(|(k, _)| k.ends_with(" loss"))
                .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
                .collect();
            losses.sort_by(|a, b| a.0.cmp(&b.0));
            (!losses.is_empty()).then_some(losses)
        })
        .collect()
}

/// Trains with `world` thread ranks in a TP × CP × PP layout (CP from `extra` or `flags`), saving under `dir/ckpt` and appending
/// to `dir/metrics.jsonl`; returns the logged losses and the merged weights of the last
/// checkpoint.
pub fn train_in<P: Pretrain>(
    dir: &Path,
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> anyhow::Result<Outcome> {
    train_on::<P>(dir, flags, world, tensor, pipeline, extra, Device::Cpu)
}

/// [`train_in`] on `device` (a CUDA device is named on the command line, after `flags`).
fn train_on<P: Pretrain>(
    dir: &Path,
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
    device: Device,
) -> anyhow::Result<Outcome> {
    let save = dir.join("ckpt");
    let metrics = dir.join("metrics.jsonl");
    let device_flag: &[&str] = if device.is_cuda() {
        &["--device", "cuda"]
    } else {
        &[]
    };
    let argv: Vec<String> = std::iter::once("pretrain".to_string())
        .chain(flags.iter().chain(device_flag).map(|s| s.to_string()))
        .chain([
            "--tensor-model-parallel-size".into(),
            tensor.to_string(),
            "--pipeline-model-parallel-size".into(),
            pipeline.to_string(),
            "--save".into(),
            save.display().to_string(),
            "--metrics-file".into(),
            metrics.display().to_string(),
        ])
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
    let args = P::parse(argv);
    let mut layout =
        ParallelLayout::with_context(world, tensor, args.context_parallel(), pipeline).unwrap();
    if let Some(experts) = args.expert_parallel() {
        layout = layout.with_expert_parallel(experts)?;
    }
    let threads = ThreadWorld::new(world, Duration::from_secs(120));
    threads.run(|rank| {
        let parallel = ParallelState::threads(&threads, layout, rank, args.sequence_parallel())?;
        args.run(&Placement { parallel, device })
    })?;
    let checkpoint = find_checkpoint(&save)?.expect("a checkpoint was saved");
    Ok(Outcome {
        losses: logged_losses(&metrics),
        weights: merge_model_parallel_ranks(&checkpoint, Device::Cpu)?,
    })
}

/// [`train_in`] in a temporary directory.
pub fn train<P: Pretrain>(
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    train_in::<P>(dir.path(), flags, world, tensor, pipeline, extra).unwrap()
}

/// A one-rank run with `flags` (which must not name a device) on CUDA device 0, saving at its
/// end: the losses it logged and its weights.
pub fn gpu_train<P: Pretrain>(flags: &[&str]) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    gpu_train_in::<P>(dir.path(), flags)
}

/// [`gpu_train`] saving under `dir/ckpt` and logging to `dir/metrics.jsonl`.
pub fn gpu_train_in<P: Pretrain>(dir: &Path, flags: &[&str]) -> Outcome {
    train_on::<P>(dir, flags, 1, 1, 1, &[], Device::Cuda(0)).unwrap()
}

/// The `lm loss` of every iteration of [`gpu_train`] with `flags`, once with the kernel that
/// the environment variable `variable` keeps off at `0` and once with it off: `(on, off)`.
pub fn gpu_lm_losses_with_and_without<P: Pretrain>(
    flags: &[&str],
    variable: &str,
) -> (Vec<f64>, Vec<f64>) {
    static ENVIRONMENT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _environment = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    let on = gpu_lm_losses::<P>(flags);
    std::env::set_var(variable, "0");
    let off = gpu_lm_losses::<P>(flags);
    std::env::remove_var(variable);
    (on, off)
}

/// Two runs' losses track each other: `steps` of them each, every step's within `tolerance`
/// (relative) of the other's, and the first run learned (its last loss below its first).
pub fn assert_tracks(losses: &[f64], reference: &[f64], steps: usize, tolerance: f64, what: &str) {
    eprintln!("{what}: {losses:?}\nreference: {reference:?}");
    assert_eq!(losses.len(), steps, "{what}: {losses:?}");
    assert_eq!(reference.len(), steps, "{what}: {reference:?}");
    for (step, (a, b)) in losses.iter().zip(reference).enumerate() {
        assert!(
            (a - b).abs() <= tolerance * b,
            "{what}: step {} loss {a} against {b}",
            step + 1
        );
    }
    assert!(
        losses[steps - 1] < losses[0],
        "{what}: the loss did not fall: {losses:?}"
    );
}

/// The `lm loss` of every iteration of [`gpu_train`].
pub fn gpu_lm_losses<P: Pretrain>(flags: &[&str]) -> Vec<f64> {
    gpu_train::<P>(flags).lm_losses()
}

pub fn assert_equivalent(reference: &Outcome, parallel: &Outcome, what: &str) {
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
    for (step, (ours, theirs)) in reference.losses.iter().zip(&parallel.losses).enumerate() {
        assert_eq!(
            ours.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            theirs.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            "{what}: step {}",
            step + 1
        );
        for ((name, a), (_, b)) in ours.iter().zip(theirs) {
            assert!(
                (a - b).abs() <= 1e-5 * a.abs(),
                "{what}: {name} of step {} is {b}, the one-rank run's {a}",
                step + 1
            );
        }
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

/// The one-rank run learns, and the parallel layout equals it.
pub fn check<P: Pretrain>(
    flags: &[&str],
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
    what: &str,
) {
    let reference = train::<P>(flags, 1, 1, 1, &[]);
    let lm = reference.lm_losses();
    assert!(
        lm[2] < lm[0],
        "{what}: the reference run did not learn: {:?}",
        reference.losses
    );
    let parallel = train::<P>(flags, world, tensor, pipeline, extra);
    assert_equivalent(&reference, &parallel, what);
}

/// The losses and the weights of `resumed` are bitwise those of `straight`.
pub fn assert_bitwise_identical(straight: &Outcome, resumed: &Outcome) {
    assert_eq!(straight.losses, resumed.losses);
    for (name, tensor) in &straight.weights {
        assert!(
            tensor.equal(&resumed.weights[name]),
            "{name} differs after resuming"
        );
    }
}

/// A TP=2 + SP run stopped after two steps (saving each step) and resumed from its checkpoint
/// ends as the uninterrupted run, bit for bit.
pub fn check_resuming<P: Pretrain>(flags: &[&str]) {
    let sequence_parallel = "--sequence-parallel";
    let straight = train::<P>(flags, 2, 2, 1, &[sequence_parallel]);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let stop_after_two = [
        sequence_parallel,
        "--exit-interval",
        "2",
        "--save-interval",
        "1",
    ];
    train_in::<P>(dir.path(), flags, 2, 2, 1, &stop_after_two).unwrap();
    let resumed = train_in::<P>(
        dir.path(),
        flags,
        2,
        2,
        1,
        &[sequence_parallel, "--load", ckpt.as_str()],
    )
    .unwrap();
    assert_bitwise_identical(&straight, &resumed);
}
