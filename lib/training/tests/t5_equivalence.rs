//! T5 runs on the same engine as GPT and BERT, so its parallel layouts must equal one rank: a
//! small encoder-decoder (different encoder and decoder depths, padded encoder inputs, decoder
//! targets) trained for three steps with TP, TP+SP and DP with the distributed optimizer, ranks
//! as threads, gives the losses and (merged) weights of the one-rank run; a resumed run is
//! bitwise the uninterrupted one; pipeline parallelism is refused naming the flag.

mod support;

use std::sync::LazyLock;

use megatron_parallel::Placement;
use megatron_training::T5PretrainArgs;
use megatron_training::{pretrain_t5, TrainingSummary};
use support::{check, train, train_in, Pretrain};

impl Pretrain for T5PretrainArgs {
    fn parse(argv: Vec<String>) -> Self {
        support::parse_t5_flags(argv)
    }

    fn sequence_parallel(&self) -> bool {
        self.common.parallel.sequence_parallel
    }

    fn run(&self, placement: &Placement) -> anyhow::Result<TrainingSummary> {
        pretrain_t5(self, placement)
    }
}

/// A 2+3-layer T5 on mock span-corruption data, fp32, no dropout, 4 micro-batches of 2 per step.
static BASE: LazyLock<Vec<&str>> = LazyLock::new(|| {
    support::tiny_training(&[
        "--encoder-num-layers",
        "2",
        "--decoder-num-layers",
        "3",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--encoder-seq-length",
        "32",
        "--decoder-seq-length",
        "16",
        "--max-position-embeddings",
        "32",
    ])
});

#[test]
fn t5_tensor_parallel_equals_one_rank() {
    check::<T5PretrainArgs>(&BASE, 2, 2, 1, &[], "T5 TP=2");
}

#[test]
fn t5_sequence_parallel_equals_one_rank() {
    check::<T5PretrainArgs>(&BASE, 2, 2, 1, &["--sequence-parallel"], "T5 TP=2 + SP");
}

/// The fused output layer + cross entropy (tied weights with the LM head's bias) trains as the
/// unfused one-rank run, on one rank and split over the vocabulary with sequence parallelism.
#[test]
fn t5_cross_entropy_loss_fusion_equals_the_unfused_loss() {
    let fused = "--cross-entropy-loss-fusion";
    check::<T5PretrainArgs>(&BASE, 1, 1, 1, &[fused], "T5 fused loss");
    check::<T5PretrainArgs>(
        &BASE,
        2,
        2,
        1,
        &[fused, "--sequence-parallel"],
        "T5 fused loss, TP=2 + SP",
    );
}

#[test]
fn t5_distributed_optimizer_equals_one_rank() {
    check::<T5PretrainArgs>(
        &BASE,
        2,
        1,
        1,
        &["--use-distributed-optimizer"],
        "T5 DP=2, distributed optimizer",
    );
}

#[test]
fn t5_with_recompute_equals_one_rank() {
    // Full recompute re-runs decoder blocks whose cross-attention reads the encoder output:
    // its gradient must still reach the encoder.
    let full = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    check::<T5PretrainArgs>(&BASE, 1, 1, 1, &full, "T5 full recompute");
    check::<T5PretrainArgs>(
        &BASE,
        2,
        2,
        1,
        &["--sequence-parallel", "--recompute-activations"],
        "T5 TP=2 + SP, selective recompute",
    );
}

#[test]
fn t5_checkpoint_has_megatron_core_names() {
    let outcome = train::<T5PretrainArgs>(&BASE, 1, 1, 1, &[]);
    for name in [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "encoder.layers.1.self_attention.linear_qkv.weight",
        "encoder.final_layernorm.weight",
        "decoder.layers.2.pre_cross_attn_layernorm.weight",
        "decoder.layers.2.cross_attention.linear_q.weight",
        "decoder.layers.2.cross_attention.linear_kv.weight",
        "decoder.layers.2.cross_attention.linear_proj.weight",
        "decoder.layers.2.mlp.linear_fc2.weight",
        "decoder.final_layernorm.weight",
        "lm_head.output_layer.bias",
    ] {
        assert!(outcome.weights.contains_key(name), "{name} missing");
    }
    assert!(!outcome
        .weights
        .keys()
        .any(|k| k.starts_with("encoder.layers.2")
            || k.starts_with("decoder.layers.3")
            || k.starts_with("encoder.layers.0.cross_attention")));
}

#[test]
fn t5_resuming_is_bitwise_identical() {
    support::check_resuming::<T5PretrainArgs>(&BASE);
}

#[test]
fn t5_refuses_pipeline_parallelism_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let error = train_in::<T5PretrainArgs>(dir.path(), &BASE, 2, 1, 2, &[])
        .err()
        .expect("pipeline parallelism is refused");
    let message = format!("{error:#}");
    assert!(
        message.contains("--pipeline-model-parallel-size"),
        "{message}"
    );
}
