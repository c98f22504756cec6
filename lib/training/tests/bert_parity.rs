//! Our BERT against HuggingFace's `MegatronBertForPreTraining` with identical weights (pre-LN,
//! erf GeLU, LayerNorm eps 1e-5): the MLM and sentence-order logits of a padded batch agree in
//! float32, and Megatron's two losses equal HF's. The reference is made at test time by
//! `scripts/reference/megatron_bert_reference.py` (float64 forward of float32 weights).

mod support;

use clap::Parser;
use megatron_models::bert::{hf, BertArgs};
use megatron_models::BertBatch;
use megatron_models::{BertConfig, BertModel, BertOutput, ModelOptions, Recompute};
use megatron_parallel::ParallelState;
use megatron_training::args::ModelArgs;
use megatron_training::{BertFamily, LossTotals, ModelFamily};
use support::reference;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    bert: BertArgs,
}

/// The architecture the reference script builds, from Megatron's flags.
fn config() -> BertConfig {
    let argv = [
        "test",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--ffn-hidden-size",
        "128",
        "--seq-length",
        "12",
        "--max-position-embeddings",
        "32",
        "--no-bias-gelu-fusion",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--bert-binary-head",
    ];
    let flags = Flags::try_parse_from(argv).unwrap();
    BertConfig {
        transformer: flags.model.gpt_config(128).unwrap(),
        binary_head: flags.bert.binary_head(),
        lm_head_activation: megatron_models::Activation::GeluErf,
        task_head: None,
    }
}

/// The model's outputs for `batch`, without dropout or gradients.
fn forward<'m>(model: &'m BertModel, batch: &BertBatch) -> BertOutput<'m> {
    tch::no_grad(|| {
        model.forward(
            &batch.tokens,
            Some(&batch.types),
            &batch.padding_mask,
            false,
        )
    })
    .unwrap()
}

/// The MLM logits as HF lays them out (`[b, s, vocab]`), without Megatron's vocabulary padding.
fn mlm_logits(output: &BertOutput, vocab: i64) -> Tensor {
    output
        .lm
        .logits()
        .unwrap()
        .transpose(0, 1)
        .narrow(2, 0, vocab)
}

#[test]
fn logits_and_losses_equal_huggingface_megatron_bert() {
    let dir = reference::run_script("megatron_bert_reference.py", &[]);
    let hf_state = reference::tensors(&dir, "model.safetensors");
    let io = reference::tensors(&dir, "io.safetensors");

    let config = config();
    assert_eq!(
        config.transformer.activation,
        megatron_models::Activation::GeluErf
    );
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 1234,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let parallel = ParallelState::single();
    let model = BertModel::new(config.clone(), options, &parallel).unwrap();
    let state = hf::megatron_bert_to_megatron(&hf_state, &config).unwrap();
    megatron_models::ModelChunk::load_parameters(&model, &state).unwrap();

    let hf_labels = &io["labels"];
    let predicted = hf_labels.ne(-100);
    let batch = BertBatch {
        tokens: io["input_ids"].shallow_clone(),
        types: io["token_type_ids"].shallow_clone(),
        labels: hf_labels.masked_fill(&predicted.logical_not(), -1),
        loss_mask: predicted.to_kind(Kind::Float),
        padding_mask: io["attention_mask"].shallow_clone(),
        sentence_order: io["next_sentence_label"].shallow_clone(),
    };
    let output = forward(&model, &batch);
    let vocab = io["prediction_logits"].size()[2];
    let ours = mlm_logits(&output, vocab);
    let reference = io["prediction_logits"].to_kind(Kind::Float);
    let lm_difference = (&ours - &reference).abs().max().double_value(&[]);
    assert!(
        lm_difference < 1e-4,
        "MLM logits differ by {lm_difference:e}"
    );
    let binary = output.binary_logits.as_ref().expect("binary head");
    let sop_difference = (binary - io["seq_relationship_logits"].to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[]);
    assert!(
        sop_difference < 1e-4,
        "SOP logits differ by {sop_difference:e}"
    );
    eprintln!("max |logit difference|: MLM {lm_difference:e}, SOP {sop_difference:e}");

    // The loss through the logits and through the fused output layer + cross entropy.
    for cross_entropy_loss_fusion in [false, true] {
        let family = BertFamily {
            config: config.clone(),
            mask_prob: 0.15,
            short_seq_prob: 0.1,
            cross_entropy_loss_fusion,
        };
        let mut losses = LossTotals::new(family.loss_names(), Device::Cpu);
        let total = family.loss(&output, &batch, &mut losses).unwrap();
        let reported = losses.reduce(&parallel).unwrap();
        let (lm, sop) = (
            io["lm_loss"].double_value(&[0]),
            io["sop_loss"].double_value(&[0]),
        );
        assert_eq!(reported[0].0, "lm loss");
        assert_eq!(reported[1].0, "sop loss");
        assert!(
            (reported[0].1 - lm).abs() < 1e-5,
            "lm loss {} vs HF {lm} (fusion {cross_entropy_loss_fusion})",
            reported[0].1
        );
        assert!(
            (reported[1].1 - sop).abs() < 1e-5,
            "sop loss {} vs HF {sop}",
            reported[1].1
        );
        assert!((total.double_value(&[]) - (lm + sop)).abs() < 1e-5);
    }

    // Guard against a test that passes whatever the weights: a wrong QKV layout must show.
    let mut wrong = state;
    let name = "encoder.layers.0.self_attention.linear_qkv.weight";
    let q = &hf_state["bert.encoder.layer.0.attention.self.query.weight"];
    let k = &hf_state["bert.encoder.layer.0.attention.self.key.weight"];
    let v = &hf_state["bert.encoder.layer.0.attention.self.value.weight"];
    wrong.insert(name.into(), Tensor::cat(&[q, k, v], 0));
    megatron_models::ModelChunk::load_parameters(&model, &wrong).unwrap();
    let output = forward(&model, &batch);
    let ours = mlm_logits(&output, vocab);
    assert!((ours - reference).abs().max().double_value(&[]) > 1e-3);
}
