//! A Llama-style GPT whose MLPs are Mixtures of Experts trains as Megatron's: data and
//! pipeline parallelism give the one-rank run's losses and weights, the auxiliary losses are
//! logged under Megatron's names (the same whatever the layout), the checkpoint holds
//! Megatron's expert names and resuming from it is bitwise the straight run. Expert
//! parallelism (both dispatchers, with and without the distributed optimizer, and beside
//! tensor and sequence parallelism) gives the losses, gradient norms and weights of the same
//! data-parallel run without it, and saves and resumes.

mod support;

use std::path::Path;
use std::sync::LazyLock;

use megatron_training::GptPretrainArgs;

/// The tiny MoE of `support::TINY_MOE`, as the equivalence tests train it.
static MOE: LazyLock<Vec<&str>> =
    LazyLock::new(|| support::tiny_training(&[support::TINY_MODEL, support::TINY_MOE].concat()));

fn train(world: usize, pipeline: usize, extra: &[&str]) -> (support::Outcome, Vec<[f64; 2]>) {
    let (outcome, moe, _) = train_tp(world, 1, pipeline, extra);
    (outcome, moe)
}

/// [`train`] with `tensor`-way tensor parallelism; also every iteration's gradient norm.
fn train_tp(
    world: usize,
    tensor: usize,
    pipeline: usize,
    extra: &[&str],
) -> (support::Outcome, Vec<[f64; 2]>, Vec<f64>) {
    let dir = tempfile::tempdir().unwrap();
    let outcome =
        support::train_in::<GptPretrainArgs>(dir.path(), &MOE, world, tensor, pipeline, extra)
            .unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    (outcome, moe_losses(&metrics), grad_norms(&metrics))
}

/// The gradient norm of every training iteration in the metrics file.
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

fn assert_norms_close(reference: &[f64], other: &[f64], what: &str) {
    assert_eq!(reference.len(), 3, "{what}: reference logged {reference:?}");
    assert_eq!(other.len(), 3, "{what}: logged {other:?}");
    for (a, b) in reference.iter().zip(other) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{what}: grad norms {other:?} against {reference:?}"
        );
    }
}

/// `[load_balancing_loss, z_loss]` of every training iteration in the metrics file.
fn moe_losses(metrics: &Path) -> Vec<[f64; 2]> {
    std::fs::read_to_string(metrics)
        .unwrap()
        .lines()
        .filter_map(|line| {
            let record: serde_json::Value = serde_json::from_str(line).unwrap();
            let value = |name: &str| record.get(name)?.as_f64();
            Some([value("load_balancing_loss")?, value("z_loss")?])
        })
        .collect()
}

fn assert_close(reference: &[[f64; 2]], other: &[[f64; 2]], what: &str) {
    assert_eq!(reference.len(), 3, "{what}: reference logged {reference:?}");
    assert_eq!(other.len(), 3, "{what}: logged {other:?}");
    for (a, b) in reference.iter().flatten().zip(other.iter().flatten()) {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs(),
            "{what}: {other:?} against {reference:?}"
        );
    }
}

#[test]
fn moe_gpt_under_data_and_pipeline_parallelism_equals_one_rank() {
    let (reference, reference_moe) = train(1, 1, &[]);
    let lm = reference.lm_losses();
    assert!(lm[2] < lm[0], "the reference did not learn: {lm:?}");
    // A balanced router scores about 1 (the loss over its coefficient); the z-loss is the
    // mean squared log-sum-exp of small logits, about ln(4)² ≈ 1.9.
    for [balance, z] in &reference_moe {
        assert!((0.9..1.5).contains(balance), "{reference_moe:?}");
        assert!((1.0..3.0).contains(z), "{reference_moe:?}");
    }
    for name in [
        "decoder.layers.0.mlp.router.weight",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.3.mlp.experts.local_experts.0.linear_fc2.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
    ] {
        assert!(reference.weights.contains_key(name), "{name} missing");
    }
    assert!(!reference
        .weights
        .contains_key("decoder.layers.1.mlp.router.weight"));

    let (data, data_moe) = train(2, 1, &[]);
    support::assert_equivalent(&reference, &data, "DP=2");
    // Megatron logs the last rank's own value: each rank's micro-batches differ under data
    // parallelism, so only the pipeline's split keeps the values.
    assert_eq!(data_moe.len(), 3);
    let (pipeline, pipeline_moe) = train(2, 2, &[]);
    support::assert_equivalent(&reference, &pipeline, "PP=2");
    assert_close(&reference_moe, &pipeline_moe, "PP=2");
    let (distributed, _) = train(2, 1, &["--use-distributed-optimizer"]);
    support::assert_equivalent(&reference, &distributed, "DP=2, distributed optimizer");
}

#[test]
fn moe_gpt_resumes_bitwise() {
    let (straight, straight_moe) = train(2, 1, &[]);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let stop_after_two = ["--exit-interval", "2", "--save-interval", "1"];
    support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &stop_after_two).unwrap();
    let resumed =
        support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &["--load", &ckpt])
            .unwrap();
    support::assert_bitwise_identical(&straight, &resumed);
    let resumed_moe = moe_losses(&dir.path().join("metrics.jsonl"));
    assert_eq!(resumed_moe, straight_moe);
}

/// Two ranks: each holds two of the four experts (EP=2) and its own micro-batches (DP=2), and
/// trains as two data-parallel ranks holding all four, with either dispatcher, with and
/// without the distributed optimizer (expert gradients then reduced and sharded over the
/// expert-data-parallel group, here one rank).
#[test]
fn expert_parallelism_equals_data_parallelism() {
    for distributed in [false, true] {
        let optimizer: &[&str] = if distributed {
            &["--use-distributed-optimizer"]
        } else {
            &[]
        };
        let (reference, reference_moe, reference_norms) = train_tp(2, 1, 1, optimizer);
        for dispatcher in ["allgather", "alltoall"] {
            let what = format!("EP=2 {dispatcher}, distributed optimizer {distributed}");
            let extra = [
                optimizer,
                &[
                    "--expert-model-parallel-size",
                    "2",
                    "--moe-token-dispatcher-type",
                    dispatcher,
                ],
            ]
            .concat();
            let (experts, experts_moe, experts_norms) = train_tp(2, 1, 1, &extra);
            support::assert_equivalent(&reference, &experts, &what);
            assert_close(&reference_moe, &experts_moe, &what);
            assert_norms_close(&reference_norms, &experts_norms, &what);
        }
    }
}

/// `--moe-grouped-gemm` (libtorch's grouped GEMM, on the CPU in float32 here) trains as the
/// per-expert loop: on one rank, and under expert parallelism with the alltoall dispatcher
/// and the distributed optimizer.
#[test]
fn grouped_gemm_trains_as_the_per_expert_loop() {
    let grouped = ["--moe-grouped-gemm", "--moe-permute-fusion"];
    let (reference, reference_moe, reference_norms) = train_tp(1, 1, 1, &[]);
    let (experts, experts_moe, experts_norms) = train_tp(1, 1, 1, &grouped);
    support::assert_equivalent(&reference, &experts, "grouped GEMM");
    assert_close(&reference_moe, &experts_moe, "grouped GEMM");
    assert_norms_close(&reference_norms, &experts_norms, "grouped GEMM");

    let parallel = [
        "--use-distributed-optimizer",
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
    ];
    let (reference, reference_moe, reference_norms) = train_tp(2, 1, 1, &parallel);
    let (experts, experts_moe, experts_norms) =
        train_tp(2, 1, 1, &[&parallel[..], &grouped].concat());
    let what = "grouped GEMM, EP=2 alltoall";
    support::assert_equivalent(&reference, &experts, what);
    assert_close(&reference_moe, &experts_moe, what);
    assert_norms_close(&reference_norms, &experts_norms, what);
}

/// The routers' expert biases of the last checkpoint under `dir/ckpt` (rank 0's file), by name.
fn saved_expert_biases(dir: &Path) -> Vec<(String, Vec<f32>)> {
    fn files(dir: &Path, found: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, found);
            } else if path.file_name().unwrap() == "expert_bias.safetensors" {
                found.push(path);
            }
        }
    }
    let mut found = Vec::new();
    files(&dir.join("ckpt"), &mut found);
    found.sort();
    let last = found.last().expect("a checkpoint with expert biases");
    let mut biases: Vec<(String, Vec<f32>)> = tch::Tensor::read_safetensors(last)
        .unwrap()
        .into_iter()
        .map(|(name, bias)| (name, Vec::<f32>::try_from(&bias).unwrap()))
        .collect();
    biases.sort_by(|a, b| a.0.cmp(&b.0));
    biases
}

/// `--moe-router-enable-expert-bias`: each MoE router's bias moves by the rate after every
/// step (three steps: multiples of the rate, at most three of them, not all zero); the step's
/// tokens are counted over the data-parallel ranks, so two ranks train as one; a run resumed
/// from a checkpoint gets the biases back and is bitwise the straight run.
#[test]
fn expert_bias_moves_counts_over_ranks_and_resumes() {
    let rate = 0.05;
    let bias = [
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.05",
    ];
    let one_dir = tempfile::tempdir().unwrap();
    let one = support::train_in::<GptPretrainArgs>(one_dir.path(), &MOE, 1, 1, 1, &bias).unwrap();
    let biases = saved_expert_biases(one_dir.path());
    let names: Vec<&str> = biases.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        [
            "decoder.layers.0.mlp.router.expert_bias",
            "decoder.layers.2.mlp.router.expert_bias",
            "decoder.layers.3.mlp.router.expert_bias"
        ]
    );
    for (name, values) in &biases {
        assert!(values.iter().any(|v| *v != 0.0), "{name}: {values:?}");
        for v in values {
            let steps = v / rate as f32;
            assert!(
                (steps - steps.round()).abs() < 1e-4 && steps.abs() <= 3.0,
                "{name}: {values:?}"
            );
        }
    }

    let two_dir = tempfile::tempdir().unwrap();
    let two = support::train_in::<GptPretrainArgs>(two_dir.path(), &MOE, 2, 1, 1, &bias).unwrap();
    support::assert_equivalent(&one, &two, "expert bias, DP=2");
    assert_eq!(biases, saved_expert_biases(two_dir.path()), "DP=2 biases");

    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let stop_after_two = [&bias[..], &["--exit-interval", "2", "--save-interval", "1"]].concat();
    support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &stop_after_two).unwrap();
    let resumed = support::train_in::<GptPretrainArgs>(
        dir.path(),
        &MOE,
        2,
        1,
        1,
        &[&bias[..], &["--load", &ckpt]].concat(),
    )
    .unwrap();
    support::assert_bitwise_identical(&two, &resumed);
    assert_eq!(biases, saved_expert_biases(dir.path()), "resumed biases");
}

/// Four ranks: tensor and sequence parallelism 2 with the experts split over the two
/// tensor-parallel ranks of each replica (EP=2, expert tensor parallelism 1) trains as the
/// same layout with every expert on every rank.
#[test]
fn expert_parallelism_beside_tensor_parallelism_equals_tensor_parallelism() {
    let tensor = ["--sequence-parallel", "--expert-tensor-parallel-size", "1"];
    let (reference, reference_moe, reference_norms) = train_tp(4, 2, 1, &tensor);
    // Mixture-of-Experts layers under tensor and sequence parallelism train as one rank, and
    // with the same micro-batches (no data parallelism) log its load-balancing loss: each
    // rank's share of its half of the sequence, summed over the two.
    let (one_rank, one_rank_moe) = train(1, 1, &[]);
    support::assert_equivalent(&one_rank, &reference, "TP=2 with sequence parallelism");
    let (tensor_only, tensor_only_moe, _) = train_tp(2, 2, 1, &tensor);
    support::assert_equivalent(&one_rank, &tensor_only, "TP=2 on two ranks");
    let balance = |losses: &[[f64; 2]]| losses.iter().map(|[b, _]| [*b, 0.0]).collect::<Vec<_>>();
    assert_close(
        &balance(&one_rank_moe),
        &balance(&tensor_only_moe),
        "TP=2 on two ranks",
    );
    for dispatcher in ["allgather", "alltoall"] {
        let what = format!("TP=2 × EP=2 {dispatcher}");
        let extra = [
            &tensor[..],
            &[
                "--expert-model-parallel-size",
                "2",
                "--moe-token-dispatcher-type",
                dispatcher,
            ],
        ]
        .concat();
        let (experts, experts_moe, experts_norms) = train_tp(4, 2, 1, &extra);
        support::assert_equivalent(&reference, &experts, &what);
        assert_close(&reference_moe, &experts_moe, &what);
        assert_norms_close(&reference_norms, &experts_norms, &what);
    }
}

/// A run under EP=2 saved after two steps and resumed gives the straight run's losses.
#[test]
fn moe_gpt_under_expert_parallelism_resumes_bitwise() {
    let experts = [
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
    ];
    let (straight, straight_moe) = train(2, 1, &experts);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt").display().to_string();
    let stop_after_two = [
        &experts[..],
        &["--exit-interval", "2", "--save-interval", "1"],
    ]
    .concat();
    support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &stop_after_two).unwrap();
    let resume = [&experts[..], &["--load", &ckpt]].concat();
    let resumed = support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &resume).unwrap();
    support::assert_bitwise_identical(&straight, &resumed);
    let resumed_moe = moe_losses(&dir.path().join("metrics.jsonl"));
    assert_eq!(resumed_moe, straight_moe);
    // The checkpoint holds all four experts of every MoE layer, whichever rank held them.
    for e in 0..4 {
        let name = format!("decoder.layers.2.mlp.experts.local_experts.{e}.linear_fc1.weight");
        assert!(straight.weights.contains_key(&name), "{name} missing");
    }
    // Without expert parallelism the weights load (each rank takes every expert), but not
    // the per-rank optimizer state.
    let Err(error) =
        support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &["--load", &ckpt])
    else {
        panic!("resumed EP=2 optimizer state without expert parallelism");
    };
    let error = format!("{error:#}");
    assert!(
        error.contains("saved with --expert-model-parallel-size 2 but this run uses 1"),
        "{error}"
    );
    let weights_only = ["--load", &ckpt, "--no-load-optim"];
    support::train_in::<GptPretrainArgs>(dir.path(), &MOE, 2, 1, 1, &weights_only).unwrap();
}
