//! Our T5 against an independent PyTorch implementation of the spec
//! (`scripts/reference/megatron_t5_reference.py`, float64 forward of float32 weights under
//! Megatron-core T5 names): the logits of a padded batch agree within 1e-4 and the family's
//! loss equals the reference's. On our model: the decoder is causal (a later decoder token
//! leaves earlier logits unchanged) and the encoder's padding matters only through its mask.

mod support;

use megatron_models::T5Batch;
use megatron_models::{ModelChunk, ModelOptions, Recompute, T5Input, T5Model};
use megatron_parallel::ParallelState;
use megatron_training::{LossTotals, ModelFamily, StepOutput, T5Family};
use support::reference;
use tch::{Device, Kind, Tensor};

fn logits(model: &T5Model, enc: &Tensor, dec: &Tensor, enc_mask: &Tensor) -> Tensor {
    tch::no_grad(|| {
        model.forward(
            &T5Input {
                encoder_tokens: enc,
                decoder_tokens: dec,
                encoder_mask: enc_mask,
            },
            false,
        )
    })
    .unwrap()
    .transpose(0, 1)
}

fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn t5_logits_and_loss_equal_the_reference() {
    let dir = reference::run_script("megatron_t5_reference.py", &[]);
    let state = reference::tensors(&dir, "model.safetensors");
    let io = reference::tensors(&dir, "io.safetensors");

    let config = reference::t5_config(128);
    assert_eq!(
        (config.encoder_num_layers, config.decoder_num_layers),
        (2, 3)
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
    let model = T5Model::new(config.clone(), options, &parallel).unwrap();
    // Every name of the reference is one of ours and the other way round.
    model.load_parameters(&state).unwrap();

    let batch = T5Batch {
        text_enc: io["enc_tokens"].shallow_clone(),
        text_dec: io["dec_tokens"].shallow_clone(),
        labels: io["labels"].shallow_clone(),
        loss_mask: io["loss_mask"].shallow_clone(),
        enc_mask: io["enc_mask"].shallow_clone(),
    };
    let ours = logits(&model, &batch.text_enc, &batch.text_dec, &batch.enc_mask);
    // Compare the decoder's real positions (the reference's padded query rows are fully masked).
    let real = io["dec_mask"].ne(0).unsqueeze(-1);
    let reference = io["logits"].to_kind(Kind::Float);
    let difference = max_difference(&ours.multiply(&real), &reference.multiply(&real));
    eprintln!("max |logit difference| {difference:e}");
    assert!(difference < 1e-4, "logits differ by {difference:e}");
    assert!(
        ours.abs().max().double_value(&[]) > 0.1,
        "degenerate logits"
    );

    // The loss through the logits and through the fused output layer + cross entropy.
    for cross_entropy_loss_fusion in [false, true] {
        let family = T5Family {
            config: config.clone(),
            decoder_seq_length: 8,
            vocab_extra_ids: 0,
            mask_prob: 0.15,
            short_seq_prob: 0.1,
            cross_entropy_loss_fusion,
        };
        let mut losses = LossTotals::new(family.loss_names(), Device::Cpu);
        let StepOutput::Loss(loss) =
            tch::no_grad(|| family.forward_step(&model, &batch, None, false, &mut losses)).unwrap()
        else {
            panic!("T5 ends in its loss");
        };
        let expected = io["loss"].double_value(&[0]);
        let reported = losses.reduce(&parallel).unwrap();
        assert_eq!(reported[0].0, "lm loss");
        assert!(
            (reported[0].1 - expected).abs() < 1e-5,
            "lm loss {} vs {expected} (fusion {cross_entropy_loss_fusion})",
            reported[0].1
        );
        assert!((loss.double_value(&[]) - expected).abs() < 1e-5);
    }

    // A wrong cross-attention layout must show: swap each head's key and value halves.
    let mut wrong = state;
    let name = "decoder.layers.0.cross_attention.linear_kv.weight";
    let kv = wrong[name]
        .view([4, 2, 16, 64])
        .flip([1])
        .reshape([128, 64]);
    wrong.insert(name.to_string(), kv);
    model.load_parameters(&wrong).unwrap();
    let swapped = logits(&model, &batch.text_enc, &batch.text_dec, &batch.enc_mask);
    assert!(max_difference(&swapped.multiply(&real), &reference.multiply(&real)) > 1e-3);
}

#[test]
fn t5_decoder_is_causal_and_encoder_padding_is_masked() {
    let config = reference::t5_config(128);
    let options = ModelOptions {
        params_dtype: Kind::Double,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 99,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = T5Model::new(config, options, &ParallelState::single()).unwrap();
    let enc = Tensor::randint_low(10, 128, [2, 12], (Kind::Int64, Device::Cpu));
    let dec = Tensor::randint_low(10, 128, [2, 8], (Kind::Int64, Device::Cpu));
    let enc_mask = Tensor::ones([2, 12], (Kind::Int64, Device::Cpu));
    let _ = enc_mask.narrow(1, 7, 5).get(1).fill_(0);
    let base = logits(&model, &enc, &dec, &enc_mask);

    // Decoder token 5 changed: positions 0..5 keep their logits, position 5 changes.
    let later = dec.copy();
    let _ = later.narrow(1, 5, 1).fill_(3);
    let changed = logits(&model, &enc, &later, &enc_mask);
    assert!(max_difference(&base.narrow(1, 0, 5), &changed.narrow(1, 0, 5)) < 1e-12);
    assert!(max_difference(&base.narrow(1, 5, 1), &changed.narrow(1, 5, 1)) > 1e-6);

    // Different tokens under the second row's encoder padding: no logit moves.
    let padded = enc.copy();
    let _ = padded.get(1).narrow(0, 7, 5).fill_(4);
    let same = logits(&model, &padded, &dec, &enc_mask);
    assert!(max_difference(&base, &same) < 1e-12);
    // The same tokens, now real: the second row's logits move (the mask is what hid them).
    let unmasked = Tensor::ones([2, 12], (Kind::Int64, Device::Cpu));
    let moved = logits(&model, &padded, &dec, &unmasked);
    assert!(max_difference(&base.get(1), &moved.get(1)) > 1e-6);
    assert!(max_difference(&base.get(0), &moved.get(0)) < 1e-12);
}
