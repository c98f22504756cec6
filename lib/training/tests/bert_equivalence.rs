//! BERT runs on the same engine as GPT, so its parallel layouts must equal one rank too: a
//! small BERT (binary head, padding masks, LM and sentence-order losses) trained for three steps
//! with TP, SP, PP and DP with the distributed optimizer, ranks as threads, gives the losses and
//! (merged) weights of the one-rank run, and a resumed run is bitwise the uninterrupted one.

mod support;

use std::sync::LazyLock;

use megatron_training::BertPretrainArgs;
use support::{check, train};

/// A 4-layer BERT on mock masked-LM data, fp32, no dropout, 4 micro-batches of 2 per step.
static BASE: LazyLock<Vec<&str>> = LazyLock::new(|| support::tiny_training(support::TINY_MODEL));

#[test]
fn bert_tensor_parallel_equals_one_rank() {
    check::<BertPretrainArgs>(&BASE, 2, 2, 1, &[], "BERT TP=2");
}

#[test]
fn bert_sequence_parallel_equals_one_rank() {
    check::<BertPretrainArgs>(&BASE, 2, 2, 1, &["--sequence-parallel"], "BERT TP=2 + SP");
}

/// The fused output layer + cross entropy (the LM head's bias included) trains as the unfused
/// one-rank run, split over the vocabulary with sequence parallelism and over two stages.
#[test]
fn bert_cross_entropy_loss_fusion_equals_the_unfused_loss() {
    let fused = "--cross-entropy-loss-fusion";
    check::<BertPretrainArgs>(
        &BASE,
        2,
        2,
        1,
        &[fused, "--sequence-parallel"],
        "BERT fused loss, TP=2 + SP",
    );
    check::<BertPretrainArgs>(&BASE, 2, 1, 2, &[fused], "BERT fused loss, PP=2");
}

#[test]
fn bert_pipeline_parallel_equals_one_rank() {
    check::<BertPretrainArgs>(&BASE, 2, 1, 2, &[], "BERT PP=2");
}

#[test]
fn bert_interleaved_pipeline_with_recompute_equals_one_rank() {
    let extra = [
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    check::<BertPretrainArgs>(
        &BASE,
        2,
        1,
        2,
        &extra,
        "BERT PP=2 interleaved, full recompute",
    );
    check::<BertPretrainArgs>(
        &BASE,
        2,
        2,
        1,
        &["--sequence-parallel", "--recompute-activations"],
        "BERT TP=2 + SP, selective recompute",
    );
}

#[test]
fn bert_distributed_optimizer_equals_one_rank() {
    check::<BertPretrainArgs>(
        &BASE,
        2,
        1,
        1,
        &["--use-distributed-optimizer"],
        "BERT DP=2, distributed optimizer",
    );
}

#[test]
fn bert_without_binary_head_reports_only_the_lm_loss() {
    let outcome = train::<BertPretrainArgs>(&BASE, 1, 1, 1, &["--bert-no-binary-head"]);
    assert!(outcome
        .losses
        .iter()
        .all(|row| row.len() == 1 && row[0].0 == "lm loss"));
    assert!(!outcome.weights.keys().any(|k| k.starts_with("binary_head")
        || k.starts_with("pooler")
        || k.contains("tokentype")));
    let with = train::<BertPretrainArgs>(&BASE, 1, 1, 1, &[]);
    assert!(with
        .losses
        .iter()
        .all(|row| row.len() == 2 && row[1].0 == "sop loss"));
    for name in [
        "binary_head.weight",
        "pooler.dense.weight",
        "embedding.tokentype_embeddings.weight",
        "lm_head.dense.weight",
        "lm_head.layer_norm.weight",
        "output_layer.bias",
        "encoder.layers.3.self_attention.linear_qkv.weight",
        "encoder.final_layernorm.weight",
    ] {
        assert!(with.weights.contains_key(name), "{name} missing");
    }
}

#[test]
fn bert_resuming_is_bitwise_identical() {
    support::check_resuming::<BertPretrainArgs>(&BASE);
}
