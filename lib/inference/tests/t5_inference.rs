//! `generate_samples_t5`'s library side: teacher-forced scores equal the loss the training step
//! computes on the same batch and weights; greedy decoding through the decoder's KV cache gives
//! the tokens of a greedy loop over the independent reference
//! (`scripts/reference/megatron_t5_reference.py greedy`, the whole model recomputed each step);
//! the cached decoder's logits equal the full decoder's; two tensor-parallel ranks (threads)
//! score and decode as one rank, the vocabulary padding they add included.

// The training tests' support: a T5 trained with ranks as threads to score and decode.
#[path = "../../training/tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::time::Duration;

use megatron_inference::{greedy_decode, score_t5_batch, GreedyOptions, ScoreTotals};
use megatron_models::t5::{MockT5Source, T5Batch};
use megatron_models::{ModelChunk, ModelOptions, Recompute, T5Input, T5Model};
use megatron_parallel::{ParallelLayout, ParallelState, ThreadWorld};
use megatron_store::split_for_tensor_parallel;
use megatron_training::{LossTotals, ModelFamily, T5Family};
use support::reference;
use tch::{Device, Kind, Tensor};

fn options(kind: Kind, seed: u64) -> ModelOptions {
    ModelOptions {
        params_dtype: kind,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed,
        bias_dropout_fusion: true,
        rope_fusion: false,
    }
}

fn mock_batch(vocab_size: i64, rows: u64) -> T5Batch {
    let source = MockT5Source {
        samples: rows,
        encoder_seq_length: 12,
        decoder_seq_length: 8,
        vocab_size,
        seed: 5,
    };
    let rows: Vec<_> = (0..rows).map(|i| source.row(i)).collect();
    T5Batch::collate(&rows).unwrap()
}

#[test]
fn teacher_forced_scores_equal_the_training_loss() {
    let config = reference::t5_config(300);
    let parallel = ParallelState::single();
    let model = T5Model::new(config.clone(), options(Kind::Float, 7), &parallel).unwrap();
    let batch = mock_batch(300, 6);
    let family = T5Family {
        config,
        decoder_seq_length: 8,
        vocab_extra_ids: 0,
        mask_prob: 0.15,
        short_seq_prob: 0.1,
        cross_entropy_loss_fusion: false,
    };
    let mut losses = LossTotals::new(family.loss_names(), Device::Cpu);
    tch::no_grad(|| family.forward_step(&model, &batch, None, false, &mut losses)).unwrap();
    let training = losses.reduce(&parallel).unwrap()[0].1;

    let scores = score_t5_batch(&model, &batch).unwrap();
    assert_eq!(scores.len(), 6);
    let mut totals = ScoreTotals::default();
    scores.iter().for_each(|s| totals.add(s));
    assert_eq!(
        totals.total.tokens as f64,
        batch.loss_mask.sum(Kind::Double).double_value(&[])
    );
    eprintln!(
        "training lm loss {training}, scored {}",
        totals.total.loss()
    );
    assert!(
        (totals.total.loss() - training).abs() < 1e-5 * training,
        "scored {} against the training step's {training}",
        totals.total.loss()
    );
    // A random model is near the uniform loss and rarely right.
    assert!((training - 384f64.ln()).abs() < 1.0, "{training}");
    assert!(totals.total.accuracy() < 0.2);
    // Per sample: the token-averaged loss of its own targets.
    let first_tokens = batch.loss_mask.get(0).sum(Kind::Double).double_value(&[]);
    assert_eq!(scores[0].tokens as f64, first_tokens);
}

/// The reference's weights and its greedy decodings.
fn reference_greedy() -> (HashMap<String, Tensor>, HashMap<String, Tensor>) {
    let dir = reference::run_script("megatron_t5_reference.py", &["greedy"]);
    (
        reference::tensors(&dir, "model.safetensors"),
        reference::tensors(&dir, "greedy.safetensors"),
    )
}

/// The rows of a `[b, steps]` token tensor padded with -1, as lists.
fn rows(tokens: &Tensor) -> Vec<Vec<i64>> {
    (0..tokens.size()[0])
        .map(|r| {
            Vec::<i64>::try_from(tokens.get(r))
                .unwrap()
                .into_iter()
                .filter(|&t| t >= 0)
                .collect()
        })
        .collect()
}

#[test]
fn greedy_tokens_equal_the_reference_greedy_loop() {
    let (weights, io) = reference_greedy();
    let model = T5Model::new(
        reference::t5_config(128),
        options(Kind::Double, 1),
        &ParallelState::single(),
    )
    .unwrap();
    model.load_parameters(&weights).unwrap();
    let (tokens, mask) = (&io["enc_tokens"], &io["enc_mask"]);
    let free = GreedyOptions {
        max_decode_length: 10,
        bos: 1,
        eos: None,
    };
    let decoded = greedy_decode(&model, tokens, mask, &free).unwrap();
    let expected = rows(&io["free"]);
    assert_eq!(decoded, expected);
    // Not one token repeated: the test sees the decoder's choices.
    let distinct: std::collections::BTreeSet<i64> = decoded.concat().into_iter().collect();
    assert!(distinct.len() > 3, "{decoded:?}");

    let eos = io["eos"].int64_value(&[0]);
    let stopped = greedy_decode(
        &model,
        tokens,
        mask,
        &GreedyOptions {
            eos: Some(eos),
            ..free
        },
    )
    .unwrap();
    assert_eq!(stopped, rows(&io["stopped"]));
    assert!(
        stopped[0].len() < 10 && stopped[1].len() == 10,
        "{stopped:?}"
    );

    // Too many positions for the model is an error, not a panic.
    let long = GreedyOptions {
        max_decode_length: 33,
        ..free
    };
    let error = greedy_decode(&model, tokens, mask, &long)
        .unwrap_err()
        .to_string();
    assert!(error.contains("--max-position-embeddings"), "{error}");
}

#[test]
fn cached_decoder_logits_equal_the_full_decoder() {
    let model = T5Model::new(
        reference::t5_config(300),
        options(Kind::Double, 3),
        &ParallelState::single(),
    )
    .unwrap();
    let batch = mock_batch(300, 3);
    let full = tch::no_grad(|| {
        model.forward(
            &T5Input {
                encoder_tokens: &batch.text_enc,
                decoder_tokens: &batch.text_dec,
                encoder_mask: &batch.enc_mask,
            },
            false,
        )
    })
    .unwrap();
    tch::no_grad(|| {
        let memory = model
            .encode(&batch.text_enc, &batch.enc_mask, false)
            .unwrap();
        // Three positions at once, then one at a time.
        let mut state = model.start_decoding(&memory, 8).unwrap();
        let mut parts = vec![model
            .decode_cached(&batch.text_dec.narrow(1, 0, 3), &mut state)
            .unwrap()];
        for position in 3..8 {
            parts.push(
                model
                    .decode_cached(&batch.text_dec.narrow(1, position, 1), &mut state)
                    .unwrap(),
            );
        }
        assert_eq!(state.len(), 8);
        let cached = Tensor::cat(&parts, 0);
        let difference = (cached - &full).abs().max().double_value(&[]);
        assert!(difference < 1e-10, "cached logits differ by {difference:e}");
        assert!(model
            .decode_cached(&batch.text_dec.narrow(1, 0, 1), &mut state)
            .is_err());
    });
}

#[test]
fn two_tensor_parallel_ranks_score_and_decode_as_one() {
    // 300 tokens pad to 384 on one rank and to 512 on two: the extra rows must not count.
    let config = reference::t5_config(300);
    let single = T5Model::new(
        config.clone(),
        options(Kind::Double, 11),
        &ParallelState::single(),
    )
    .unwrap();
    let batch = mock_batch(300, 4);
    let greedy = GreedyOptions {
        max_decode_length: 6,
        bos: 1,
        eos: Some(2),
    };
    let expected_scores = score_t5_batch(&single, &batch).unwrap();
    let expected_tokens =
        greedy_decode(&single, &batch.text_enc, &batch.enc_mask, &greedy).unwrap();
    // Tensors are not Sync: the ranks take the weights through a lock and build the batch.
    let weights: std::sync::Mutex<HashMap<String, Tensor>> = std::sync::Mutex::new(
        single
            .named_parameters()
            .into_iter()
            .map(|p| (p.name, p.tensor.detach().copy()))
            .collect(),
    );

    let world = ThreadWorld::new(2, Duration::from_secs(60));
    let results = world
        .run(|rank| {
            let layout = ParallelLayout::new(2, 2, 1)?;
            let parallel = ParallelState::threads(&world, layout, rank, false)?;
            let model = T5Model::new(config.clone(), options(Kind::Double, 11), &parallel)?;
            let shard =
                split_for_tensor_parallel(&weights.lock().unwrap(), &config.transformer, rank, 2);
            model.load_parameters(&shard)?;
            let batch = mock_batch(300, 4);
            let scores = score_t5_batch(&model, &batch)?;
            let tokens = greedy_decode(&model, &batch.text_enc, &batch.enc_mask, &greedy)?;
            Ok((scores, tokens))
        })
        .unwrap();
    for (scores, tokens) in results {
        assert_eq!(tokens, expected_tokens);
        for (got, want) in scores.iter().zip(&expected_scores) {
            assert_eq!((got.tokens, got.correct), (want.tokens, want.correct));
            // The per-token cross entropy is float32.
            assert!(
                (got.loss_sum - want.loss_sum).abs() < 1e-6 * want.loss_sum,
                "{got:?} vs {want:?}"
            );
        }
    }
}
