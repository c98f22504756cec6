//! Continuous batching in `TextGenerationService`: many requests in flight at once each get
//! exactly what they get alone (greedy and seeded sampling, several prompts per request,
//! log-probabilities, stop conditions, completions with stop sequences); a request whose client
//! goes away frees its KV cache blocks at the next step; a tiny KV cache budget is never
//! exceeded (requests wait, then complete) and a request that can never fit is refused; a full
//! queue is answered as busy; first tokens come in arrival order, and with room for every
//! request none waits for another's completion.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use megatron_data::tokenizer::NullTokenizer;
use megatron_inference::{
    BatchLimits, Batcher, CausalLm, DecodeSettings, Decoder, GenerationRequest, KvBudget,
    LogitAdjust, Sampling, StopCondition,
};
use megatron_models::{GptModel, ModelOptions, Recompute};
use megatron_parallel::ParallelState;
use megatron_serving::api::ApiRequest;
use megatron_serving::openai::CompletionRequest;
use megatron_serving::{
    CancelFlag, ClientGone, ServiceError, ServingSettings, TextGenerationService,
};
use megatron_training::args::ModelArgs;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
}

/// Token ids 0..299, end of document 299.
const VOCAB: u32 = 299;
const POSITIONS: i64 = 256;

fn model() -> GptModel {
    model_on(Device::Cpu)
}

fn model_on(device: Device) -> GptModel {
    model_of(
        device,
        &["--hidden-size", "64", "--num-attention-heads", "4"],
        Kind::Float,
    )
}

/// A GPU model whose heads have 64 channels (the paged decode kernel's smallest), 8 query heads
/// in 4 groups.
fn gpu_model(kind: Kind) -> GptModel {
    model_of(
        Device::Cuda(0),
        &[
            "--hidden-size",
            "512",
            "--num-attention-heads",
            "8",
            "--group-query-attention",
            "--num-query-groups",
            "4",
        ],
        kind,
    )
}

fn model_of(device: Device, shape: &[&str], params_dtype: Kind) -> GptModel {
    let positions = POSITIONS.to_string();
    let mut argv = vec!["test", "--num-layers", "2"];
    argv.extend_from_slice(shape);
    argv.extend([
        "--seq-length",
        &positions,
        "--max-position-embeddings",
        &positions,
    ]);
    let flags = Flags::try_parse_from(argv).unwrap();
    let config = flags.model.gpt_config(i64::from(VOCAB) + 1).unwrap();
    let options = ModelOptions {
        params_dtype,
        device,
        recompute: Recompute::None,
        seed: 5,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    GptModel::new(config, options, &ParallelState::single()).unwrap()
}

fn service(limits: BatchLimits, budget: KvBudget) -> TextGenerationService {
    service_of(model(), settings(limits, budget))
}

fn service_of(model: GptModel, settings: ServingSettings) -> TextGenerationService {
    TextGenerationService::new(model, Arc::new(NullTokenizer::new(VOCAB)), settings).unwrap()
}

/// The server's settings but for `limits` and the KV cache's `budget`.
fn settings(limits: BatchLimits, kv_budget: KvBudget) -> ServingSettings {
    ServingSettings {
        limits,
        decode: DecodeSettings {
            kv_budget,
            ..DecodeSettings::default()
        },
        max_tokens: 100_000,
        max_sequence: None,
    }
}

/// [`settings`], each decode step's tokens read before the next step is queued.
fn unoverlapped(limits: BatchLimits, kv_budget: KvBudget) -> ServingSettings {
    let mut settings = settings(limits, kv_budget);
    settings.decode.overlap = false;
    settings
}

fn limits(max_batch_size: usize, prefill_chunk: usize, max_queued: usize) -> BatchLimits {
    BatchLimits {
        max_batch_size,
        prefill_chunk,
        max_queued,
    }
}

/// A prompt of `length` ids drawn from `start`.
fn prompt(start: u32, length: u32) -> String {
    (0..length)
        .map(|i| ((start * 31 + i * 7) % VOCAB).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// A request to the service, and what it answered.
#[derive(Clone)]
enum Job {
    Api(ApiRequest),
    Completion(CompletionRequest),
}

fn api(body: Value) -> Job {
    Job::Api(ApiRequest::parse(&body).unwrap())
}

fn completion(body: Value) -> Job {
    Job::Completion(CompletionRequest::parse(&body).unwrap())
}

/// The answer without what differs between calls (completion ids and times), and the text
/// streamed.
fn run(service: &TextGenerationService, job: &Job) -> Result<(Value, String), ServiceError> {
    match job {
        Job::Api(request) => service.respond(request).map(|v| (v, String::new())),
        Job::Completion(request) => {
            let mut streamed = String::new();
            let body = service.complete(request, "id", 0, &mut |choice, text| {
                streamed.push_str(&format!("[{choice}]{text}"));
            })?;
            Ok((body["choices"].clone(), streamed))
        }
    }
}

/// Equal tokens and texts; log-probabilities within float noise.
fn assert_same(got: &Value, expected: &Value, what: &str) {
    match (got, expected) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() < 1e-4, "{what}: {a} vs {b}");
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: {got} vs {expected}");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_same(x, y, &format!("{what}[{i}]"));
            }
        }
        (Value::Object(a), Value::Object(b)) => {
            assert_eq!(
                a.keys().collect::<Vec<_>>(),
                b.keys().collect::<Vec<_>>(),
                "{what}"
            );
            for (key, x) in a {
                assert_same(x, &b[key], &format!("{what}.{key}"));
            }
        }
        _ => assert_eq!(got, expected, "{what}"),
    }
}

/// Sixteen requests of different prompts, lengths and settings.
fn sixteen_jobs() -> Vec<Job> {
    let mut jobs = Vec::new();
    for i in 0..12u32 {
        let prompts: Vec<String> = (0..1 + i % 3)
            .map(|p| prompt(i * 3 + p, 2 + (i * 5 + p * 11) % 23))
            .collect();
        let mut body = json!({
            "prompts": prompts,
            "tokens_to_generate": 8 + (i * 13) % 40,
            "logprobs": i % 2 == 0,
        });
        match i % 4 {
            0 => body["top_k"] = json!(1),
            1 => {
                body["top_k"] = json!(5);
                body["temperature"] = json!(0.8);
                body["random_seed"] = json!(100 + i);
            }
            2 => {
                body["top_p"] = json!(0.9);
                body["top_p_decay"] = json!(0.95);
                body["top_p_bound"] = json!(0.5);
                body["random_seed"] = json!(200 + i);
            }
            _ => {
                body["temperature"] = json!(1.3);
                body["random_seed"] = json!(300 + i);
            }
        }
        jobs.push(api(body));
    }
    for i in 0..4u32 {
        let mut body = json!({
            "model": "m",
            "prompt": prompt(50 + i, 3 + i * 9),
            "max_tokens": 10 + i * 15,
            "temperature": if i % 2 == 0 { 0.0 } else { 0.9 },
            "seed": 7 + i,
            "logprobs": 1,
        });
        if i == 3 {
            body["stop"] = json!([" 1", " 2"]);
        }
        jobs.push(completion(body));
    }
    jobs
}

#[test]
fn sixteen_concurrent_requests_each_get_what_they_get_alone() {
    let jobs = sixteen_jobs();
    // Alone: one request at a time, prompts prefilled whole, each step's tokens read before
    // the next step is queued.
    let alone = service_of(
        model(),
        unoverlapped(limits(1, 1024, 64), KvBudget::default()),
    );
    let expected: Vec<_> = jobs.iter().map(|job| run(&alone, job).unwrap()).collect();
    drop(alone);
    // Together: at most 8 rows at once (the rest wait), prompts prefilled 8 positions a step.
    let together = service(limits(8, 8, 64), KvBudget::default());
    let answers: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|job| scope.spawn(|| run(&together, job).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in answers.iter().zip(&expected).enumerate() {
        assert_same(&got.0, &want.0, &format!("request {i}"));
        assert_eq!(got.1, want.1, "request {i}: the streamed text");
    }
    // Distinct settings give distinct samples (the comparison above could not pass vacuously).
    let texts: Vec<&Value> = expected.iter().map(|(v, _)| v).collect();
    assert!(texts.windows(2).all(|w| w[0] != w[1]));
    let usage = together.cache_use();
    assert_eq!(usage.used_blocks, 0, "every block is back: {usage:?}");
    assert_eq!(usage.peak_rows, 8, "the batch filled up: {usage:?}");
    assert!(
        usage.steps_ahead > usage.steps / 4,
        "steps were queued ahead: {usage:?}"
    );
}

/// On a GPU, with decode steps replayed from CUDA graphs at bucketed batch sizes: greedy
/// requests served together get the tokens they get alone.
#[test]
fn continuous_batching_on_a_gpu_equals_serving_alone() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let jobs: Vec<Job> = (0..16u32)
        .map(|i| {
            api(json!({
                "prompts": [prompt(i, 3 + (i * 11) % 60)],
                "tokens_to_generate": 20 + (i * 17) % 150,
                "top_k": 1,
                "logprobs": true,
            }))
        })
        .collect();
    let alone = service_of(
        gpu_model(Kind::Float),
        unoverlapped(limits(1, 1024, 64), KvBudget::Bytes(1 << 30)),
    );
    let expected: Vec<_> = jobs.iter().map(|job| run(&alone, job).unwrap()).collect();
    drop(alone);
    let together = service_of(
        gpu_model(Kind::Float),
        settings(limits(16, 32, 64), KvBudget::Bytes(1 << 30)),
    );
    let answers: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|job| scope.spawn(|| run(&together, job).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in answers.iter().zip(&expected).enumerate() {
        assert_eq!(got.0["text"], want.0["text"], "request {i}");
        let (a, b) = (&got.0["logprobs"][0], &want.0["logprobs"][0]);
        for (x, y) in a.as_array().unwrap().iter().zip(b.as_array().unwrap()) {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() < 1e-3, "request {i}: {x} vs {y}");
        }
    }
    let usage = together.cache_use();
    assert!(usage.peak_rows > 1, "{usage:?}");
    assert!(usage.steps_ahead > 0, "steps were queued ahead: {usage:?}");
}

/// On a GPU, decode attention through the paged kernel (blocks read in place) gives the tokens
/// of gathered attention windows, batched and from CUDA graphs (see [`assert_serves_alike`]).
#[test]
fn the_paged_decode_kernel_serves_like_gathered_attention_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    assert_serves_alike(|decode| decode.paged_attention = false, |_| {});
}

/// On a GPU, decode steps through the fused decode kernels (norm + linear + bias + GeLU or
/// residual per kernel; batches of up to 8 rows, larger ones unfused) give the tokens of the
/// unfused layers, batched and from CUDA graphs (see [`assert_serves_alike`]).
#[test]
fn the_fused_decode_kernels_serve_like_unfused_layers_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    assert_serves_alike(|decode| decode.fused_kernels = false, |_| {});
}

/// 16 concurrent greedy requests served by a GPU model whose decode settings `expected` and
/// `tested` change:
/// in fp32 the same texts; in bf16, where rounding may tip a near tie, log-probabilities within
/// bf16 noise up to the first token that differs, and mostly the same first tokens.
fn assert_serves_alike(
    expected: impl Fn(&mut DecodeSettings),
    tested: impl Fn(&mut DecodeSettings),
) {
    let prompt_length = |i: u32| 3 + (i * 13) % 90;
    let jobs: Vec<Job> = (0..16u32)
        .map(|i| {
            api(json!({
                "prompts": [prompt(i, prompt_length(i))],
                "tokens_to_generate": 20 + (i * 17) % 140,
                "top_k": 1,
                "logprobs": true,
            }))
        })
        .collect();
    for (kind, tolerance) in [(Kind::Float, 1e-3), (Kind::BFloat16, 0.1)] {
        let serve_all = |service: TextGenerationService| -> Vec<Value> {
            let answers = std::thread::scope(|scope| {
                let handles: Vec<_> = jobs
                    .iter()
                    .map(|job| scope.spawn(|| run(&service, job).unwrap().0))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            assert!(service.cache_use().peak_rows > 1);
            answers
        };
        let served = |change: &dyn Fn(&mut DecodeSettings)| {
            let mut settings = settings(limits(16, 32, 64), KvBudget::Bytes(1 << 30));
            change(&mut settings.decode);
            service_of(gpu_model(kind), settings)
        };
        let want = serve_all(served(&expected));
        let got = serve_all(served(&tested));
        let mut same_first_token = 0;
        for (i, (got, want)) in got.iter().zip(&want).enumerate() {
            if kind == Kind::Float {
                assert_eq!(got["text"], want["text"], "{kind:?} request {i}");
            }
            let tokens = |v: &Value| v["segments"][0].as_array().unwrap().clone();
            let agree = tokens(got)
                .iter()
                .zip(&tokens(want))
                .take_while(|(x, y)| x == y)
                .count();
            same_first_token += usize::from(agree > prompt_length(i as u32) as usize);
            // Log-probability k scores token k + 1: compared while the tokens agree.
            let (a, b) = (&got["logprobs"][0], &want["logprobs"][0]);
            let (a, b) = (a.as_array().unwrap(), b.as_array().unwrap());
            for (x, y) in a.iter().zip(b).take(agree.saturating_sub(1)) {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                assert!(
                    (x - y).abs() < tolerance,
                    "{kind:?} request {i}: {x} vs {y}"
                );
            }
        }
        assert!(
            same_first_token >= 10,
            "{kind:?}: {same_first_token} of 16 first tokens agree"
        );
    }
}

/// Streams `request` until its fifth delta, then reports the client gone: the steps run when
/// it went (as last shown) and when the call returned.
fn leave_after_five(service: &TextGenerationService, request: &CompletionRequest) -> (u64, u64) {
    let (mut deltas, mut gone_at) = (0, None);
    let outcome = service.complete_streaming(
        request,
        "id",
        0,
        &mut |_, _| {
            deltas += 1;
            if deltas < 5 {
                return Ok(());
            }
            gone_at.get_or_insert(service.cache_use().steps);
            Err(ClientGone)
        },
        None,
    );
    assert!(
        matches!(outcome, Err(ServiceError::Failed(_))),
        "{outcome:?}"
    );
    (
        gone_at.expect("the client went away"),
        service.cache_use().steps,
    )
}

#[test]
fn a_client_that_goes_away_frees_its_blocks_within_a_step() {
    let service = service(limits(8, 64, 8), KvBudget::default());
    let long = CompletionRequest::parse(
        &json!({"model": "m", "prompt": prompt(1, 20), "max_tokens": 200, "temperature": 0.0}),
    )
    .unwrap();
    // Alone: the row leaves at the step after its client went (the step shown then may have
    // been one behind the one running), and nothing runs after it.
    let (gone_at, freed_at) = leave_after_five(&service, &long);
    assert!(
        freed_at <= gone_at + 2,
        "gone after step {gone_at}, freed at {freed_at}"
    );
    assert_eq!(service.cache_use().used_blocks, 0);
    // Beside another request: its blocks are free when the call returns, and the other
    // request is undisturbed.
    let neighbour = api(json!({"prompts": [prompt(2, 10)], "tokens_to_generate": 60, "top_k": 1}));
    let expected = run(&service, &neighbour).unwrap();
    std::thread::scope(|scope| {
        let beside = scope.spawn(|| run(&service, &neighbour).unwrap());
        leave_after_five(&service, &long);
        let blocks_of_neighbour = (10 + 60 + 15) / 16;
        let used = service.cache_use().used_blocks;
        assert!(used <= blocks_of_neighbour, "{used} blocks in use");
        assert_same(&beside.join().unwrap().0, &expected.0, "the neighbour");
    });
    // A caller's cancel flag gives up a request the same way.
    let flag = CancelFlag::new();
    flag.cancel();
    let request =
        ApiRequest::parse(&json!({"prompts": [prompt(3, 5)], "tokens_to_generate": 100})).unwrap();
    let outcome = service.respond_cancellable(&request, Some(&flag));
    assert!(
        matches!(outcome, Err(ServiceError::Failed(_))),
        "{outcome:?}"
    );
    assert_eq!(service.cache_use().used_blocks, 0);
}

#[test]
fn a_tiny_kv_budget_is_never_exceeded_and_an_impossible_request_is_refused() {
    let block = model().kv_block_bytes().unwrap();
    // 8 usable blocks of 16 positions (and the padding block): two 40-position requests at once.
    let budget = KvBudget::Bytes(block * 9);
    let jobs: Vec<Job> = (0..6u32)
        .map(|i| api(json!({"prompts": [prompt(i, 5 + i)], "tokens_to_generate": 30, "top_k": 1, "logprobs": true})))
        .collect();
    let roomy = service(limits(8, 16, 64), KvBudget::default());
    let expected: Vec<_> = jobs.iter().map(|job| run(&roomy, job).unwrap()).collect();
    drop(roomy);
    let tight = service(limits(8, 16, 64), budget);
    let answers: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|job| scope.spawn(|| run(&tight, job).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (got, want)) in answers.iter().zip(&expected).enumerate() {
        assert_same(&got.0, &want.0, &format!("request {i}"));
    }
    let usage = tight.cache_use();
    assert_eq!(usage.total_blocks, 8, "{usage:?}");
    assert!(
        usage.peak_blocks <= 8 && usage.peak_blocks >= 6,
        "{usage:?}"
    );
    // 150 positions need 10 blocks: more than the whole cache.
    let impossible =
        ApiRequest::parse(&json!({"prompts": [prompt(9, 20)], "tokens_to_generate": 130})).unwrap();
    match tight.respond(&impossible) {
        Err(ServiceError::Rejected(message)) => {
            assert!(message.contains("KV cache"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_full_queue_is_answered_busy() {
    // One row at a time and one waiting request: of three long requests sent together, one
    // runs, one waits and one is turned away.
    let service = service(limits(1, 64, 1), KvBudget::default());
    let job = api(json!({"prompts": [prompt(4, 10)], "tokens_to_generate": 200, "top_k": 1}));
    let started = Instant::now();
    let outcomes: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| run(&service, &job)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let busy = outcomes
        .iter()
        .filter(|o| matches!(o, Err(ServiceError::Busy(_))))
        .count();
    let served = outcomes.iter().filter(|o| o.is_ok()).count();
    assert_eq!(
        (busy, served),
        (1, 2),
        "{outcomes:?} after {:?}",
        started.elapsed()
    );
    assert!(started.elapsed() < Duration::from_secs(120));
}

/// Rows of one greedy request: `prompt` ids, `new` tokens after it.
fn greedy_rows(prompt: usize, new: usize, seed: u64) -> Vec<megatron_inference::RowSpec> {
    GenerationRequest {
        prompts: vec![(0..prompt as i64)
            .map(|i| (i * 7 + seed as i64) % 290)
            .collect()],
        tokens_to_generate: new,
        sampling: Sampling::greedy(),
        stop: StopCondition::Never,
        prevent_newline_after_colon: None,
        logprobs: false,
        top_logprobs: 0,
        pad: 0,
        adjust: LogitAdjust::default(),
    }
    .rows(seed)
    .unwrap()
}

/// Runs `batcher` for `steps` steps (or until idle), numbering them from `*step`: records each
/// request's first-token step and finishing step.
fn run_steps(
    model: &GptModel,
    decoder: &mut Decoder,
    batcher: &mut Batcher,
    steps: usize,
    step: &mut u64,
    first: &mut HashMap<u64, u64>,
    done: &mut HashMap<u64, u64>,
) {
    for _ in 0..steps {
        if batcher.is_idle() {
            return;
        }
        *step += 1;
        let now = *step;
        let finished = batcher
            .step(model, decoder, &mut |new| {
                first.entry(new.request).or_insert(now);
                false
            })
            .unwrap();
        for (id, _) in finished {
            done.insert(id, now);
        }
    }
}

#[test]
fn first_tokens_come_in_arrival_order_and_never_wait_for_a_completion() {
    let model = model();
    let mut decoder = Decoder::eager();
    let (mut step, mut first, mut done) = (0, HashMap::new(), HashMap::new());
    // Prompts prefilled 16 positions a step. Requests 0 and 1 run; request 1 leaves after its
    // fourth token, while request 2's 64-position prompt is being prefilled and request 3's
    // waits behind it: the row that leaves must not let request 3 overtake request 2. A decode
    // step's tokens are read at the step after it, request 1's fourth at step 5, before that
    // step's prefill completes request 2's prompt.
    let mut batcher = Batcher::new(limits(8, 16, 64));
    batcher
        .submit(&model, &mut decoder, 0, greedy_rows(3, 100, 0))
        .unwrap();
    batcher
        .submit(&model, &mut decoder, 1, greedy_rows(3, 4, 1))
        .unwrap();
    run_steps(
        &model,
        &mut decoder,
        &mut batcher,
        1,
        &mut step,
        &mut first,
        &mut done,
    );
    batcher
        .submit(&model, &mut decoder, 2, greedy_rows(64, 20, 2))
        .unwrap();
    batcher
        .submit(&model, &mut decoder, 3, greedy_rows(64, 20, 3))
        .unwrap();
    run_steps(
        &model,
        &mut decoder,
        &mut batcher,
        1000,
        &mut step,
        &mut first,
        &mut done,
    );
    assert_eq!(done[&1], 5, "request 1 left during request 2's prefill");
    // 64 positions are 4 steps of prefill, started at step 2.
    assert_eq!(first[&2], 5, "request 2's first token: {first:?}");
    assert_eq!(first[&3], 9, "request 3's first token: {first:?}");

    // With room for all of them, 8 requests sent together each get their first token before
    // any of them finishes: prefill (about 240 positions, 16 a step) takes fewer steps than
    // the shortest generation.
    let mut batcher = Batcher::new(limits(8, 16, 64));
    let (mut step, mut first, mut done) = (0, HashMap::new(), HashMap::new());
    for id in 0..8u64 {
        let prompt = 5 + (id as usize * 17) % 56;
        let rows = greedy_rows(prompt, 24 + id as usize * 3, id);
        batcher.submit(&model, &mut decoder, id, rows).unwrap();
    }
    run_steps(
        &model,
        &mut decoder,
        &mut batcher,
        1000,
        &mut step,
        &mut first,
        &mut done,
    );
    assert_eq!((first.len(), done.len()), (8, 8));
    let last_first = first.values().max().unwrap();
    let first_done = done.values().min().unwrap();
    assert!(
        last_first < first_done,
        "a first token at step {last_first}, a completion at step {first_done}: {first:?} {done:?}"
    );
    assert_eq!(batcher.cache_use().used_blocks, 0);
}

/// Greedy tokens after `prompt` as the model's full forward gives them (no KV cache), each
/// position's logits adjusted by hand as OpenAI defines: `bias` added, and for every token
/// generated before it `c` times, `c · frequency + presence` taken off. `generated` is what
/// the server answered; the answer is checked token by token against it.
fn greedy_by_hand(
    prompt: &[i64],
    generated: &[i64],
    (presence, frequency): (f32, f32),
    bias: &[(i64, f32)],
) -> Vec<i64> {
    let reference = model();
    let sequence: Vec<i64> = prompt.iter().chain(generated).copied().collect();
    let length = sequence.len() as i64;
    let tokens = Tensor::from_slice(&sequence).view([1, length]);
    let positions = Tensor::arange(length, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    let logits = tch::no_grad(|| reference.causal_logits(&tokens, &positions))
        .unwrap()
        .select(1, 0)
        .narrow(1, 0, reference.vocab_size())
        .to_kind(Kind::Float);
    let rows: Vec<Vec<f32>> = Vec::try_from(logits).unwrap();
    (0..generated.len())
        .map(|i| {
            let mut row = rows[prompt.len() + i - 1].clone();
            for &(token, amount) in bias {
                row[token as usize] += amount;
            }
            let mut counts = HashMap::<i64, f32>::new();
            for &token in &generated[..i] {
                *counts.entry(token).or_default() += 1.0;
            }
            for (token, count) in counts {
                row[token as usize] -= count * frequency + presence;
            }
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            assert!(
                row[order[0]] - row[order[1]] > 1e-4,
                "position {i}: a near tie makes the greedy token float noise"
            );
            order[0] as i64
        })
        .collect()
}

/// OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias`: the greedy tokens the
/// service answers are those of the model's own logits adjusted by hand ([`greedy_by_hand`]),
/// and differ from the unpenalised ones; a -100 bias on the greedy token replaces it, +100 on
/// another token makes every token that one; a bias on an id outside the vocabulary is refused
/// naming it.
#[test]
fn penalties_and_logit_bias_adjust_the_logits_as_openai_defines() {
    let service = service(limits(4, 16, 64), KvBudget::default());
    let text = prompt(3, 9);
    let prompt_ids: Vec<i64> = text.split(' ').map(|t| t.parse().unwrap()).collect();
    let generate = |extra: Value| -> Result<Vec<i64>, ServiceError> {
        let mut body = json!({"prompt": text, "max_tokens": 24, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let request = CompletionRequest::parse(&body).unwrap();
        let answer = service.complete(&request, "id", 0, &mut |_, _| {})?;
        Ok(answer["choices"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect())
    };
    let plain = generate(json!({})).unwrap();
    assert_eq!(plain, greedy_by_hand(&prompt_ids, &plain, (0.0, 0.0), &[]));
    let penalised = generate(json!({"presence_penalty": 0.05, "frequency_penalty": 0.03})).unwrap();
    assert_eq!(
        penalised,
        greedy_by_hand(&prompt_ids, &penalised, (0.05, 0.03), &[])
    );
    assert_ne!(penalised, plain, "the penalties changed nothing");
    let negative = generate(json!({"logit_bias": {plain[0].to_string(): -100}})).unwrap();
    assert_ne!(negative[0], plain[0]);
    assert_eq!(
        negative,
        greedy_by_hand(&prompt_ids, &negative, (0.0, 0.0), &[(plain[0], -100.0)])
    );
    let forced = (plain[0] + 1) % i64::from(VOCAB);
    let positive = generate(json!({"logit_bias": {forced.to_string(): 100}})).unwrap();
    assert_eq!(positive, vec![forced; 24]);
    match generate(json!({"logit_bias": {"300": 1}})) {
        Err(ServiceError::Rejected(message)) => assert_eq!(
            message,
            "logit_bias key \"300\" is not a token id of the vocabulary of 300 tokens"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Token ids of a NullTokenizer text.
fn ids(text: &Value) -> Vec<i64> {
    text.as_str()
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

/// OpenAI's `n` and `best_of`: a prompt's samples share its prefill (its positions are
/// prefilled once, against three times for `/api` given the prompt thrice) and its full
/// KV-cache blocks (the last, partial one copied). Greedy samples are the one greedy answer;
/// seeded samples are `/api`'s rows for the prompt thrice with the same seed (sample `j` draws
/// from `row_seed(seed, j)`, as `/api`'s row `j`) and differ; `best_of` answers the samples of
/// highest cumulative log-probability.
#[test]
fn samples_of_a_prompt_share_its_prefill() {
    let service = service(limits(8, 64, 64), KvBudget::default());
    // 21 positions: one full block and part of another.
    let text = prompt(5, 21);
    let complete = |body: Value| -> Value {
        let request = CompletionRequest::parse(&body).unwrap();
        service.complete(&request, "id", 0, &mut |_, _| {}).unwrap()
    };
    let prefilled = || service.cache_use().prefilled_positions;

    let before = prefilled();
    let greedy = complete(json!({"prompt": text, "max_tokens": 12, "temperature": 0, "n": 3}));
    assert_eq!(prefilled() - before, 21);
    let one = complete(json!({"prompt": text, "max_tokens": 12, "temperature": 0}));
    let choices = greedy["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (j, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], j);
        assert_eq!(choice["text"], one["choices"][0]["text"], "sample {j}");
    }

    let before = prefilled();
    let sampled = complete(json!({"prompt": text, "max_tokens": 12, "temperature": 1,
                                  "seed": 7, "n": 3, "logprobs": 0}));
    assert_eq!(prefilled() - before, 21);
    let before = prefilled();
    let thrice = ApiRequest::parse(&json!({"prompts": [text, text, text],
        "tokens_to_generate": 12, "random_seed": 7, "temperature": 1.0}))
    .unwrap();
    let api = service.respond(&thrice).unwrap();
    assert_eq!(prefilled() - before, 63);
    let samples: Vec<Vec<i64>> = (0..3)
        .map(|j| ids(&sampled["choices"][j]["text"]))
        .collect();
    for (j, sample) in samples.iter().enumerate() {
        let row: Vec<i64> = ids(&api["text"][j])[21..]
            .iter()
            .copied()
            .take_while(|&t| t != i64::from(VOCAB))
            .collect();
        assert_eq!(sample, &row, "sample {j}");
    }
    assert!(
        samples[0] != samples[1] || samples[1] != samples[2],
        "{samples:?}"
    );

    let cumulative = |j: usize| -> f64 {
        sampled["choices"][j]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_f64().unwrap())
            .sum()
    };
    let mut order: Vec<usize> = (0..3).collect();
    order.sort_by(|&a, &b| cumulative(b).total_cmp(&cumulative(a)));
    let best = complete(
        json!({"prompt": text, "max_tokens": 12, "temperature": 1, "seed": 7,
                               "n": 2, "best_of": 3}),
    );
    let best = best["choices"].as_array().unwrap();
    assert_eq!(best.len(), 2);
    for (k, choice) in best.iter().enumerate() {
        assert_eq!(choice["index"], k);
        assert_eq!(
            choice["text"], sampled["choices"][order[k]]["text"],
            "best {k}"
        );
        assert!(choice["logprobs"].is_null());
    }
}

/// On a GPU, with the paged decode kernel and CUDA graphs: a prompt's greedy samples, sharing
/// its blocks (the partial last one copied), are its one greedy answer, and the penalties and
/// logit bias, applied before each draw, give what eager decoding gives.
#[test]
fn shared_prompt_blocks_and_adjusted_logits_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let graphs = service_of(
        gpu_model(Kind::Float),
        settings(limits(8, 64, 64), KvBudget::Bytes(1 << 30)),
    );
    let mut eager_settings = settings(limits(8, 64, 64), KvBudget::Bytes(1 << 30));
    eager_settings.decode.cuda_graphs = false;
    let eager = service_of(gpu_model(Kind::Float), eager_settings);
    let text = prompt(5, 21);
    let complete = |service: &TextGenerationService, extra: Value| -> Value {
        let mut body = json!({"prompt": text, "max_tokens": 24, "temperature": 0});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let request = CompletionRequest::parse(&body).unwrap();
        service.complete(&request, "id", 0, &mut |_, _| {}).unwrap()
    };
    let one = complete(&graphs, json!({}));
    let before = graphs.cache_use().prefilled_positions;
    let three = complete(&graphs, json!({"n": 3}));
    assert_eq!(graphs.cache_use().prefilled_positions - before, 21);
    for choice in three["choices"].as_array().unwrap() {
        assert_eq!(
            ids(&choice["text"]),
            ids(&one["choices"][0]["text"]),
            "{three}"
        );
    }
    let adjusted = json!({
        "presence_penalty": 0.05,
        "frequency_penalty": 0.03,
        "logit_bias": {ids(&one["choices"][0]["text"])[0].to_string(): -100},
    });
    let (on_graphs, on_eager) = (
        complete(&graphs, adjusted.clone()),
        complete(&eager, adjusted),
    );
    assert_eq!(
        ids(&on_graphs["choices"][0]["text"]),
        ids(&on_eager["choices"][0]["text"])
    );
    assert_ne!(
        ids(&on_graphs["choices"][0]["text"]),
        ids(&one["choices"][0]["text"])
    );
}
