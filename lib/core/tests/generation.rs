//! The cached generation loop against plain full forward passes: greedy continuations token for
//! token, log-probabilities equal to the log-softmax of full-forward logits, prompt scoring,
//! stop tokens and reproducible sampling — for learned-position and RoPE/GQA models.

use clap::Parser;
use megatron_core::args::ModelArgs;
use megatron_core::inference::{
    beam_search, generate_tokens, BeamSearchRequest, Generation, GenerationRequest, Sampling,
    StopCondition,
};
use megatron_core::model::{AttentionMask, GptModel, ModelOptions, Recompute};
use megatron_core::parallel::ParallelState;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
}

const VOCAB: i64 = 300;

fn model(extra: &[&str]) -> GptModel {
    let argv = [
        "test",
        "--num-layers",
        "3",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
    ]
    .into_iter()
    .chain(extra.iter().copied());
    let flags = Flags::try_parse_from(argv).unwrap();
    let config = flags.model.gpt_config(VOCAB).unwrap();
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 7,
    };
    GptModel::new(config, options, &ParallelState::single()).unwrap()
}

fn llama_like() -> GptModel {
    model(&[
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ])
}

/// Log-softmax of the full-forward logits over the true vocabulary, `[s, V]`.
fn full_logprobs(model: &GptModel, tokens: &[i64]) -> Tensor {
    let input = Tensor::from_slice(tokens).unsqueeze(0);
    let positions = Tensor::arange(tokens.len() as i64, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    let logits = tch::no_grad(|| {
        model
            .forward_full_logits(&input, &positions, &AttentionMask::Causal)
            .unwrap()
    });
    logits
        .select(1, 0)
        .narrow(1, 0, VOCAB)
        .log_softmax(-1, Kind::Float)
}

/// Greedy decoding one row at a time with a full forward per token: the reference.
fn reference_greedy(model: &GptModel, prompt: &[i64], total: usize, stop: i64) -> Vec<i64> {
    let mut tokens = prompt.to_vec();
    while tokens.len() < total {
        let next = full_logprobs(model, &tokens)
            .get(-1)
            .argmax(0, false)
            .int64_value(&[]);
        tokens.push(next);
        if next == stop {
            break;
        }
    }
    tokens
}

fn request(
    prompts: Vec<Vec<i64>>,
    tokens_to_generate: usize,
    sampling: Sampling,
    stop: StopCondition,
) -> GenerationRequest {
    GenerationRequest {
        prompts,
        tokens_to_generate,
        sampling,
        stop,
        prevent_newline_after_colon: None,
        logprobs: true,
        pad: 0,
    }
}

fn prompts() -> Vec<Vec<i64>> {
    vec![
        vec![5, 17, 42, 9, 120, 3],
        vec![250, 1],
        vec![77, 78, 79, 80],
    ]
}

fn check_logprobs(model: &GptModel, out: &Generation) {
    for (row, tokens) in out.tokens.iter().enumerate() {
        let expected = full_logprobs(model, tokens);
        let got = &out.logprobs.as_ref().unwrap()[row];
        assert_eq!(got.len(), tokens.len() - 1);
        for (i, (&lp, &token)) in got.iter().zip(&tokens[1..]).enumerate() {
            let want = expected.get(i as i64).double_value(&[token]);
            assert!(
                (lp as f64 - want).abs() < 1e-4,
                "row {row} position {}: {lp} vs full forward {want}",
                i + 1
            );
        }
    }
}

#[test]
fn cached_greedy_equals_full_forward_decoding() {
    for model in [model(&[]), llama_like()] {
        let out = generate_tokens(
            &model,
            &request(prompts(), 12, Sampling::greedy(), StopCondition::Never),
        )
        .unwrap();
        // Every row gets the longest prompt's budget: 6 + 12 positions.
        for (prompt, tokens) in prompts().iter().zip(&out.tokens) {
            assert_eq!(tokens, &reference_greedy(&model, prompt, 18, -1));
        }
        check_logprobs(&model, &out);
    }
}

#[test]
fn a_row_stops_at_its_stop_token_and_the_rest_go_on() {
    let model = model(&[]);
    let free = generate_tokens(
        &model,
        &request(prompts(), 12, Sampling::greedy(), StopCondition::Never),
    )
    .unwrap();
    // Stop on the token the second row generates first.
    let stop = free.tokens[1][2];
    let out = generate_tokens(
        &model,
        &request(
            prompts(),
            12,
            Sampling::greedy(),
            StopCondition::Token(stop),
        ),
    )
    .unwrap();
    for (prompt, tokens) in prompts().iter().zip(&out.tokens) {
        assert_eq!(tokens, &reference_greedy(&model, prompt, 18, stop));
    }
    assert_eq!(out.tokens[1].len(), 3);
}

#[test]
fn zero_tokens_scores_the_prompts() {
    let model = llama_like();
    let out = generate_tokens(
        &model,
        &request(prompts(), 0, Sampling::greedy(), StopCondition::Never),
    )
    .unwrap();
    assert_eq!(out.tokens, prompts());
    check_logprobs(&model, &out);
}

#[test]
fn sampling_is_reproducible_for_a_seed_and_stays_in_the_vocabulary() {
    let model = model(&[]);
    let sampling = Sampling {
        temperature: 0.9,
        top_k: 0,
        top_p: 0.8,
        top_p_decay: 0.9,
        top_p_bound: 0.5,
    };
    let run = |seed: i64| {
        tch::manual_seed(seed);
        generate_tokens(
            &model,
            &request(prompts(), 16, sampling, StopCondition::Never),
        )
        .unwrap()
    };
    let (a, b, c) = (run(11), run(11), run(12));
    assert_eq!(a, b);
    assert_ne!(a.tokens, c.tokens);
    assert!(a.tokens.iter().flatten().all(|&t| (0..VOCAB).contains(&t)));
    check_logprobs(&model, &a);
}

/// Sum of the full-forward log-probabilities of the tokens after the prompt.
fn generated_logprob(model: &GptModel, tokens: &[i64], prompt_len: usize) -> f64 {
    let logprobs = full_logprobs(model, tokens);
    (prompt_len..tokens.len())
        .map(|i| logprobs.get(i as i64 - 1).double_value(&[tokens[i]]))
        .sum()
}

#[test]
fn beam_search_scores_are_normalised_full_forward_logprobs() {
    let model = llama_like();
    let prompt = vec![5, 17, 42];
    let search = |width: usize| {
        let request = BeamSearchRequest {
            prompt: prompt.clone(),
            tokens_to_generate: 6,
            beam_width: width,
            stop_token: -1,
            length_penalty: 1.0,
            prevent_newline_after_colon: None,
        };
        beam_search(&model, &request).unwrap()
    };
    let one = search(1);
    assert_eq!(one.tokens, vec![reference_greedy(&model, &prompt, 9, -1)]);
    let three = search(3);
    assert_eq!(three.tokens.len(), 3);
    assert!(
        three.scores.windows(2).all(|w| w[0] >= w[1]),
        "{:?}",
        three.scores
    );
    for (tokens, &score) in three.tokens.iter().zip(&three.scores) {
        assert_eq!(&tokens[..3], prompt.as_slice());
        let expected = generated_logprob(&model, tokens, 3) / 6.0;
        assert!((score - expected).abs() < 1e-4, "{score} vs {expected}");
    }
    assert!(three.scores[0] >= one.scores[0] - 1e-6);
}
