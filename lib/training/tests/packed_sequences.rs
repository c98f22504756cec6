//! Packed sequences (`--reset-position-ids --reset-attention-mask --eod-mask-loss`): attention
//! runs per document from the documents' offsets. In float32 on the CPU, each document's loss
//! and the gradients of a packed micro-batch equal those of each document run alone, and, with
//! learned absolute positions, those of the dense `[s, s]` mask Megatron builds (and this
//! project built before packing). Under context parallelism (CPU ranks as threads, every
//! exchange) the ranks' losses and gradients add up to the one-rank packed step's. On a GPU,
//! libtorch's varlen flash attention equals causal attention run per document.

use std::time::Duration;

use clap::Parser;
use megatron_data::gpt::{GptSample, SampleOptions};
use megatron_models::layers::{ContextExchange, ContextParallel, PackedSequences};
use megatron_models::{AttentionMask, GptBatch, GptModel, ModelOptions, Recompute};
use megatron_parallel::{ParallelState, ThreadWorld};
use megatron_training::args::ModelArgs;
use megatron_training::families::{GptFamily, LossTotals, ModelFamily, StepOutput};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
}

const EOD: i64 = 0;
const VOCAB: i64 = 64;
const SEQ: usize = 24;

fn config(extra: &[&str]) -> megatron_models::TransformerConfig {
    let argv: Vec<&str> = [
        &[
            "test",
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "24",
            "--max-position-embeddings",
            "24",
        ],
        extra,
    ]
    .concat();
    let flags = Flags::try_parse_from(&argv).unwrap();
    flags.model.gpt_config(VOCAB).unwrap()
}

fn model(extra: &[&str]) -> GptModel {
    let config = config(extra);
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 1234,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    GptModel::new(config, options, &ParallelState::single()).unwrap()
}

/// Llama-style: RoPE, grouped-query attention, SwiGLU, RMSNorm.
const LLAMA: &[&str] = &[
    "--position-embedding-type",
    "rope",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--disable-bias-linear",
];

/// Two sequences of `SEQ` tokens (with the extra label token), each packing documents that end
/// with EOD; the last runs past the window's end, as Megatron's samples do.
fn texts() -> Vec<Vec<i64>> {
    let document = |length: usize, seed: i64| -> Vec<i64> {
        let mut tokens: Vec<i64> = (0..length as i64 - 1)
            .map(|i| 1 + (i * 7 + seed * 13) % (VOCAB - 1))
            .collect();
        tokens.push(EOD);
        tokens
    };
    let pack = |lengths: &[usize], seed: i64| -> Vec<i64> {
        let mut text: Vec<i64> = lengths
            .iter()
            .enumerate()
            .flat_map(|(i, &n)| document(n, seed + i as i64))
            .collect();
        text.truncate(SEQ + 1);
        text
    };
    vec![pack(&[5, 9, 1, 12], 1), pack(&[13, 3, 20], 5)]
}

fn samples() -> Vec<GptSample> {
    let options = SampleOptions {
        eod_token: EOD,
        pad_token: -1,
        reset_position_ids: true,
        reset_attention_mask: true,
        eod_mask_loss: true,
        create_attention_mask: true,
    };
    texts()
        .iter()
        .map(|text| GptSample::from_text(text, true, &options))
        .collect()
}

/// Per-token cross-entropy `[b, s]` of the model's logits for `batch` under `mask`.
fn token_losses(model: &GptModel, batch: &GptBatch, mask: &AttentionMask) -> Tensor {
    let logits = model
        .forward(&batch.tokens, &batch.position_ids, mask, false)
        .unwrap()
        .transpose(0, 1);
    -logits
        .log_softmax(-1, Kind::Float)
        .gather(-1, &batch.labels.unsqueeze(-1), false)
        .squeeze_dim(-1)
}

fn gradients(model: &GptModel, loss: &Tensor) -> Vec<Tensor> {
    let parameters: Vec<Tensor> = model
        .named_parameters()
        .into_iter()
        .map(|p| p.tensor)
        .collect();
    Tensor::run_backward(&[loss], &parameters, false, false)
}

fn assert_close(actual: &Tensor, expected: &Tensor, what: &str) {
    let scale = expected.abs().max().double_value(&[]).max(1.0);
    let difference = (actual - expected).abs().max().double_value(&[]);
    assert!(
        difference <= 1e-5 * scale,
        "{what}: differs by {difference} (scale {scale})"
    );
}

/// Each document's loss (and the gradient of their sum) from the packed batch equals the
/// document run alone, causal from position 0.
fn packed_equals_each_document_alone(extra: &[&str]) {
    let model = model(extra);
    let samples = samples();
    let batch = GptBatch::collate(&samples).unwrap();
    assert!(matches!(batch.mask(), AttentionMask::Packed(_)));
    let losses = token_losses(&model, &batch, &batch.mask()) * &batch.loss_mask;
    let packed_gradients = gradients(&model, &losses.sum(Kind::Float));

    let mut alone_total = Tensor::zeros([], (Kind::Float, Device::Cpu));
    let mut documents = 0;
    for (row, sample) in samples.iter().enumerate() {
        let mut start = 0usize;
        for &length in sample.document_lengths.as_ref().unwrap() {
            let length = length as usize;
            let range = start..start + length;
            let alone = GptSample {
                tokens: sample.tokens[range.clone()].to_vec(),
                labels: sample.labels[range.clone()].to_vec(),
                loss_mask: sample.loss_mask[range.clone()].to_vec(),
                position_ids: (0..length as i64).collect(),
                attention_mask: None,
                document_lengths: None,
            };
            let alone = GptBatch::collate(&[alone]).unwrap();
            assert!(matches!(alone.mask(), AttentionMask::Causal));
            let alone_loss =
                (token_losses(&model, &alone, &alone.mask()) * &alone.loss_mask).sum(Kind::Float);
            let packed_loss = losses
                .get(row as i64)
                .narrow(0, start as i64, length as i64)
                .sum(Kind::Float);
            assert_close(
                &packed_loss,
                &alone_loss,
                &format!("loss of document {documents} (sequence {row}, tokens {range:?})"),
            );
            alone_total = alone_total + alone_loss;
            start += length;
            documents += 1;
        }
    }
    assert_eq!(documents, 7, "the fixture packs 4 + 3 documents");
    for (i, (packed, alone)) in packed_gradients
        .iter()
        .zip(gradients(&model, &alone_total))
        .enumerate()
    {
        assert_close(packed, &alone, &format!("gradient of parameter {i}"));
    }
}

#[test]
fn packed_documents_equal_documents_alone_gpt() {
    packed_equals_each_document_alone(&[]);
}

#[test]
fn packed_documents_equal_documents_alone_llama() {
    packed_equals_each_document_alone(LLAMA);
}

/// With learned absolute positions (reset per document), packing computes what the dense
/// `[b, 1, s, s]` mask of `--reset-attention-mask` computed: losses and gradients.
#[test]
fn packed_documents_equal_the_dense_reset_mask() {
    let model = model(&[]);
    let batch = GptBatch::collate(&samples()).unwrap();
    let dense = AttentionMask::Explicit(batch.attention_mask.as_ref().unwrap().shallow_clone());
    let packed = token_losses(&model, &batch, &batch.mask()) * &batch.loss_mask;
    let reference = token_losses(&model, &batch, &dense) * &batch.loss_mask;
    assert_close(&packed, &reference, "per-token losses");
    let packed_gradients = gradients(&model, &packed.sum(Kind::Float));
    let reference_gradients = gradients(&model, &reference.sum(Kind::Float));
    for (i, (a, b)) in packed_gradients
        .iter()
        .zip(&reference_gradients)
        .enumerate()
    {
        assert_close(a, b, &format!("gradient of parameter {i}"));
    }
}

/// The GPT family's step on `batch` with `context` (this rank's chunks then), without
/// dropout: the summed token losses, their token count and the parameters' gradients.
fn family_step(
    extra: &[&str],
    context: Option<ContextParallel>,
    batch: &GptBatch,
) -> anyhow::Result<(f64, f64, Vec<Tensor>)> {
    let family = GptFamily {
        config: config(extra),
        eod: EOD,
        cross_entropy_loss_fusion: false,
        context,
    };
    let model = model(extra);
    let mut losses = LossTotals::new(family.loss_names(), Device::Cpu);
    let StepOutput::TokenLoss { sum, tokens } =
        family.forward_step(&model, batch, None, false, &mut losses)?
    else {
        anyhow::bail!("GPT's step gives token losses");
    };
    let gradients = gradients(&model, &sum);
    Ok((sum.double_value(&[]), tokens.double_value(&[]), gradients))
}

/// Packed sequences under context parallelism (`--reset-attention-mask` with
/// `--context-parallel-size`): over CP = 2 and 4 ranks with every exchange, the ranks' summed
/// token losses, token counts and gradients add up to the one-rank packed step's (the
/// fixture's documents cross the chunks' boundaries; one is a single token).
fn packed_under_context_parallelism_equals_one_rank(extra: &[&str]) {
    let batch = GptBatch::collate(&samples()).unwrap();
    let (loss, tokens, reference) = family_step(extra, None, &batch).unwrap();
    let cases = [
        (ContextExchange::Ring, 2),
        (ContextExchange::Ring, 4),
        (ContextExchange::AllGather, 2),
        (ContextExchange::AllGather, 4),
        (ContextExchange::AllToAll, 2),
        (ContextExchange::AllToAll, 4),
        (ContextExchange::AllToAllThenRing { a2a_size: 2 }, 4),
    ];
    for (exchange, size) in cases {
        let world = ThreadWorld::new(size, Duration::from_secs(60));
        let members: Vec<usize> = (0..size).collect();
        let ranks = world
            .run(|rank| {
                let context =
                    ContextParallel::new(world.group("context", &members, rank)?, exchange);
                family_step(extra, Some(context), &GptBatch::collate(&samples())?)
            })
            .unwrap();
        let what = format!("{exchange:?} CP={size}");
        let rank_loss: f64 = ranks.iter().map(|r| r.0).sum();
        assert!(
            (rank_loss - loss).abs() <= 1e-5 * loss.abs(),
            "{what}: the ranks' losses sum to {rank_loss}, one rank's is {loss}"
        );
        let rank_tokens: f64 = ranks.iter().map(|r| r.1).sum();
        assert_eq!(rank_tokens, tokens, "{what}: tokens");
        for (i, expected) in reference.iter().enumerate() {
            let summed = ranks
                .iter()
                .map(|r| r.2[i].shallow_clone())
                .reduce(|a, b| a + b)
                .unwrap();
            assert_close(
                &summed,
                expected,
                &format!("{what}: gradient of parameter {i}"),
            );
        }
    }
}

#[test]
fn packed_under_context_parallelism_equals_one_rank_gpt() {
    packed_under_context_parallelism_equals_one_rank(&[]);
}

#[test]
fn packed_under_context_parallelism_equals_one_rank_llama() {
    packed_under_context_parallelism_equals_one_rank(LLAMA);
}

/// Documents that do not make up the sequence are refused by name.
#[test]
fn documents_that_do_not_fill_the_sequence_are_refused() {
    let error = PackedSequences::from_lengths(&[vec![3, 4], vec![2, 4]], 7)
        .err()
        .expect("[2, 4] do not make up 7 tokens");
    assert!(error.to_string().contains("sequence 1"), "{error}");
}

/// Varlen flash attention (bf16) equals causal SDPA run per document, forward and gradients.
#[test]
fn gpu_varlen_flash_equals_attention_per_document() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let device = Device::Cuda(0);
    let lengths = vec![vec![700, 1, 300, 23], vec![1024], vec![17, 1007]];
    let (b, n, s, d) = (3i64, 8i64, 1024i64, 64i64);
    let packed = PackedSequences::from_lengths(&lengths, s)
        .unwrap()
        .map_tensors(&mut |t| t.to_device(device));
    tch::manual_seed(7);
    let make = || Tensor::randn([b, n, s, d], (Kind::BFloat16, device)).set_requires_grad(true);
    let (q, k, v) = (make(), make(), make());
    let out_grad = Tensor::randn([b, n, s, d], (Kind::BFloat16, device));

    let flash = packed.attend(&q, &k, &v, 0.0).unwrap();
    let weighted = (&flash * &out_grad).sum(Kind::Float);
    let flash_grads = Tensor::run_backward(&[&weighted], &[&q, &k, &v], false, false);

    let mut rows = Vec::new();
    for (row, documents) in lengths.iter().enumerate() {
        let mut parts = Vec::new();
        let mut start = 0;
        for &length in documents {
            let part = |t: &Tensor| t.get(row as i64).narrow(1, start, length).unsqueeze(0);
            parts.push(
                Tensor::scaled_dot_product_attention::<&Tensor>(
                    &part(&q),
                    &part(&k),
                    &part(&v),
                    None,
                    0.0,
                    true,
                    None,
                    false,
                )
                .squeeze_dim(0),
            );
            start += length;
        }
        rows.push(Tensor::cat(&parts, 1));
    }
    let reference = Tensor::stack(&rows, 0);
    let weighted_reference = (&reference * &out_grad).sum(Kind::Float);
    let reference_grads = Tensor::run_backward(&[&weighted_reference], &[&q, &k, &v], false, false);

    let close = |a: &Tensor, e: &Tensor, what: &str| {
        let (a, e) = (a.to_kind(Kind::Float), e.to_kind(Kind::Float));
        let difference = (&a - &e).abs().max().double_value(&[]);
        let scale = 1.0 + e.abs().max().double_value(&[]);
        // bf16 keeps 8 bits of mantissa; the two kernels round in different orders.
        assert!(
            difference <= 2e-2 * scale,
            "{what}: differs by {difference} (scale {scale})"
        );
    };
    close(&flash, &reference, "output");
    for (name, (a, e)) in ["query", "key", "value"]
        .iter()
        .zip(flash_grads.iter().zip(&reference_grads))
    {
        close(a, e, &format!("gradient of the {name}"));
    }
}
