//! `text_generation_server` and `text_generation_cli` as a user drives them: a checkpoint
//! saved by `pretrain_gpt`, served on loopback, queried with Megatron's request fields; answers
//! equal `generate_samples_gpt`'s greedy continuation; OpenAI completions, streamed too; chat
//! completions and models through the official `openai` client; hostile clients (slow bodies,
//! idle floods, disconnects, full queue, draining) and the connection limits and timeouts;
//! Megatron's validation messages; malformed,
//! oversized and too-long requests; 64 clients at once; Megatron-core's batching flags with a
//! tiny KV cache; SIGTERM stops it cleanly; on GPUs,
//! decoding from CUDA graphs (with and without tensor parallelism) answers like eager decoding.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use megatron_e2e::{
    bin, free_port, mock_gpt_checkpoint, quickstart_tokenizer_flags, run_ok, shared_dir,
    test_python, visible_gpus, workspace_root,
};
use serde_json::{json, Value};

/// A small GPT trained for two steps on mock data with the bundled tokenizer.
fn checkpoint(dir: &Path) {
    checkpoint_with_positions(dir, 96);
}

/// [`checkpoint`] with `positions` positions (long generations for the hostile-client tests).
fn checkpoint_with_positions(dir: &Path, positions: usize) {
    checkpoint_of_shape(dir, positions, 64, 4);
}

/// [`checkpoint`] of `hidden` channels in `heads` heads.
fn checkpoint_of_shape(dir: &Path, positions: usize, hidden: usize, heads: usize) {
    let (positions, hidden, heads) = (positions.to_string(), hidden.to_string(), heads.to_string());
    let architecture = [
        "--num-layers",
        "2",
        "--hidden-size",
        &hidden,
        "--num-attention-heads",
        &heads,
        "--seq-length",
        "64",
        "--max-position-embeddings",
        &positions,
    ];
    mock_gpt_checkpoint(dir, &architecture, &quickstart_tokenizer_flags());
}

struct Server {
    child: Child,
    address: String,
}

fn server_command(checkpoint: &Path) -> Command {
    let mut command = bin("text_generation_server");
    command
        .arg("--load")
        .arg(checkpoint)
        .args(quickstart_tokenizer_flags())
        .args([
            "--port",
            "0",
            "--device",
            "cpu",
            "--max-tokens-to-oom",
            "2000",
            "--max-request-bytes",
            "10000",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn start_server(checkpoint: &Path) -> Server {
    serve(server_command(checkpoint).spawn().unwrap())
}

/// Waits until `child` (rank 0 of a server) says where it serves.
fn serve(mut child: Child) -> Server {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("the server exited before serving")
            .unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest
                .trim_end_matches(|c: char| c != '/')
                .trim_end_matches("/api")
                .trim_end_matches('/')
                .to_string();
        }
    };
    // Keep draining the request log so the server never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Server {
        child,
        address: address.split('/').next().unwrap().to_string(),
    }
}

fn cli(server: &Server, args: &[&str]) -> Output {
    bin("text_generation_cli")
        .arg(&server.address)
        .args(args)
        .output()
        .unwrap()
}

/// Sends `body` verbatim; the JSON answer, or the CLI's `Error <status>: <message>`.
fn request(server: &Server, body: &str) -> Result<Value, String> {
    let out = cli(server, &["--request", body]);
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr)
            .trim()
            .trim_start_matches("error: ")
            .to_string())
    }
}

#[test]
fn serves_megatrons_api() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);

    // Greedy (top_k = 1) equals generate_samples_gpt --greedy on the same checkpoint.
    let reply = request(
        &server,
        &json!({"prompts": ["The data"], "tokens_to_generate": 12, "top_k": 1, "logprobs": true})
            .to_string(),
    )
    .unwrap();
    let text = reply["text"][0].as_str().unwrap();
    let segments: Vec<&str> = reply["segments"][0]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    assert_eq!(segments.concat(), text);
    assert_eq!(
        reply["logprobs"][0].as_array().unwrap().len(),
        segments.len() - 1
    );
    assert!(reply["logprobs"][0]
        .as_array()
        .unwrap()
        .iter()
        .all(|l| l.as_f64().unwrap() <= 0.0));
    let mut samples = bin("generate_samples_gpt");
    samples
        .arg("--load")
        .arg(&ckpt)
        .args(quickstart_tokenizer_flags())
        .args([
            "--prompt",
            "The data",
            "--greedy",
            "--out-seq-length",
            "12",
            "--device",
            "cpu",
        ]);
    let sampled = String::from_utf8(run_ok(&mut samples).stdout).unwrap();
    let eod = "<|endoftext|>";
    let continuation = text.strip_prefix("The data").unwrap();
    assert!(
        sampled.starts_with(&format!(
            "The data{}",
            continuation.split(eod).next().unwrap()
        )),
        "{sampled:?} vs {text:?}"
    );

    // Scoring only: the prompt comes back with its log-probabilities.
    let scored = request(
        &server,
        r#"{"prompts": ["The data", "x"], "tokens_to_generate": 0, "logprobs": true}"#,
    )
    .unwrap();
    assert_eq!(scored["text"], json!(["The data", "x"]));
    assert_eq!(scored["logprobs"][1], json!([]));

    // A fixed random_seed reproduces a sample; beam search returns its beams and scores.
    let seeded =
        r#"{"prompts": ["Hello"], "tokens_to_generate": 10, "top_p": 0.9, "random_seed": 42}"#;
    assert_eq!(
        request(&server, seeded).unwrap(),
        request(&server, seeded).unwrap()
    );
    let beams = request(
        &server,
        r#"{"prompts": ["Hello"], "tokens_to_generate": 5, "beam_width": 2, "stop_token": 0}"#,
    )
    .unwrap();
    assert_eq!(beams["text"].as_array().unwrap().len(), 2);
    assert_eq!(beams["scores"].as_array().unwrap().len(), 2);

    // Megatron's messages, answered 400; malformed, oversized and too-long requests too.
    let rejected = [
        ("{}", "prompts argument required"),
        (r#"{"prompts": "x"}"#, "prompts is not a list of strings"),
        (
            r#"{"prompts": ["x"], "top_p": 1}"#,
            "top_p must be a positive float less than or equal to 1.0",
        ),
        (
            r#"{"prompts": ["x"], "tokens_to_generate": 0}"#,
            "tokens_to_generate=0 implies logprobs should be True",
        ),
        (
            r#"{"prompts": ["x"], "tokens_to_generate": 500}"#,
            "Length of prompt + tokens_to_generate longer than allowed",
        ),
        (
            r#"{"prompts": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q","r","s","t","u","v","w","x","y"], "tokens_to_generate": 90}"#,
            "Too many tokens.  2275 is greater than 2000",
        ),
        ("{\"prompts\": [", "malformed JSON"),
    ];
    for (body, message) in rejected {
        let error = request(&server, body).unwrap_err();
        assert!(
            error.starts_with("Error 400: ") && error.contains(message),
            "{body}: {error}"
        );
    }
    let huge = json!({"prompts": ["x".repeat(20_000)]}).to_string();
    assert!(request(&server, &huge)
        .unwrap_err()
        .starts_with("Error 413: "));

    // OpenAI completions: greedy (temperature 0) continues like /api's greedy; streamed deltas
    // add up to the same text; stop sequences cut it.
    let completion = |body: Value| {
        let out = cli(&server, &["--completion", &body.to_string()]);
        assert!(
            out.status.success(),
            "{body}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let whole: Value = serde_json::from_str(&completion(
        json!({"prompt": "The data", "max_tokens": 12, "temperature": 0.0, "logprobs": 1}),
    ))
    .unwrap();
    let choice = &whole["choices"][0];
    let greedy_continuation = continuation.split(eod).next().unwrap();
    assert_eq!(choice["text"].as_str().unwrap(), greedy_continuation);
    let completion_tokens = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        choice["logprobs"]["tokens"].as_array().unwrap().len(),
        completion_tokens
    );
    let events = completion(
        json!({"prompt": "The data", "max_tokens": 12, "temperature": 0.0, "stream": true}),
    );
    let mut streamed = String::new();
    let mut finish = Value::Null;
    for line in events.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let event: Value = serde_json::from_str(line).unwrap();
        streamed.push_str(event["choices"][0]["text"].as_str().unwrap());
        finish = event["choices"][0]["finish_reason"].clone();
    }
    assert!(events.trim_end().ends_with("data: [DONE]"), "{events}");
    assert_eq!(streamed, greedy_continuation);
    assert_eq!(finish, choice["finish_reason"]);
    if let Some(cut) = greedy_continuation
        .get(3..6)
        .filter(|s| !s.trim().is_empty())
    {
        let stopped: Value = serde_json::from_str(&completion(
            json!({"prompt": "The data", "max_tokens": 12, "temperature": 0.0, "stop": [cut]}),
        ))
        .unwrap();
        let text = stopped["choices"][0]["text"].as_str().unwrap();
        assert_eq!(
            text,
            &greedy_continuation[..greedy_continuation.find(cut).unwrap()]
        );
        assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    }
    // Greedy samples of one prompt (n) are each the greedy continuation.
    let three: Value = serde_json::from_str(&completion(
        json!({"prompt": "The data", "max_tokens": 12, "temperature": 0.0, "n": 3}),
    ))
    .unwrap();
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{three}");
    assert!(choices.iter().all(|c| c["text"] == greedy_continuation));
    let rejected = cli(&server, &["--completion", r#"{"prompt": "x", "n": 0}"#]);
    assert!(String::from_utf8_lossy(&rejected.stderr).contains("n must be between 1 and 128"));

    // 64 clients at once: all answered.
    let started = Instant::now();
    let clients: Vec<_> = (0..64)
        .map(|i| {
            bin("text_generation_cli")
                .arg(&server.address)
                .args([
                    "--prompt",
                    &format!("client {i}"),
                    "--tokens-to-generate",
                    "4",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for client in clients {
        let out = client.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("client "));
    }
    assert!(
        started.elapsed() < Duration::from_secs(180),
        "64 clients took {:?}",
        started.elapsed()
    );
    assert!(request(
        &server,
        r#"{"prompts": ["still up"], "tokens_to_generate": 1}"#
    )
    .is_ok());

    // SIGTERM: the server finishes and exits cleanly.
    terminate(server.child);
}

fn wait_success(mut child: Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "{what} did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{what}: {status}");
}

fn terminate(child: Child) {
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    wait_success(child, "the server after SIGTERM");
}

/// Two processes launched like torchrun with --tensor-model-parallel-size 2: rank 0 serves and
/// broadcasts each request, and the answers equal the one-process server's.
#[test]
fn tensor_parallel_serving_answers_like_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let body = json!({"prompts": ["The data", "x y"], "tokens_to_generate": 10, "top_k": 1, "logprobs": true}).to_string();
    let sampled =
        r#"{"prompts": ["Hello"], "tokens_to_generate": 10, "top_p": 0.9, "random_seed": 7}"#;
    let single = start_server(&ckpt);
    let (expected, expected_sample) = (
        request(&single, &body).unwrap(),
        request(&single, sampled).unwrap(),
    );
    terminate(single.child);

    let (server, follower) = start_tensor_parallel(&ckpt, &[]);
    assert_same_answer(&request(&server, &body).unwrap(), &expected, 1e-4);
    assert_eq!(
        request(&server, sampled).unwrap()["text"],
        expected_sample["text"]
    );
    terminate(server.child);
    wait_success(follower, "rank 1 after rank 0 stopped");
}

/// Rank 0 (serving) and rank 1 of a server launched like torchrun with
/// --tensor-model-parallel-size 2 and `extra` flags.
fn start_tensor_parallel(checkpoint: &Path, extra: &[&str]) -> (Server, Child) {
    let port = free_port();
    // Both ranks must be started before waiting for rank 0, which waits for rank 1.
    let ranks: Vec<Child> = (0..2)
        .map(|rank| {
            server_command(checkpoint)
                .args(["--tensor-model-parallel-size", "2"])
                .args(extra)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(if rank == 0 {
                    Stdio::piped()
                } else {
                    Stdio::null()
                })
                .spawn()
                .unwrap()
        })
        .collect();
    let mut ranks = ranks.into_iter();
    let server = serve(ranks.next().unwrap());
    (server, ranks.next().unwrap())
}

/// Each body's answer from `server`, all requests sent at once from threads of their own.
fn all_at_once(server: &Server, bodies: &[String]) -> Vec<Value> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = bodies
            .iter()
            .map(|b| scope.spawn(|| request(server, b).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The same texts, and log-probabilities within `tolerance`.
fn assert_same_answer(got: &Value, expected: &Value, tolerance: f64) {
    assert_eq!(got["text"], expected["text"]);
    let flat = |v: &Value| -> Vec<f64> {
        v["logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap())
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let (a, b) = (flat(got), flat(expected));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() < tolerance, "{x} vs {y}");
    }
}

/// On GPUs: decode steps replayed from CUDA graphs with the paged decode kernel answer like
/// eager decoding with gathered attention, on one GPU (the second request reusing the first
/// one's cache and graphs) and with tensor parallelism over NCCL, whose collectives are captured
/// in the graphs too. Heads of 64 channels, so that the kernel serves them. Runs where there
/// are 2 GPUs.
#[test]
fn cuda_graph_decoding_serves_like_eager_decoding_on_gpus() {
    if visible_gpus() < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint_of_shape(&ckpt, 96, 128, 2);
    let bodies = [
        json!({"prompts": ["The data", "x y z w"], "tokens_to_generate": 60, "top_k": 1, "logprobs": true}),
        json!({"prompts": ["Hello there", "A"], "tokens_to_generate": 60, "top_k": 1, "logprobs": true}),
    ]
    .map(|b| b.to_string());
    let answers = |server: &Server| -> Vec<Value> {
        bodies.iter().map(|b| request(server, b).unwrap()).collect()
    };
    let eager = serve(
        server_command(&ckpt)
            .args([
                "--device",
                "cuda",
                "--no-cuda-graphs",
                "--no-paged-attention",
            ])
            .spawn()
            .unwrap(),
    );
    let expected = answers(&eager);
    terminate(eager.child);
    let graphed = serve(
        server_command(&ckpt)
            .args(["--device", "cuda"])
            .spawn()
            .unwrap(),
    );
    for (got, want) in answers(&graphed).iter().zip(&expected) {
        assert_same_answer(got, want, 1e-3);
    }
    terminate(graphed.child);
    let (server, follower) = start_tensor_parallel(&ckpt, &["--device", "cuda"]);
    for (got, want) in answers(&server).iter().zip(&expected) {
        assert_same_answer(got, want, 1e-3);
    }
    terminate(server.child);
    wait_success(follower, "rank 1 after rank 0 stopped");
}

/// On GPUs: 16 clients at once of a tensor-parallel server (TP=2 over NCCL, continuous batching
/// over the paged cache, decode steps from CUDA graphs) each get the greedy answer the same
/// server gives them one at a time, and the server batched them (fewer steps than tokens). Runs
/// where there are 2 GPUs.
#[test]
fn continuous_batching_with_tensor_parallelism_on_gpus_answers_like_serving_alone() {
    if visible_gpus() < 2 {
        eprintln!("skipped: needs 2 GPUs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint_of_shape(&ckpt, 256, 128, 2);
    let bodies: Vec<String> = (0..16)
        .map(|i| {
            let prompt = format!("The data {i} and ").repeat(1 + i % 7);
            json!({"prompts": [prompt], "tokens_to_generate": 16 + (i * 13) % 48, "top_k": 1,
                   "logprobs": true})
            .to_string()
        })
        .collect();
    let (server, follower) = start_tensor_parallel(&ckpt, &["--device", "cuda"]);
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| request(&server, b).unwrap())
        .collect();
    let tokens_before = metric(&server, "megatron_generation_tokens_total");
    let steps_before = metric(&server, "megatron_generation_steps_total");
    let together = all_at_once(&server, &bodies);
    for (got, want) in together.iter().zip(&alone) {
        assert_same_answer(got, want, 1e-3);
    }
    let tokens = metric(&server, "megatron_generation_tokens_total") - tokens_before;
    let steps = metric(&server, "megatron_generation_steps_total") - steps_before;
    eprintln!("together: {tokens} tokens in {steps} steps");
    assert!(
        tokens >= 2.0 * steps,
        "{tokens} tokens in {steps} steps: not batched"
    );
    terminate(server.child);
    wait_success(follower, "rank 1 after rank 0 stopped");
}

/// Hostile request bodies: each is answered, with a 4xx and a message or with a valid answer,
/// and the server keeps serving. Neither a panic, a libtorch error nor an out-of-memory kill.
#[test]
fn hostile_requests_are_refused_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let deep = format!("{}{}", "[".repeat(4000), "]".repeat(4000));
    let refused: &[(&str, &str)] = &[
        // Beams are bounded by the vocabulary and, like prompts, by --max-tokens-to-oom.
        (
            r#"{"prompts":["a"],"tokens_to_generate":4,"beam_width":100000}"#,
            "beam_width (100000) must be at most 2048, half the vocabulary size",
        ),
        (
            r#"{"prompts":["a"],"tokens_to_generate":4,"beam_width":3000}"#,
            "beam_width (3000) must be at most 2048",
        ),
        (
            r#"{"prompts":["a"],"tokens_to_generate":50,"beam_width":1000}"#,
            "Too many tokens.  ",
        ),
        (
            r#"{"prompts":["a"],"tokens_to_generate":0,"logprobs":true,"beam_width":2}"#,
            "context length + tokens_to_generate too large",
        ),
        (
            r#"{"prompts":["a"],"tokens_to_generate":9223372036854775807}"#,
            "Length of prompt + tokens_to_generate longer than allowed",
        ),
        (
            r#"{"prompts":["a"],"tokens_to_generate":1e30}"#,
            "tokens_to_generate must be an integer greater than 0",
        ),
        (r#"{"prompts":["a"],"temperature":1e309}"#, "malformed JSON"),
        (
            r#"{"prompts":["a"],"temperature":-1e-300}"#,
            "temperature must be a positive number",
        ),
        (
            r#"{"prompts":["a"],"random_seed":18446744073709551616}"#,
            "random_seed must be integer",
        ),
        (r#"{"prompts":[null]}"#, "prompts is not a list of strings"),
        ("[]", "the request body must be a JSON object"),
        ("null", "the request body must be a JSON object"),
        (deep.as_str(), "malformed JSON"),
    ];
    for (body, expected) in refused {
        let error = request(&server, body).unwrap_err();
        assert!(
            error.starts_with("Error 4") && error.contains(expected),
            "{}: {error}",
            &body[..body.len().min(80)]
        );
    }
    // A tiny temperature is as good as greedy; odd but valid values are served.
    let greedy = request(
        &server,
        r#"{"prompts":["The data"],"tokens_to_generate":8,"top_k":1}"#,
    )
    .unwrap();
    for body in [
        r#"{"prompts":["The data"],"tokens_to_generate":8,"temperature":1e-300}"#,
        r#"{"prompts":["The data"],"tokens_to_generate":8,"temperature":1e-300,"top_k":5}"#,
        r#"{"prompts":["The data"],"tokens_to_generate":8,"temperature":1e-300,"top_p":0.5}"#,
    ] {
        assert_eq!(
            request(&server, body).unwrap()["text"],
            greedy["text"],
            "{body}"
        );
    }
    for body in [
        r#"{"prompts":["a"],"tokens_to_generate":4,"top_p":1e-300}"#,
        r#"{"prompts":["a"],"tokens_to_generate":4,"temperature":100}"#,
        r#"{"prompts":["a"],"tokens_to_generate":4,"beam_width":2,"stop_token":1000000000000000000}"#,
        r#"{"prompts":["a"],"tokens_to_generate":4,"beam_width":2,"length_penalty":-1e308}"#,
        r#"{"prompts":["\u0000\ud83d\ude00 \uffff"],"tokens_to_generate":4}"#,
        r#"{"prompts":["a"],"tokens_to_generate":4,"random_seed":9223372036854775807}"#,
    ] {
        assert!(request(&server, body).is_ok(), "{body}");
    }
    let completion = |body: &str| {
        let out = cli(&server, &["--completion", body]);
        assert!(
            out.status.success(),
            "{body}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    completion(r#"{"prompt":"a","max_tokens":4,"temperature":1e-300}"#);
    let out = cli(
        &server,
        &[
            "--completion",
            r#"{"prompt":"a","max_tokens":9223372036854775807}"#,
        ],
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Error 400"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(request(
        &server,
        r#"{"prompts":["still up"],"tokens_to_generate":1}"#
    )
    .is_ok());
    terminate(server.child);
}

/// Megatron's `examples/inference/run_text_generation_server_345M.sh` flag set, scaled to the
/// test's model and otherwise unchanged, is accepted (the architecture checked against the
/// checkpoint, `--fp16 --micro-batch-size 1 --seed 42` and the parallel sizes taken as
/// run-time flags); the same flags with a wrong architecture are refused naming both values;
/// `generate_samples_gpt` takes the same flag set.
#[test]
fn megatrons_345m_server_script_flags_run_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let data = workspace_root().join("data");
    let (vocab, merges) = (
        data.join("quickstart-vocab.json"),
        data.join("quickstart-merges.txt"),
    );
    let script_flags = |layers: &str| -> Vec<String> {
        let mut flags: Vec<String> = [
            "--tensor-model-parallel-size",
            "1",
            "--pipeline-model-parallel-size",
            "1",
            "--num-layers",
            layers,
            "--hidden-size",
            "64",
            "--load",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.push(ckpt.display().to_string());
        flags.extend(
            [
                "--num-attention-heads",
                "4",
                "--max-position-embeddings",
                "96",
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--fp16",
                "--micro-batch-size",
                "1",
                "--seq-length",
                "64",
                "--vocab-file",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        flags.push(vocab.display().to_string());
        flags.push("--merge-file".into());
        flags.push(merges.display().to_string());
        flags.extend(["--seed", "42"].iter().map(|s| s.to_string()));
        flags
    };
    let mut command = bin("text_generation_server");
    command
        .args(script_flags("2"))
        .args(["--port", "0", "--device", "cpu"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let server = serve(command.spawn().unwrap());
    let reply = request(
        &server,
        r#"{"prompts": ["The data"], "tokens_to_generate": 4, "top_k": 1}"#,
    )
    .unwrap();
    assert!(reply["text"][0].as_str().unwrap().starts_with("The data"));
    terminate(server.child);

    let out = bin("text_generation_server")
        .args(script_flags("24"))
        .args(["--port", "0", "--device", "cpu"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--num-layers 24 does not match the checkpoint") && stderr.contains("(2)"),
        "{stderr}"
    );

    let mut samples = bin("generate_samples_gpt");
    samples.args(script_flags("2")).args([
        "--prompt",
        "The data",
        "--greedy",
        "--out-seq-length",
        "4",
        "--device",
        "cpu",
    ]);
    assert!(String::from_utf8(run_ok(&mut samples).stdout)
        .unwrap()
        .starts_with("The data"));
}

/// What lm-evaluation-harness's `local-completions` sends for log-likelihoods (`echo: true`,
/// `logprobs: 1`, `max_tokens` 1 or 0) gets OpenAI's legacy answer: the echoed prompt's first
/// token with a null log-probability, character offsets, `top_logprobs`; a streamed echo starts
/// with the prompt; a rejected streaming request is answered 400.
#[test]
fn completions_answer_what_lm_eval_sends() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let completion = |body: Value| -> Result<String, String> {
        let out = cli(&server, &["--completion", &body.to_string()]);
        if out.status.success() {
            Ok(String::from_utf8(out.stdout).unwrap())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    };
    let prompt = "héllo wörld, the data";
    for max_tokens in [0, 1] {
        let answer: Value = serde_json::from_str(
            &completion(
                json!({"prompt": prompt, "max_tokens": max_tokens, "echo": true,
                               "logprobs": 1, "temperature": 0}),
            )
            .unwrap(),
        )
        .unwrap();
        let choice = &answer["choices"][0];
        let logprobs = &choice["logprobs"];
        let tokens: Vec<&str> = logprobs["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert_eq!(tokens.len(), prompt_tokens + max_tokens, "{answer}");
        assert!(choice["text"].as_str().unwrap().starts_with(prompt));
        let values = logprobs["token_logprobs"].as_array().unwrap();
        assert!(values[0].is_null());
        assert!(values[1..].iter().all(|v| v.as_f64().unwrap() <= 0.0));
        // Offsets index characters of the text, as Python strings do ("ö" may be split over
        // two byte-level tokens, each shown as U+FFFD).
        let text: Vec<char> = choice["text"].as_str().unwrap().chars().collect();
        let offsets = logprobs["text_offset"].as_array().unwrap();
        assert_eq!(offsets[0], 0);
        assert!(offsets.windows(2).all(|w| w[0].as_u64() <= w[1].as_u64()));
        for (token, offset) in tokens.iter().zip(offsets) {
            let offset = offset.as_u64().unwrap() as usize;
            if !token.contains('\u{fffd}') {
                let piece: String = text[offset..offset + token.chars().count()]
                    .iter()
                    .collect();
                assert_eq!(&piece, token);
            }
        }
        let top = logprobs["top_logprobs"].as_array().unwrap();
        assert!(top[0].is_null());
        for (alternatives, value) in top[1..].iter().zip(&values[1..]) {
            let alternatives = alternatives.as_object().unwrap();
            assert_eq!(alternatives.len(), 1);
            let best = alternatives.values().next().unwrap().as_f64().unwrap();
            assert!(best >= value.as_f64().unwrap() - 1e-6);
        }
        if max_tokens == 1 {
            // Greedy: the generated token is the most likely one.
            let best = top.last().unwrap().as_object().unwrap();
            assert_eq!(best.keys().next().unwrap(), tokens.last().unwrap());
        }
    }
    // lm-eval sends token ids.
    let ids: Value = serde_json::from_str(
        &completion(
            json!({"prompt": [[40, 41, 42]], "max_tokens": 0, "echo": true, "logprobs": 1}),
        )
        .unwrap(),
    )
    .unwrap();
    let tokens = ids["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), 3);
    let echoed: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(ids["choices"][0]["text"], echoed);
    let outside = completion(json!({"prompt": [1, 999999], "max_tokens": 1})).unwrap_err();
    assert!(
        outside.contains("Error 400") && outside.contains("outside the vocabulary"),
        "{outside}"
    );
    let plain: Value =
        serde_json::from_str(&completion(json!({"prompt": "The data", "max_tokens": 0})).unwrap())
            .unwrap();
    assert_eq!(plain["choices"][0]["text"], "");

    let events = completion(
        json!({"prompt": "The data", "max_tokens": 3, "temperature": 0, "echo": true, "stream": true}),
    )
    .unwrap();
    let streamed: String = events
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .take_while(|l| *l != "[DONE]")
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(
        streamed.starts_with("The data") && streamed.len() > "The data".len(),
        "{streamed:?}"
    );

    let rejected =
        completion(json!({"prompt": "The data", "max_tokens": 500, "stream": true})).unwrap_err();
    assert!(
        rejected.contains("Error 400") && rejected.contains("exceed the model's"),
        "{rejected}"
    );
    terminate(server.child);
}

/// Megatron-core's batching flags run unchanged: with at most 3 rows at once and a KV cache of
/// a few blocks (`--inference-max-requests`, `--inference-dynamic-batching-buffer-size-gb`),
/// 8 clients at once each get the answer they get alone, and a request longer than the whole
/// cache is refused naming the flag.
#[test]
fn batching_flags_serve_concurrent_clients_like_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    // 2 layers × 16 positions × 4 heads × 2 · 16 channels × 4 bytes = 16 KiB per block: 6
    // blocks, 5 of them for rows (80 positions).
    let server = serve(
        server_command(&ckpt)
            .args([
                "--inference-max-requests",
                "3",
                "--inference-dynamic-batching-buffer-size-gb",
                "0.0000916",
                "--prefill-chunk-size",
                "4",
            ])
            .spawn()
            .unwrap(),
    );
    let bodies: Vec<String> = (0..8)
        .map(|i| {
            json!({"prompts": [format!("The data {i} and more")], "tokens_to_generate": 12 + i,
                   "top_k": 1 + i % 2, "random_seed": i, "logprobs": true})
            .to_string()
        })
        .collect();
    let alone: Vec<Value> = bodies
        .iter()
        .map(|b| request(&server, b).unwrap())
        .collect();
    let together = all_at_once(&server, &bodies);
    for (got, want) in together.iter().zip(&alone) {
        assert_same_answer(got, want, 1e-4);
    }
    // 92 positions: within the model's 96, beyond the cache's 80.
    let long = json!({"prompts": ["The data"], "tokens_to_generate": 90}).to_string();
    let refused = request(&server, &long).unwrap_err();
    assert!(
        refused.contains("Error 400") && refused.contains("--kv-cache-gb"),
        "{refused}"
    );
    terminate(server.child);
}

/// The official `openai` Python client against `/v1/models`, `/v1/chat/completions` and
/// `/v1/completions`, whole and streamed (tests/fixtures/openai_client.py): a greedy chat
/// answer equals the greedy completion of the prompt `transformers`' apply_chat_template
/// renders from the checkpoint's `tokenizer_config.json`, and of the documented plain
/// template for a checkpoint without one.
#[test]
fn openai_client_chats_through_the_checkpoints_template() {
    let python = test_python(&["openai", "transformers"]);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    // The bundled 4k-token vocabulary spends many tokens on a conversation.
    checkpoint_with_positions(&ckpt, 256);
    let data = workspace_root().join("data");
    let client = |server: &Server, model: &str, template: &str| -> Value {
        let out = Command::new(&python)
            .arg(workspace_root().join("tests/fixtures/openai_client.py"))
            .arg(&server.address)
            .arg(model)
            .arg(data.join("quickstart-vocab.json"))
            .arg(data.join("quickstart-merges.txt"))
            .arg(template)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };

    let plain = start_server(&ckpt);
    let answered = client(&plain, "ckpt", "plain");
    assert!(
        answered["prompt"].as_str().unwrap().ends_with("Assistant:"),
        "{answered}"
    );
    // text_generation_cli --chat gets the same answer.
    let messages = json!([
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "The data"},
        {"role": "assistant", "content": "is"},
        {"role": "user", "content": "more data"},
    ]);
    let body = json!({"messages": messages, "max_tokens": 10, "temperature": 0});
    let out = cli(&plain, &["--chat", &body.to_string()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let chat: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(chat["choices"][0]["message"]["content"], answered["answer"]);
    terminate(plain.child);

    // A ChatML-like template using special tokens and Python string methods.
    let config = ckpt.join("tokenizer_config.json");
    let template = "{{ bos_token }}{% for message in messages %}\n\
        {{ '<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n' }}\n\
        {% endfor %}\n{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    std::fs::write(
        &config,
        json!({"chat_template": template, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
            .to_string(),
    )
    .unwrap();
    let mut command = server_command(&ckpt);
    command.args(["--served-model-name", "tiny-chat"]);
    let templated = serve(command.spawn().unwrap());
    let answered = client(&templated, "tiny-chat", config.to_str().unwrap());
    let prompt = answered["prompt"].as_str().unwrap();
    assert!(
        prompt.starts_with("<|endoftext|><|im_start|>system\nBe brief.<|im_end|>"),
        "{prompt:?}"
    );
    assert!(
        answered["unbounded_tokens"].as_u64().unwrap() > 10,
        "{answered}"
    );
    terminate(templated.child);
}

/// A raw HTTP/1.1 exchange on a new connection: the status, the headers (names in lower
/// case) and the body. Bounded: every read gives up after 60 s.
fn http(
    address: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, Vec<(String, String)>, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {response:?}"));
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    (status, headers, body.to_string())
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

/// The value of the `/metrics` sample whose line starts with `sample`.
fn metric(server: &Server, sample: &str) -> f64 {
    let (status, _, text) = http(&server.address, "GET", "/metrics", "");
    assert_eq!(status, 200, "{text}");
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|v| v.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no {sample} in {text}"))
        .parse()
        .unwrap()
}

/// Waits (at most 30 s) until `done()`.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "waited 30 s for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a streamed completion and returns its connection once the first event has come.
fn start_stream(server: &Server, max_tokens: usize) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let body =
        json!({"prompt": "The data", "max_tokens": max_tokens, "temperature": 0, "stream": true})
            .to_string();
    let mut stream = std::net::TcpStream::connect(&server.address).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buffer[..n]);
    }
    assert!(
        seen.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&seen)
    );
    stream
}

/// The rest of a stream started by [`start_stream`].
fn finish_stream(mut stream: std::net::TcpStream) -> String {
    use std::io::Read;
    let mut rest = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&rest).contains("data: [DONE]") {
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "the stream ended without [DONE]");
        rest.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&rest).into_owned()
}

/// While other clients misbehave: `/health` is answered within `limit` (the HTTP side is not
/// locked out; the model's own time varies with the machine's load) and a short `/api`
/// request is served.
fn assert_served_within(server: &Server, limit: Duration, what: &str) {
    let started = Instant::now();
    let (status, _, body) = http(&server.address, "GET", "/health", "");
    let took = started.elapsed();
    eprintln!("{what}: /health answered in {took:?}");
    assert_eq!(status, 200, "{what}: {body}");
    assert!(took < limit, "{what}: /health took {took:?}");
    let started = Instant::now();
    let (status, _, body) = http(
        &server.address,
        "PUT",
        "/api",
        r#"{"prompts": ["still served"], "tokens_to_generate": 1, "no_log": true}"#,
    );
    eprintln!("{what}: /api answered in {:?}", started.elapsed());
    assert_eq!(status, 200, "{what}: {body}");
}

/// Lets this process hold `connections` sockets (CI machines may start with a soft limit of
/// 1024 open files); returns how many it may hold.
fn allow_open_files(connections: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit
            .rlim_max
            .min((connections + 256) as libc::rlim_t)
            .max(limit.rlim_cur);
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    (limit.rlim_cur as usize)
        .saturating_sub(256)
        .min(connections)
}

/// The hostile and careless clients that locked the old thread-per-connection server out, on
/// loopback: 64 connections sending their body a byte at a time and 2,000 idle connections
/// leave another client served within a second; a streaming client that disconnects has its
/// generation stopped (counted as cancelled, far fewer tokens than asked), and so does an
/// `/api` client's, whose row and KV cache blocks `/metrics` shows while it runs; with the queue
/// full, 300 clients at once are each answered 503 with Retry-After; after SIGTERM the request
/// in flight finishes while new ones are answered 503 with Retry-After, and the server exits
/// cleanly. `/health` and `/metrics` report along the way.
#[test]
fn hostile_clients_leave_others_served() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    // Long generations (up to 2,000 tokens) outlast a disconnect or a SIGTERM by far.
    checkpoint_with_positions(&ckpt, 2048);
    let mut command = server_command(&ckpt);
    // One row at a time, so that a second request waits and a third finds the queue full.
    command.args([
        "--max-queued",
        "1",
        "--max-batch-size",
        "1",
        "--max-tokens-to-oom",
        "4000",
    ]);
    let server = serve(command.spawn().unwrap());
    let (status, _, health) = http(&server.address, "GET", "/health", "");
    assert_eq!((status, health.as_str()), (200, r#"{"status":"ok"}"#));
    let (status, _, models) = http(&server.address, "GET", "/v1/models", "");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&models).unwrap()["data"][0]["id"],
        "ckpt"
    );
    assert_served_within(&server, Duration::from_secs(5), "warm-up");

    // 64 clients sending a body one byte at a time.
    let slow: Vec<std::net::TcpStream> = (0..64)
        .map(|_| {
            let mut stream = std::net::TcpStream::connect(&server.address).unwrap();
            stream
                .write_all(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
                .unwrap();
            stream
        })
        .collect();
    let trickling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let trickler = {
        let trickling = trickling.clone();
        std::thread::spawn(move || {
            let mut slow = slow;
            while trickling.load(std::sync::atomic::Ordering::SeqCst) {
                for stream in &mut slow {
                    let _ = stream.write_all(b" ");
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert_served_within(&server, Duration::from_secs(1), "64 slow bodies");

    // 2,000 idle connections (fewer where this process may not open that many files).
    let wanted = allow_open_files(2000);
    if wanted < 2000 {
        eprintln!("the open-file limit allows {wanted} idle connections instead of 2000");
    }
    let idle: Vec<std::net::TcpStream> = (0..wanted)
        .map(|_| std::net::TcpStream::connect(&server.address).unwrap())
        .collect();
    wait_for("the idle connections to be accepted", || {
        metric(&server, "megatron_open_connections") >= (wanted + 64) as f64
    });
    assert_served_within(&server, Duration::from_secs(1), "idle connections");
    trickling.store(false, std::sync::atomic::Ordering::SeqCst);
    trickler.join().unwrap();
    drop(idle);

    // A streaming client that goes away: its generation stops early.
    let before = metric(&server, "megatron_generation_tokens_total");
    let stream = start_stream(&server, 2000);
    drop(stream);
    wait_for("the cancelled generation to stop", || {
        metric(&server, "megatron_running_requests") == 0.0
    });
    assert_eq!(metric(&server, "megatron_cancelled_requests_total"), 1.0);
    let generated = metric(&server, "megatron_generation_tokens_total") - before;
    eprintln!("a gone client's generation stopped after {generated} tokens");
    assert!(
        generated < 1000.0,
        "{generated} tokens generated for a gone client"
    );
    assert_served_within(&server, Duration::from_secs(1), "after a disconnect");

    // An /api client that goes away: the batch shows its row and KV cache blocks while it
    // runs, and its request is cancelled (far fewer steps than its 2,000 tokens).
    let steps_before = metric(&server, "megatron_generation_steps_total");
    let mut api = std::net::TcpStream::connect(&server.address).unwrap();
    // Greedy: a sampled end-of-document token would end the request before it is seen running.
    let body =
        r#"{"prompts": ["The data"], "tokens_to_generate": 2000, "top_k": 1, "no_log": true}"#;
    write!(
        api,
        "PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_for("the /api request to run", || {
        metric(&server, "megatron_running_requests") == 1.0
            && metric(&server, "megatron_batch_size") == 1.0
            && metric(&server, "megatron_kv_cache_blocks_used") > 0.0
    });
    let capacity = metric(&server, "megatron_kv_cache_blocks_capacity");
    assert!(
        capacity >= metric(&server, "megatron_kv_cache_blocks_used"),
        "{capacity}"
    );
    drop(api);
    wait_for("the cancelled /api request to stop", || {
        metric(&server, "megatron_running_requests") == 0.0
    });
    assert_eq!(metric(&server, "megatron_cancelled_requests_total"), 2.0);
    // Counted as a client gone from /api (the streaming client above had its answer's head).
    wait_for("the /api disconnect to be counted", || {
        metric(
            &server,
            "megatron_client_disconnects_total{endpoint=\"/api\"}",
        ) == 1.0
    });
    let steps = metric(&server, "megatron_generation_steps_total") - steps_before;
    assert!(steps < 1000.0, "{steps} steps run for a gone /api client");
    wait_for("its blocks to be freed", || {
        metric(&server, "megatron_kv_cache_blocks_used") == 0.0
    });

    // A full queue: one request running, one waiting, the next refused with Retry-After.
    let running = start_stream(&server, 2000);
    let address = server.address.clone();
    let waiting = std::thread::spawn(move || {
        http(
            &address,
            "PUT",
            "/api",
            r#"{"prompts": ["queued"], "tokens_to_generate": 2, "no_log": true}"#,
        )
    });
    wait_for("a request to wait in the queue", || {
        metric(&server, "megatron_queue_depth") == 1.0
    });
    // 300 clients at once: each is answered 503 at once, none waits or gets an empty reply.
    let refused: Vec<_> = (0..300)
        .map(|_| {
            let address = server.address.clone();
            std::thread::spawn(move || {
                http(
                    &address,
                    "POST",
                    "/v1/completions",
                    r#"{"prompt": "refused", "max_tokens": 2}"#,
                )
            })
        })
        .collect();
    for client in refused {
        let (status, headers, body) = client.join().unwrap();
        assert_eq!(status, 503, "{body}");
        assert_eq!(header(&headers, "retry-after"), Some("1"));
        assert!(body.contains("the server is busy"), "{body}");
    }
    drop(running);
    assert_eq!(waiting.join().unwrap().0, 200);
    assert_eq!(
        metric(
            &server,
            "megatron_requests_total{endpoint=\"/v1/completions\",status=\"503\"}"
        ),
        300.0
    );
    assert!(metric(&server, "megatron_time_to_first_token_seconds_count") >= 2.0);

    // SIGTERM during a generation: it finishes, new requests are refused until the exit.
    let in_flight = start_stream(&server, 500);
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    wait_for("the server to start draining", || {
        http(&server.address, "GET", "/health", "").0 == 503
    });
    let (status, headers, body) = http(
        &server.address,
        "PUT",
        "/api",
        r#"{"prompts": ["late"], "tokens_to_generate": 2}"#,
    );
    assert_eq!(status, 503, "{body}");
    assert!(header(&headers, "retry-after").is_some(), "{headers:?}");
    assert!(body.contains("shutting down"), "{body}");
    let rest = finish_stream(in_flight);
    assert!(rest.contains("\"finish_reason\""), "{rest}");
    wait_success(server.child, "the server after draining");
}

/// The connection limits: connections beyond `--max-connections` are answered 503 with
/// Retry-After and closed; a connection that sends no request is closed after
/// `--http-header-timeout`; a body slower than `--http-body-timeout` is answered 408.
#[test]
fn connection_limits_and_timeouts() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let mut command = server_command(&ckpt);
    command.args([
        "--max-connections",
        "4",
        "--http-header-timeout",
        "2",
        "--http-body-timeout",
        "2",
    ]);
    let server = serve(command.spawn().unwrap());
    let idle: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(&server.address).unwrap())
        .collect();
    let (status, headers, body) = http(&server.address, "GET", "/health", "");
    assert_eq!(status, 503, "{body}");
    assert_eq!(header(&headers, "retry-after"), Some("1"));
    assert!(body.contains("too many connections"), "{body}");

    // The idle connections are closed by the server after the header timeout.
    let started = Instant::now();
    for mut connection in idle {
        connection
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut buffer = [0u8; 256];
        // Returns when the server hangs up; a read timeout means it did not.
        let read = connection.read(&mut buffer);
        let timed_out = read.as_ref().is_err_and(|e| {
            matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        });
        assert!(
            !timed_out && started.elapsed() < Duration::from_secs(15),
            "an idle connection stayed open for {:?}",
            started.elapsed()
        );
    }
    wait_for("a free connection slot", || {
        http(&server.address, "GET", "/health", "").0 == 200
    });
    // The refusal above (and any while waiting for a slot) is counted.
    assert!(metric(&server, "megatron_refused_connections_total") >= 1.0);

    // A body that does not arrive in time.
    let mut slow = std::net::TcpStream::connect(&server.address).unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    slow.write_all(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        .unwrap();
    let mut answer = String::new();
    let _ = slow.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 2 s"), "{answer}");
    terminate(server.child);
}

/// The paths Megatron's servers answer to beside ours give what ours give: `/completions`,
/// `/chat/completions` and `/v1/health`; `GET /v1/models/{id}` describes the served model.
#[test]
fn megatrons_paths_answer_as_ours() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let address = &server.address.clone();
    assert_eq!(
        http(address, "GET", "/v1/health", "").2,
        http(address, "GET", "/health", "").2
    );
    let completion = r#"{"prompt": "The data", "max_tokens": 6, "temperature": 0}"#;
    let text = |path: &str, body: &str| {
        let (status, _, reply) = http(address, "POST", path, body);
        assert_eq!(status, 200, "{path}: {reply}");
        serde_json::from_str::<Value>(&reply).unwrap()["choices"][0].clone()
    };
    assert_eq!(
        text("/completions", completion)["text"],
        text("/v1/completions", completion)["text"]
    );
    let (status, _, model) = http(address, "GET", "/v1/models/ckpt", "");
    assert_eq!(status, 200, "{model}");
    let model: Value = serde_json::from_str(&model).unwrap();
    assert_eq!(
        (model["id"].as_str(), model["object"].as_str()),
        (Some("ckpt"), Some("model"))
    );
    let (status, _, missing) = http(address, "GET", "/v1/models/gpt-4", "");
    assert_eq!(status, 404, "{missing}");
    assert!(missing.contains("gpt-4"), "{missing}");
    let (status, _, wrong_method) = http(address, "GET", "/completions", "");
    assert_eq!(status, 405, "{wrong_method}");
    assert!(wrong_method.contains("POST /completions"), "{wrong_method}");
    terminate(server.child);
}

/// Runs the server with `extra` flags until it exits by itself (at most 120 s: a server that
/// keeps serving fails the test); its exit code and stderr.
fn exit_of(checkpoint: &Path, extra: &[&str]) -> (Option<i32>, String) {
    use std::io::Read;
    let mut child = server_command(checkpoint).args(extra).spawn().unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let drain = std::thread::spawn(move || std::io::copy(&mut stdout, &mut std::io::sink()));
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server with {extra:?} kept running");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = drain.join();
    (status.code(), errors.join().unwrap())
}

/// A server that cannot serve stops at start, naming the flag and the limit, instead of
/// answering `/health` 200 and every generation 500: a KV cache below one sequence of
/// `--seq-length`, one larger than the machine's memory (without libtorch's backtrace).
/// Flags that leave nothing to serve with are usage errors (exit 2).
#[test]
fn a_server_that_cannot_serve_stops_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    // 2 layers × 2 (keys, values) × 16 positions × 64 channels × 4 bytes = 16 KiB per block.
    let (code, stderr) = exit_of(&ckpt, &["--kv-cache-gb", "0.00003", "--seq-length", "64"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--kv-cache-gb 0.00003 holds 0 KV blocks of 16 positions (16384 bytes")
            && stderr.contains("one sequence of 64 positions needs 4"),
        "{stderr}"
    );
    let (code, stderr) = exit_of(
        &ckpt,
        &["--kv-cache-gb", "1000", "--max-batch-size", "100000000"],
    );
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--kv-cache-gb 1000 asks for a KV cache of")
            && stderr.contains("but the machine has")
            && !stderr.contains("frame #"),
        "{stderr}"
    );
    for (flag, value) in [
        ("--max-connections", "0"),
        ("--seq-length", "0"),
        ("--http-threads", "0"),
        ("--max-queued", "0"),
        ("--inference-max-seq-length", "0"),
    ] {
        let (code, stderr) = exit_of(&ckpt, &[flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("must be at least 1"),
            "{flag} {value}: {stderr}"
        );
    }
}

/// What chat and completions cannot honour is refused with 400 naming it, never answered as
/// if it had not been asked: tools and functions, a response format other than text, a role
/// other than system, user or assistant, a message without content, a completion's suffix.
#[test]
fn openai_fields_the_server_cannot_honour_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let user = json!({"role": "user", "content": "Hi"});
    let refused = [
        (
            "/v1/chat/completions",
            json!({"messages": [user, {"role": "wizard", "content": "Hi"}]}),
            "messages[1].role \"wizard\" is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user"}]}),
            "messages[0].content is required",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user, {"role": "assistant", "content": null}]}),
            "messages[1].content is required",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user], "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user], "tool_choice": "auto"}),
            "tool_choice is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user], "functions": [{"name": "f"}]}),
            "functions is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user], "function_call": "auto"}),
            "function_call is not supported",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [user], "response_format": {"type": "json_object"}}),
            "response_format is not supported",
        ),
        (
            "/v1/completions",
            json!({"prompt": "The data", "suffix": " end"}),
            "suffix is not supported",
        ),
    ];
    for (path, body, message) in refused {
        let (status, _, answer) = http(&server.address, "POST", path, &body.to_string());
        assert_eq!(status, 400, "{body}: {answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        let text = answer["error"]["message"].as_str().unwrap();
        assert!(text.contains(message), "{body}: {text}");
    }
    let text_format =
        json!({"messages": [user], "max_tokens": 2, "response_format": {"type": "text"}});
    let (status, _, answer) = http(
        &server.address,
        "POST",
        "/v1/chat/completions",
        &text_format.to_string(),
    );
    assert_eq!(status, 200, "{answer}");
    terminate(server.child);
}

/// `text_offset` of a completion without echo counts from the start of the prompt, as
/// Megatron's completions endpoint answers (offsets into prompt and completion together): the
/// same offsets as the echoed completion's for the generated tokens, the first at the
/// prompt's length.
#[test]
fn text_offsets_without_echo_count_from_the_prompts_start() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let prompt = "The data héllo";
    let offsets = |echo: bool| -> (Vec<u64>, u64) {
        let body = json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0,
                          "echo": echo});
        let (status, _, answer) = http(
            &server.address,
            "POST",
            "/v1/completions",
            &body.to_string(),
        );
        assert_eq!(status, 200, "{answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        let offsets = answer["choices"][0]["logprobs"]["text_offset"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o.as_u64().unwrap())
            .collect();
        (offsets, answer["usage"]["prompt_tokens"].as_u64().unwrap())
    };
    let (echoed, prompt_tokens) = offsets(true);
    let (plain, _) = offsets(false);
    assert_eq!(plain[..], echoed[prompt_tokens as usize..]);
    assert_eq!(plain[0], prompt.chars().count() as u64);
    terminate(server.child);
}

/// The tiny CPU versions of Megatron's server scripts (`examples/inference/
/// run_text_generation_server_345M.sh` and `llama_mistral/run_text_generation_{llama3,
/// llama3.1,mistral}.sh`, their sizes shrunk, every flag kept) start the server against a
/// checkpoint of the same architecture and answer `PUT /api`. With them, the flags of
/// Megatron's `tools/run_text_generation_server.py` are accepted: `--inference-max-seq-length`
/// bounds prompt + generation, the others change nothing here (Megatron's server does not
/// read them either, or they are our defaults); `--exit-on-missing-checkpoint` with nothing
/// to load is an error.
#[test]
fn megatrons_inference_scripts_run_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let hf_tokenizer = shared_dir()
        .join("data")
        .join("gpt2-tokenizer.json")
        .display()
        .to_string();
    let hf = vec![
        "--tokenizer-type".to_string(),
        "HuggingFaceTokenizer".to_string(),
        "--tokenizer-model".to_string(),
        hf_tokenizer.clone(),
    ];
    let llama = |positions: &'static str, base: &'static str| -> Vec<&'static str> {
        vec![
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--ffn-hidden-size",
            "128",
            "--num-attention-heads",
            "4",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--seq-length",
            "64",
            "--max-position-embeddings",
            positions,
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            base,
            "--rotary-percent",
            "1.0",
            "--normalization",
            "RMSNorm",
            "--swiglu",
            "--disable-bias-linear",
            "--untie-embeddings-and-output-weights",
        ]
    };
    let gpt = vec![
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--max-position-embeddings",
        "64",
    ];
    let mut llama31 = llama("128", "500000");
    llama31.push("--use-rope-scaling");
    let mut mistral = llama("64", "1000000");
    mistral.push("--apply-layernorm-1p");
    let checkpoints = [
        ("345m", gpt, quickstart_tokenizer_flags()),
        ("llama3", llama("64", "500000"), hf.clone()),
        ("llama3.1", llama31, hf.clone()),
        ("mistral", mistral, hf.clone()),
    ];
    for (name, architecture, tokenizer) in &checkpoints {
        mock_gpt_checkpoint(&dir.path().join(name), architecture, tokenizer);
    }
    let load = |name: &str| dir.path().join(name).display().to_string();
    let words = |text: &str| -> Vec<String> { text.split_whitespace().map(String::from).collect() };
    let hf_script = |rest: &str| -> Vec<String> {
        let mut flags = words(
            "--use-checkpoint-args --disable-bias-linear --tokenizer-type HuggingFaceTokenizer \
             --tokenizer-model",
        );
        flags.push(hf_tokenizer.clone());
        flags.extend(words(rest));
        flags
    };
    let mut server_345m = words(
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 2 \
         --hidden-size 64 --load",
    );
    server_345m.push(load("345m"));
    server_345m.extend(words(
        "--num-attention-heads 4 --max-position-embeddings 64 --tokenizer-type GPT2BPETokenizer \
         --fp16 --micro-batch-size 1 --seq-length 64",
    ));
    server_345m.extend(quickstart_tokenizer_flags()[2..].iter().cloned());
    server_345m.extend(words("--seed 42"));
    let llama_flags = |base: &str, scaling: &str, positions: &str, name: &str| {
        let mut flags = hf_script(&format!(
            "--transformer-impl transformer_engine --normalization RMSNorm \
             --group-query-attention --num-query-groups 2 --no-masked-softmax-fusion \
             --attention-softmax-in-fp32 --attention-dropout 0.0 --hidden-dropout 0.0 \
             --untie-embeddings-and-output-weights --position-embedding-type rope \
             --rotary-percent 1.0 --rotary-base {base} {scaling} \
             --use-rotary-position-embeddings --swiglu --tensor-model-parallel-size 1 \
             --pipeline-model-parallel-size 1 --num-layers 2 --hidden-size 64 \
             --ffn-hidden-size 128 --load"
        ));
        flags.push(load(name));
        flags.extend(words(&format!(
            "--num-attention-heads 4 --max-position-embeddings {positions} --bf16 \
             --micro-batch-size 1 --seq-length 64"
        )));
        flags
    };
    let mut mistral_flags = words("--tokenizer-type HuggingFaceTokenizer --tokenizer-model");
    mistral_flags.push(hf_tokenizer.clone());
    mistral_flags.extend(words(
        "--use-checkpoint-args --apply-layernorm-1p --transformer-impl transformer_engine \
         --normalization RMSNorm --group-query-attention --num-query-groups 2 \
         --no-masked-softmax-fusion --use-flash-attn --untie-embeddings-and-output-weights \
         --disable-bias-linear --position-embedding-type rope --rotary-percent 1.0 \
         --rotary-base 1000000 --swiglu --ffn-hidden-size 128 --tensor-model-parallel-size 1 \
         --pipeline-model-parallel-size 1 --num-layers 2 --hidden-size 64 --load",
    ));
    mistral_flags.push(load("mistral"));
    mistral_flags.extend(words(
        "--num-attention-heads 4 --max-position-embeddings 64 --bf16 --micro-batch-size 1 \
         --seq-length 64 --seed 101",
    ));
    // Megatron's run_text_generation_server.py flags, with the 345M script's.
    let mut with_server_flags = server_345m.clone();
    with_server_flags.extend(words(
        "--temperature 1.0 --top_k 1 --top_p 0.0 --return-log-probs \
         --num-tokens-to-generate 30 --inference-max-seq-length 48 \
         --exit-on-missing-checkpoint --enable-cuda-graph --flash-decode --prompts Hello World",
    ));
    let scripts = [
        ("345m", server_345m),
        ("llama3", llama_flags("500000", "", "64", "llama3")),
        (
            "llama3.1",
            llama_flags("500000", "--use-rope-scaling", "128", "llama3.1"),
        ),
        ("mistral", mistral_flags),
        ("345m with the server script's flags", with_server_flags),
    ];
    for (name, flags) in &scripts {
        let mut command = bin("text_generation_server");
        command
            .args(flags)
            .args(["--port", "0", "--device", "cpu"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let server = serve(command.spawn().unwrap());
        let (status, _, answer) = http(
            &server.address,
            "PUT",
            "/api",
            r#"{"prompts": ["The data"], "tokens_to_generate": 4, "top_k": 1}"#,
        );
        assert_eq!(status, 200, "{name}: {answer}");
        let answer: Value = serde_json::from_str(&answer).unwrap();
        assert!(
            answer["text"][0].as_str().unwrap().starts_with("The data"),
            "{name}: {answer}"
        );
        // 2 prompt tokens and 47 new ones: within the model's 64 positions, beyond 48.
        let (status, _, answer) = http(
            &server.address,
            "PUT",
            "/api",
            r#"{"prompts": ["The data"], "tokens_to_generate": 47, "top_k": 1}"#,
        );
        if name.contains("server script") {
            assert_eq!(status, 400, "{name}: {answer}");
            assert!(answer.contains("longer than allowed"), "{name}: {answer}");
        } else {
            assert_eq!(status, 200, "{name}: {answer}");
        }
        terminate(server.child);
    }
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, stderr) = exit_of(&empty, &["--exit-on-missing-checkpoint"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains(&empty.display().to_string()), "{stderr}");
}

/// The JSON events of a streamed answer that `text_generation_cli` printed, before `[DONE]`.
fn events(printed: &str) -> Vec<Value> {
    printed
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .take_while(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Streamed completions and chat completions that ask for log-probabilities carry, in each
/// chunk, those of the tokens whose text the chunk carries (the last chunk the tokens no text
/// carried): together they are the unstreamed answer's tokens, log-probabilities and offsets.
#[test]
fn streamed_chunks_carry_their_own_logprobs() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let ask = |flag: &str, body: Value| -> Result<String, String> {
        let out = cli(&server, &[flag, &body.to_string()]);
        if out.status.success() {
            Ok(String::from_utf8(out.stdout).unwrap())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    };
    let strings = |v: &Value| -> Vec<Value> { v.as_array().unwrap().clone() };
    let assert_close = |got: &[Value], want: &[Value], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            let (g, w) = (g.as_f64().unwrap(), w.as_f64().unwrap());
            assert!((g - w).abs() < 1e-5, "{what}: {g} vs {w}");
        }
    };

    let body = json!({"prompt": "The data", "max_tokens": 10, "temperature": 0, "logprobs": 0});
    let whole: Value = serde_json::from_str(&ask("--completion", body.clone()).unwrap()).unwrap();
    let whole = &whole["choices"][0]["logprobs"];
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let chunks = events(&ask("--completion", streaming).unwrap());
    let (mut tokens, mut values, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
    for (n, chunk) in chunks.iter().enumerate() {
        let choice = &chunk["choices"][0];
        let logprobs = &choice["logprobs"];
        assert!(
            logprobs.is_object(),
            "chunk {n} carries no logprobs: {chunk}"
        );
        let carried = strings(&logprobs["tokens"]);
        if choice["finish_reason"].is_null()
            && !carried
                .iter()
                .any(|t| t.as_str().unwrap().contains('\u{fffd}'))
        {
            let spelled: String = carried.iter().map(|t| t.as_str().unwrap()).collect();
            assert_eq!(spelled, choice["text"].as_str().unwrap(), "chunk {n}");
        }
        tokens.extend(carried);
        values.extend(strings(&logprobs["token_logprobs"]));
        offsets.extend(strings(&logprobs["text_offset"]));
    }
    assert_eq!(tokens, strings(&whole["tokens"]));
    assert_eq!(offsets, strings(&whole["text_offset"]));
    assert_close(&values, &strings(&whole["token_logprobs"]), "completion");

    let body = json!({"messages": [{"role": "user", "content": "The data"}], "max_tokens": 10,
                      "temperature": 0, "logprobs": true});
    let whole: Value = serde_json::from_str(&ask("--chat", body.clone()).unwrap()).unwrap();
    let whole = strings(&whole["choices"][0]["logprobs"]["content"]);
    assert!(!whole.is_empty());
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let mut content = Vec::new();
    for chunk in events(&ask("--chat", streaming).unwrap()) {
        if let Some(carried) = chunk["choices"][0]["logprobs"]["content"].as_array() {
            content.extend(carried.iter().cloned());
        }
    }
    let token =
        |entries: &[Value]| -> Vec<Value> { entries.iter().map(|e| e["token"].clone()).collect() };
    let logprob = |entries: &[Value]| -> Vec<Value> {
        entries.iter().map(|e| e["logprob"].clone()).collect()
    };
    assert_eq!(token(&content), token(&whole));
    assert_close(&logprob(&content), &logprob(&whole), "chat");

    // Two seeded samples of one chat, streamed: each choice's role, deltas and finish come
    // under its index and add up to that choice unstreamed.
    let body = json!({"messages": [{"role": "user", "content": "The data"}], "max_tokens": 10,
                      "temperature": 1.0, "seed": 7, "n": 2});
    let whole: Value = serde_json::from_str(&ask("--chat", body.clone()).unwrap()).unwrap();
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let (mut texts, mut roles, mut finishes) = (vec![String::new(); 2], [0; 2], [0; 2]);
    for chunk in events(&ask("--chat", streaming).unwrap()) {
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        let index = choice["index"].as_u64().unwrap() as usize;
        if choice["delta"]["role"] == "assistant" {
            roles[index] += 1;
        }
        texts[index] += choice["delta"]["content"].as_str().unwrap_or("");
        finishes[index] += usize::from(!choice["finish_reason"].is_null());
    }
    assert_eq!((roles, finishes), ([1, 1], [1, 1]));
    for (index, text) in texts.iter().enumerate() {
        assert_eq!(
            text,
            whole["choices"][index]["message"]["content"]
                .as_str()
                .unwrap(),
            "choice {index}"
        );
    }
    assert_ne!(texts[0], texts[1], "two samples");

    terminate(server.child);
}

/// A streamed completion's chunks put together per choice (`choices` of them), as the
/// unstreamed answer holds each: its text and its `logprobs` (`tokens`, `token_logprobs`,
/// `text_offset`, `top_logprobs`), the last chunk's included.
fn assembled_completion(chunks: &[Value], choices: usize) -> Vec<Value> {
    let keys = ["tokens", "token_logprobs", "text_offset", "top_logprobs"];
    let mut assembled = vec![
        json!({"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}});
        choices
    ];
    for chunk in chunks {
        for choice in chunk["choices"].as_array().unwrap() {
            let whole = &mut assembled[choice["index"].as_u64().unwrap() as usize];
            let text =
                whole["text"].as_str().unwrap().to_string() + choice["text"].as_str().unwrap();
            whole["text"] = json!(text);
            for key in keys {
                if let Some(items) = choice["logprobs"][key].as_array() {
                    whole["logprobs"][key]
                        .as_array_mut()
                        .unwrap()
                        .extend(items.iter().cloned());
                }
            }
        }
    }
    assembled
}

/// Two numbers (or two nulls) within 1e-5.
fn assert_close_values(got: &Value, want: &Value, what: &str) {
    if want.is_null() {
        assert!(got.is_null(), "{what}: {got} vs null");
        return;
    }
    let (g, w) = (got.as_f64().unwrap(), want.as_f64().unwrap());
    assert!((g - w).abs() < 1e-5, "{what}: {g} vs {w}");
}

/// A streamed choice's legacy `logprobs` against the unstreamed one's: the same tokens,
/// offsets and alternatives (`n` at each position with a value), values within 1e-5.
fn assert_same_completion_logprobs(got: &Value, want: &Value, n: usize, what: &str) {
    assert_eq!(got["tokens"], want["tokens"], "{what}");
    assert_eq!(got["text_offset"], want["text_offset"], "{what}");
    let (values, expected) = (
        got["token_logprobs"].as_array().unwrap(),
        want["token_logprobs"].as_array().unwrap(),
    );
    assert_eq!(values.len(), expected.len(), "{what}");
    for (g, w) in values.iter().zip(expected) {
        assert_close_values(g, w, what);
    }
    let Some(expected) = want["top_logprobs"].as_array() else {
        assert_eq!(
            got["top_logprobs"],
            json!([]),
            "{what}: alternatives not asked for"
        );
        return;
    };
    let top = got["top_logprobs"].as_array().unwrap();
    assert_eq!(top.len(), expected.len(), "{what}");
    for (position, (g, w)) in top.iter().zip(expected).enumerate() {
        if w.is_null() {
            assert!(g.is_null(), "{what}: position {position}");
            continue;
        }
        let (g, w) = (g.as_object().unwrap(), w.as_object().unwrap());
        assert!(w.len() <= n && !w.is_empty(), "{what}: {w:?}");
        assert_eq!(
            g.keys().collect::<Vec<_>>(),
            w.keys().collect::<Vec<_>>(),
            "{what}: position {position}"
        );
        for (text, value) in w {
            assert_close_values(&g[text], value, what);
        }
    }
}

/// Streamed requests asking for the most likely tokens at each position (`logprobs: N` of
/// completions, `top_logprobs: N` of chat) get them in each chunk for the tokens it carries,
/// per choice with `n = 2`, while another request shares the batch: put together they are the
/// unstreamed answer's, token by token, values within 1e-5.
#[test]
fn streamed_chunks_carry_their_tokens_alternatives() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint_with_positions(&ckpt, 512);
    let server = start_server(&ckpt);
    let ask = |flag: &str, body: &Value| -> String {
        let out = cli(&server, &[flag, &body.to_string()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    // Another client's long completion runs beside them.
    let beside = start_stream(&server, 480);

    let body = json!({"prompt": "The data", "max_tokens": 10, "temperature": 0, "logprobs": 3,
                      "n": 2});
    let whole: Value = serde_json::from_str(&ask("--completion", &body)).unwrap();
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let chunks = events(&ask("--completion", &streaming));
    for chunk in &chunks[..chunks.len() - 1] {
        let choice = &chunk["choices"][0];
        let logprobs = &choice["logprobs"];
        assert_eq!(
            logprobs["top_logprobs"].as_array().unwrap().len(),
            logprobs["tokens"].as_array().unwrap().len(),
            "{chunk}"
        );
    }
    let assembled = assembled_completion(&chunks, 2);
    for (index, streamed) in assembled.iter().enumerate() {
        let want = &whole["choices"][index];
        assert_eq!(streamed["text"], want["text"], "choice {index}");
        assert!(!want["logprobs"]["tokens"].as_array().unwrap().is_empty());
        assert_same_completion_logprobs(
            &streamed["logprobs"],
            &want["logprobs"],
            3,
            &format!("completion choice {index}"),
        );
    }

    let body = json!({"messages": [{"role": "user", "content": "The data"}], "max_tokens": 10,
                      "temperature": 0, "logprobs": true, "top_logprobs": 3, "n": 2});
    let whole: Value = serde_json::from_str(&ask("--chat", &body)).unwrap();
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let mut content = vec![Vec::new(); 2];
    for chunk in events(&ask("--chat", &streaming)) {
        let Some(choice) = chunk["choices"].get(0) else {
            continue;
        };
        if let Some(carried) = choice["logprobs"]["content"].as_array() {
            content[choice["index"].as_u64().unwrap() as usize].extend(carried.iter().cloned());
        }
    }
    for (index, streamed) in content.iter().enumerate() {
        let want = whole["choices"][index]["logprobs"]["content"]
            .as_array()
            .unwrap();
        assert!(!want.is_empty());
        assert_eq!(streamed.len(), want.len(), "chat choice {index}");
        for (g, w) in streamed.iter().zip(want) {
            let what = format!("chat choice {index}: {g} vs {w}");
            assert_eq!(
                (&g["token"], &g["bytes"]),
                (&w["token"], &w["bytes"]),
                "{what}"
            );
            assert_close_values(&g["logprob"], &w["logprob"], &what);
            let (top, expected) = (
                g["top_logprobs"].as_array().unwrap(),
                w["top_logprobs"].as_array().unwrap(),
            );
            assert_eq!(top.len(), expected.len(), "{what}");
            assert!(!expected.is_empty() && expected.len() <= 3, "{what}");
            for (a, b) in top.iter().zip(expected) {
                assert_eq!(a["token"], b["token"], "{what}");
                assert_close_values(&a["logprob"], &b["logprob"], &what);
            }
            // Greedy: the chosen token is the likeliest.
            assert_close_values(&w["logprob"], &expected[0]["logprob"], &what);
        }
    }
    assert!(finish_stream(beside).contains("data: [DONE]"));
    terminate(server.child);
}

/// A streamed echo asking for log-probabilities starts with the prompt and its tokens (the
/// first without a value), as the unstreamed echo gives them; with `max_tokens: 0` the prompt
/// comes whole in the one chunk.
#[test]
fn streamed_echo_carries_the_prompts_logprobs_first() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let prompt = "héllo wörld, the data";
    for (max_tokens, logprobs) in [(4, 2), (0, 1), (3, 0)] {
        let body = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "echo": true, "logprobs": logprobs});
        let out = cli(&server, &["--completion", &body.to_string()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let whole: Value = serde_json::from_slice(&out.stdout).unwrap();
        let mut streaming = body.clone();
        streaming["stream"] = json!(true);
        let out = cli(&server, &["--completion", &streaming.to_string()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let chunks = events(&String::from_utf8(out.stdout).unwrap());
        let what = format!("max_tokens {max_tokens}, logprobs {logprobs}");
        let first = &chunks[0]["choices"][0];
        assert_eq!(first["text"], prompt, "{what}");
        let prompt_tokens = whole["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        assert_eq!(
            first["logprobs"]["tokens"].as_array().unwrap().len(),
            prompt_tokens,
            "{what}: {first}"
        );
        assert!(first["logprobs"]["token_logprobs"][0].is_null(), "{what}");
        let want = &whole["choices"][0];
        let streamed = &assembled_completion(&chunks, 1)[0];
        assert_eq!(streamed["text"], want["text"], "{what}");
        assert_same_completion_logprobs(&streamed["logprobs"], &want["logprobs"], logprobs, &what);
    }
    terminate(server.child);
}

/// The official `openai` Python client reads streamed completions (`logprobs: 3`, with and
/// without `echo`) and chat completions (`top_logprobs: 3`), two choices each: put together
/// per choice, the chunks' tokens, log-probabilities and alternatives equal the unstreamed
/// answer's (tests/fixtures/openai_stream_logprobs.py).
#[test]
fn openai_client_reads_streamed_alternatives() {
    let python = test_python(&["openai"]);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    checkpoint(&ckpt);
    let server = start_server(&ckpt);
    let out = Command::new(&python)
        .arg(workspace_root().join("tests/fixtures/openai_stream_logprobs.py"))
        .arg(&server.address)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let compared: Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["completion", "echo", "chat"] {
        assert!(compared[key].as_u64().unwrap() > 0, "{compared}");
    }
    terminate(server.child);
}

/// A tiny random HuggingFace model of `kind` (scripts/hf_reference.py) in `dir`.
fn hf_model(kind: &str, dir: &Path) {
    let python = test_python(&["torch", "transformers"]);
    run_ok(
        Command::new(python)
            .arg(workspace_root().join("scripts/hf_reference.py"))
            .args(["make", kind])
            .arg(dir),
    );
}

/// transformers' greedy continuation (`generate(do_sample=False)`) of each prompt, `new`
/// tokens, from the model in `dir`; and the model's class.
fn hf_greedy(dir: &Path, new: usize, prompts: &[Vec<i64>]) -> (String, Vec<Vec<i64>>) {
    let python = test_python(&["torch", "transformers"]);
    let prompts = prompts
        .iter()
        .map(|p| p.iter().map(i64::to_string).collect::<Vec<_>>().join(","));
    let out = run_ok(
        Command::new(python)
            .arg(workspace_root().join("tests/fixtures/hf_greedy.py"))
            .arg(dir)
            .arg(new.to_string())
            .args(prompts),
    );
    let reply: Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids = |list: &Value| -> Vec<i64> {
        list.as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect()
    };
    let generated = reply["generated"].as_array().unwrap().iter().map(ids);
    (
        reply["architecture"].as_str().unwrap().to_string(),
        generated.collect(),
    )
}

/// Mixture-of-Experts models are served as transformers runs them: tiny random Mixtral,
/// Qwen2-MoE (gated shared expert, a dense layer between sparse ones, QKV biases) and Qwen3-MoE
/// (per-head query and key norms) given to `--load-hf`, and the Qwen2-MoE also imported by
/// `checkpoint_convert` and given to `--load`, answer concurrent greedy requests (continuous
/// batching over the paged KV cache: decode steps of one token per sequence, in which most
/// experts receive no token) with transformers' `generate(do_sample=False)` tokens, in float32
/// on the CPU. With the NullTokenizer the texts are the ids; its end-of-document id (999) is
/// the models' last row, where a generation may stop early.
#[test]
fn moe_models_serve_greedy_like_transformers() {
    const NEW: usize = 10;
    let prompts: Vec<Vec<i64>> = vec![
        vec![5, 17, 300, 42],
        vec![1, 2],
        vec![900, 800, 7, 7, 7, 7, 7, 7, 7],
        vec![123],
    ];
    let dir = tempfile::tempdir().unwrap();
    for (kind, architecture) in [
        ("mixtral", "MixtralForCausalLM"),
        ("qwen2_moe", "Qwen2MoeForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ] {
        let hf = dir.path().join(kind);
        hf_model(kind, &hf);
        let (class, expected) = hf_greedy(&hf, NEW, &prompts);
        assert_eq!(class, architecture);
        let mut sources = vec![vec!["--load-hf".to_string(), hf.display().to_string()]];
        if kind == "qwen2_moe" {
            let imported = dir.path().join("imported");
            run_ok(
                bin("checkpoint_convert")
                    .args(["--model-type", "GPT", "--loader", "hf"])
                    .args(["--saver", "megatron-rs", "--load-dir"])
                    .arg(&hf)
                    .arg("--save-dir")
                    .arg(&imported),
            );
            sources.push(vec!["--load".into(), imported.display().to_string()]);
        }
        for source in sources {
            let mut command = bin("text_generation_server");
            command
                .args(&source)
                .args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "999"])
                .args(["--port", "0", "--device", "cpu"])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let server = serve(command.spawn().unwrap());
            let bodies: Vec<String> = prompts
                .iter()
                .map(|prompt| {
                    let text: Vec<String> = prompt.iter().map(i64::to_string).collect();
                    json!({"prompts": [text.join(" ")], "tokens_to_generate": NEW, "top_k": 1})
                        .to_string()
                })
                .collect();
            let answers = all_at_once(&server, &bodies);
            terminate(server.child);
            for ((answer, prompt), want) in answers.iter().zip(&prompts).zip(&expected) {
                let text = answer["text"][0].as_str().unwrap();
                let ids: Vec<i64> = text.split(' ').map(|t| t.parse().unwrap()).collect();
                let got = &ids[prompt.len()..];
                let what = format!("{kind} from {source:?}, prompt {prompt:?}");
                assert_eq!(&ids[..prompt.len()], prompt.as_slice(), "{what}");
                assert!(
                    got.len() == NEW || got.last() == Some(&999),
                    "{what}: {got:?}"
                );
                assert_eq!(got, &want[..got.len()], "{what}: transformers {want:?}");
            }
        }
    }
}
