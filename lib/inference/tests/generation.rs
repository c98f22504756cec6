//! The cached generation loop against plain full forward passes: greedy continuations token for
//! token, log-probabilities equal to the log-softmax of full-forward logits, prompt scoring,
//! stop tokens and reproducible sampling — for learned-position and RoPE/GQA models; the
//! paged decode step CUDA graphs replay (rows at different positions) against the cached forward, and on a GPU the
//! graphed decoder against the eager one; the most likely tokens at each position (OpenAI's
//! `top_logprobs`) against the full forward's, alone and in a shared batch.

use std::sync::Mutex;

use clap::Parser;
use megatron_inference::{
    beam_search, generate_tokens, BatchLimits, Batcher, BeamSearchRequest, CausalLm, DecodeRow,
    DecodeSettings, Decoder, Generation, GenerationRequest, LogitAdjust, PrefillChunk, Sampling,
    StopCondition, TopTokens,
};
use megatron_models::{AttentionMask, GptModel, ModelOptions, Recompute};
use megatron_parallel::ParallelState;
use megatron_training::args::ModelArgs;
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
}

const VOCAB: i64 = 300;

fn model(extra: &[&str]) -> GptModel {
    build(extra, 64, Device::Cpu)
}

fn build(extra: &[&str], positions: i64, device: Device) -> GptModel {
    build_sized(extra, positions, device, 64)
}

/// [`build`] with `hidden` channels in 4 heads.
fn build_sized(extra: &[&str], positions: i64, device: Device, hidden: i64) -> GptModel {
    let positions = positions.to_string();
    let hidden = hidden.to_string();
    let argv = [
        "test",
        "--num-layers",
        "3",
        "--hidden-size",
        &hidden,
        "--num-attention-heads",
        "4",
        "--seq-length",
        &positions,
        "--max-position-embeddings",
        &positions,
    ]
    .into_iter()
    .chain(extra.iter().copied());
    let flags = Flags::try_parse_from(argv).unwrap();
    let config = flags.model.gpt_config(VOCAB).unwrap();
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device,
        recompute: Recompute::None,
        seed: 7,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    GptModel::new(config, options, &ParallelState::single()).unwrap()
}

const LLAMA_FLAGS: [&str; 10] = [
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
];

fn llama_like() -> GptModel {
    model(&LLAMA_FLAGS)
}

/// Llama-like with per-head query and key norms and Mixture-of-Experts layers around a dense
/// one (4 experts, top-2, a gated shared expert): Qwen-MoE-shaped.
fn qwen_moe_flags() -> Vec<&'static str> {
    let moe = [
        "--qk-layernorm",
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--moe-layer-freq",
        "[1,0,1]",
        "--moe-shared-expert-intermediate-size",
        "32",
        "--moe-shared-expert-gate",
    ];
    LLAMA_FLAGS.iter().chain(&moe).copied().collect()
}

/// Generation with a fresh eager decoder.
/// Generation draws each request's seed from libtorch's default CPU generator, which the tests
/// of this binary share across their threads: generating holds this lock, and a test that seeds
/// the generator holds it from the seed to the generation, so that no other test draws between.
static DEFAULT_GENERATOR: Mutex<()> = Mutex::new(());

fn generate<M: CausalLm + ?Sized>(
    model: &M,
    request: &GenerationRequest,
) -> anyhow::Result<Generation> {
    generate_with(model, request, &mut Decoder::eager())
}

/// [`generate_tokens`] under [`DEFAULT_GENERATOR`].
fn generate_with<M: CausalLm + ?Sized>(
    model: &M,
    request: &GenerationRequest,
    decoder: &mut Decoder,
) -> anyhow::Result<Generation> {
    let _drawing = DEFAULT_GENERATOR.lock().unwrap_or_else(|p| p.into_inner());
    generate_tokens(model, request, decoder)
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
        top_logprobs: 0,
        pad: 0,
        adjust: LogitAdjust::default(),
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
    for model in [model(&[]), llama_like(), model(&qwen_moe_flags())] {
        let out = generate(
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
    let free = generate(
        &model,
        &request(prompts(), 12, Sampling::greedy(), StopCondition::Never),
    )
    .unwrap();
    // Stop on the token the second row generates first.
    let stop = free.tokens[1][2];
    let out = generate(
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
    let out = generate(
        &model,
        &request(prompts(), 0, Sampling::greedy(), StopCondition::Never),
    )
    .unwrap();
    assert_eq!(out.tokens, prompts());
    check_logprobs(&model, &out);
}

/// `out`'s alternatives (`n` per position after the first) are the full forward's `n` most
/// likely tokens, and a greedy token's log-probability is its first alternative's exactly.
fn check_alternatives(model: &GptModel, out: &Generation, n: usize, prompt_lengths: &[usize]) {
    let top = out
        .top_logprobs
        .as_ref()
        .expect("alternatives were asked for");
    let logprobs = out.logprobs.as_ref().unwrap();
    for (row, tokens) in out.tokens.iter().enumerate() {
        assert_eq!(top[row].len(), tokens.len() - 1, "row {row}");
        let (values, ids) = full_logprobs(model, tokens).topk(n as i64, -1, true, true);
        let values = Vec::<Vec<f32>>::try_from(values).unwrap();
        let ids = Vec::<Vec<i64>>::try_from(ids).unwrap();
        for (i, alternatives) in top[row].iter().enumerate() {
            let got_ids: Vec<i64> = alternatives.iter().map(|a| a.0).collect();
            assert_eq!(got_ids, ids[i], "row {row} position {}", i + 1);
            for (&(_, got), want) in alternatives.iter().zip(&values[i]) {
                assert!((got - want).abs() < 1e-4, "row {row}: {got} vs {want}");
            }
            if i + 1 >= prompt_lengths[row] {
                // Generated greedily: the likeliest, from the same log-softmax.
                assert_eq!(alternatives[0], (tokens[i + 1], logprobs[row][i]));
            }
        }
    }
}

/// With `top_logprobs`, every position's most likely tokens come from the step that scored
/// it: prefill chunks, decode steps and prompt scoring alike.
#[test]
fn alternatives_are_the_full_forwards_most_likely_tokens() {
    let model = llama_like();
    let lengths: Vec<usize> = prompts().iter().map(Vec::len).collect();
    for tokens_to_generate in [12, 0] {
        let mut asking = request(
            prompts(),
            tokens_to_generate,
            Sampling::greedy(),
            StopCondition::Never,
        );
        asking.top_logprobs = 3;
        let out = generate(&model, &asking).unwrap();
        check_alternatives(&model, &out, 3, &lengths);
        check_logprobs(&model, &out);
    }
}

/// Continuous batching: a request asking for alternatives, its two samples sharing one prefill
/// cut into chunks, next to a request that asks for none: the first gets the full forward's
/// alternatives at every position, as the observer saw them token by token; the second gets
/// none and the tokens it gets alone.
#[test]
fn alternatives_follow_their_rows_through_a_shared_batch() {
    let model = model(&[]);
    let mut decoder = Decoder::eager();
    let mut batcher = Batcher::new(BatchLimits {
        max_batch_size: 8,
        prefill_chunk: 4,
        max_queued: 4,
    });
    let prompt = vec![5, 17, 42, 9, 120, 3, 8, 8, 61];
    let mut asking = request(
        vec![prompt.clone()],
        10,
        Sampling::greedy(),
        StopCondition::Never,
    );
    asking.top_logprobs = 4;
    let mut plain = request(
        vec![vec![250, 1, 7]],
        14,
        Sampling::greedy(),
        StopCondition::Never,
    );
    plain.logprobs = false;
    let alone = generate(&model, &plain).unwrap();
    batcher
        .submit(&model, &mut decoder, 0, plain.rows(1).unwrap())
        .unwrap();
    batcher
        .submit(&model, &mut decoder, 1, asking.sampled_rows(2, 2).unwrap())
        .unwrap();
    let mut seen: Vec<Vec<TopTokens>> = vec![Vec::new(); 2];
    let mut finished = Vec::new();
    while !batcher.is_idle() {
        let step = batcher
            .step(&model, &mut decoder, &mut |new| {
                if new.request == 1 {
                    assert_eq!(new.top_logprobs.len(), new.logprobs.len());
                    seen[new.row].push(new.top_logprobs.last().unwrap().clone());
                } else {
                    assert!(new.logprobs.is_empty() && new.top_logprobs.is_empty());
                }
                false
            })
            .unwrap();
        finished.extend(step);
    }
    finished.sort_by_key(|(id, _)| *id);
    let [(_, plain_out), (_, asked)] = &finished[..] else {
        panic!("two requests finish");
    };
    assert_eq!(plain_out.tokens, alone.tokens);
    assert_eq!(plain_out.top_logprobs, None);
    check_alternatives(&model, asked, 4, &[prompt.len(); 2]);
    for (row, streamed) in seen.iter().enumerate() {
        let top = &asked.top_logprobs.as_ref().unwrap()[row];
        assert_eq!(streamed[..], top[prompt.len() - 1..], "row {row}");
    }
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
        let _drawing = DEFAULT_GENERATOR.lock().unwrap_or_else(|p| p.into_inner());
        tch::manual_seed(seed);
        let request = request(prompts(), 16, sampling, StopCondition::Never);
        generate_tokens(&model, &request, &mut Decoder::eager()).unwrap()
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

/// Rows at different positions in one paged decode step (what the batcher runs, and what CUDA
/// graphs replay padded to a bucket), after prompts prefilled in two padded batches of chunks,
/// give each row's cached-forward logits, on the CPU; for GPT, Llama-like and Qwen-MoE-shaped
/// models (per-head query and key norms; the decode steps' experts each run over every row,
/// the cached forward's only over the tokens routed to them).
#[test]
fn paged_steps_of_rows_at_different_positions_equal_the_cached_forward() {
    paged_steps_equal_the_cached_forward(Device::Cpu, 1e-5);
}

/// The same on a GPU: prefill chunks through the memory-efficient attention kernel, decode
/// steps through the paged decode kernel (heads of 64 channels).
#[test]
fn paged_steps_on_a_gpu_equal_the_cached_forward() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    paged_steps_equal_the_cached_forward(Device::Cuda(0), 1e-4);
}

fn paged_steps_equal_the_cached_forward(device: Device, tolerance: f64) {
    let hidden = if device.is_cuda() { 256 } else { 64 };
    let models = [
        build_sized(&[], 64, device, hidden),
        build_sized(&LLAMA_FLAGS, 64, device, hidden),
        build_sized(&qwen_moe_flags(), 64, device, hidden),
    ];
    for model in models {
        let prompts = [
            vec![5i64, 17, 42, 9, 7],
            vec![8, 1],
            vec![2, 3, 4, 5, 6, 7, 8, 9, 10],
        ];
        tch::no_grad(|| {
            let mut decoder = Decoder::eager();
            let cache = decoder.cache(&model, 3, true).unwrap();
            let blocks: Vec<Vec<i64>> = (0..3).map(|_| cache.allocate(2).unwrap()).collect();
            let mut references: Vec<_> =
                (0..3).map(|_| model.new_kv_cache(1, 32).unwrap()).collect();
            let close = |got: &Tensor, want: &Tensor, what: &str| {
                let diff = (got - want).abs().max().double_value(&[]);
                assert!(diff < tolerance, "{what}: logits differ by {diff}");
            };
            // The prompts' halves, three rows of different lengths per forward.
            let split = |prompt: &Vec<i64>| prompt.len() / 2;
            let halves = |first: bool| -> Vec<PrefillChunk> {
                prompts
                    .iter()
                    .zip(&blocks)
                    .map(|(prompt, blocks)| {
                        let (start, tokens) = if first {
                            (0, &prompt[..split(prompt)])
                        } else {
                            (split(prompt), &prompt[split(prompt)..])
                        };
                        PrefillChunk {
                            tokens,
                            start: start as i64,
                            blocks,
                        }
                    })
                    .collect()
            };
            let _ = decoder.prefill(&model, &halves(true)).unwrap();
            let got = decoder.prefill(&model, &halves(false)).unwrap();
            for (row, prompt) in prompts.iter().enumerate() {
                let input = Tensor::from_slice(prompt).unsqueeze(0).to_device(device);
                let want = model.forward_cached(&input, &mut references[row]).unwrap();
                let rest = (prompt.len() - split(prompt)) as i64;
                let want = want.narrow(0, split(prompt) as i64, rest).select(1, 0);
                close(&got[row], &want, "prefill");
            }
            for step in 0..8i64 {
                let tokens = [step * 31 % VOCAB, step + 100, 250 - step];
                let rows: Vec<DecodeRow> = (0..3)
                    .map(|row| DecodeRow {
                        token: tokens[row],
                        position: prompts[row].len() as i64 + step,
                        blocks: &blocks[row],
                    })
                    .collect();
                let got = decoder.decode(&model, &rows, None).unwrap();
                for row in 0..3 {
                    let input = Tensor::from_slice(&[tokens[row]])
                        .view([1, 1])
                        .to_device(device);
                    let want = model.forward_cached(&input, &mut references[row]).unwrap();
                    close(
                        &got.get(row as i64),
                        &want.get(0).get(0),
                        &format!("step {step}, row {row}"),
                    );
                }
            }
        });
    }
}

/// A decoder keeps its cache between generations of the same shape: the second generation must
/// not see the first one's keys and values.
#[test]
fn a_reused_decoder_gives_what_a_fresh_one_gives() {
    let model = llama_like();
    let first = request(prompts(), 12, Sampling::greedy(), StopCondition::Never);
    let mut second = first.clone();
    second.prompts = vec![vec![9, 9, 9, 9, 9, 9], vec![3], vec![200, 100, 50]];
    let mut decoder = Decoder::eager();
    generate_with(&model, &first, &mut decoder).unwrap();
    let reused = generate_with(&model, &second, &mut decoder).unwrap();
    assert_eq!(reused, generate(&model, &second).unwrap());
}

/// The engine takes any [`CausalLm`]: through a trait object, as a server holding any model
/// family would, it generates, scores prompts and beam-searches exactly as with the concrete
/// model.
#[test]
fn a_model_behind_the_causal_lm_trait_generates_as_the_concrete_one() {
    let model = llama_like();
    let any: &dyn CausalLm = &model;
    for tokens_to_generate in [12, 0] {
        let request = request(
            prompts(),
            tokens_to_generate,
            Sampling::greedy(),
            StopCondition::Never,
        );
        let concrete = generate(&model, &request).unwrap();
        assert_eq!(generate(any, &request).unwrap(), concrete);
    }
    let search = BeamSearchRequest {
        prompt: vec![5, 17, 42],
        tokens_to_generate: 6,
        beam_width: 3,
        stop_token: -1,
        length_penalty: 1.0,
        prevent_newline_after_colon: None,
    };
    assert_eq!(
        beam_search(any, &search).unwrap(),
        beam_search(&model, &search).unwrap()
    );
}

/// On a GPU, decode steps replayed from CUDA graphs with the paged decode kernel (heads of 64
/// channels, grouped in the Llama-like model) give the tokens of the eager decoder with
/// gathered attention, and log-probabilities within float32 noise, across several windows and
/// a reused decoder.
#[test]
fn cuda_graph_decoding_equals_eager_decoding() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    assert!(
        megatron_kernels::runtime::cuda_graphs_available(),
        "this build has no CUDA graphs (see build.rs's warning)"
    );
    let learned: [&str; 0] = [];
    let qwen_moe = qwen_moe_flags();
    for flags in [&learned[..], &LLAMA_FLAGS[..], &qwen_moe[..]] {
        let model = build_sized(flags, 320, Device::Cuda(0), 256);
        let mut graphed = Decoder::new(DecodeSettings::default());
        for prompts in [prompts(), vec![vec![1, 2, 3], vec![4; 40], vec![250; 7]]] {
            // Up to 40 + 200 positions: the windows of 128 and 256 slots.
            let request = request(prompts, 200, Sampling::greedy(), StopCondition::Never);
            let mut gathered = Decoder::new(DecodeSettings {
                cuda_graphs: false,
                paged_attention: false,
                ..DecodeSettings::default()
            });
            let eager = generate_with(&model, &request, &mut gathered).unwrap();
            let replayed = generate_with(&model, &request, &mut graphed).unwrap();
            assert_eq!(replayed.tokens, eager.tokens);
            let (a, b) = (replayed.logprobs.unwrap(), eager.logprobs.unwrap());
            for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
                assert!((x - y).abs() < 1e-3, "{x} vs {y}");
            }
            // The alternatives of graphed steps, taken from the graph's logits.
            let mut asking = request.clone();
            asking.top_logprobs = 5;
            let eager = generate_with(&model, &asking, &mut gathered).unwrap();
            let replayed = generate_with(&model, &asking, &mut graphed).unwrap();
            let (a, b) = (replayed.top_logprobs.unwrap(), eager.top_logprobs.unwrap());
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
                assert_eq!(x.len(), 5);
                assert_eq!(x[0].0, y[0].0);
                for ((_, u), (_, v)) in x.iter().zip(y) {
                    assert!((u - v).abs() < 1e-3, "{u} vs {v}");
                }
            }
        }
    }
}

/// `prevent_newline_after_colon`: the "newline" never follows the "colon", whichever rows of
/// the batch are at a colon, and the rows that never see one are untouched.
#[test]
fn no_newline_follows_a_colon_when_asked() {
    let model = model(&[]);
    let free = generate(
        &model,
        &request(prompts(), 24, Sampling::greedy(), StopCondition::Never),
    )
    .unwrap();
    // The first generated token of row 0 plays the colon, the token it is followed by the
    // newline.
    let start = prompts()[0].len();
    let colon = free.tokens[0][start];
    let newline = free.tokens[0][start + 1];
    let mut asked = request(prompts(), 24, Sampling::greedy(), StopCondition::Never);
    asked.prevent_newline_after_colon = Some((colon, newline));
    let ruled = generate(&model, &asked).unwrap();
    assert_ne!(ruled.tokens[0], free.tokens[0]);
    for (row, tokens) in ruled.tokens.iter().enumerate() {
        let generated = &tokens[prompts()[row].len() - 1..];
        assert!(
            generated.windows(2).all(|w| w != [colon, newline]),
            "row {row}: {tokens:?}"
        );
        if !free.tokens[row].contains(&colon) {
            assert_eq!(tokens, &free.tokens[row], "row {row}");
        }
    }
}
