//! `text_generation_server`: Megatron's `tools/run_text_generation_server.py` — `PUT /api`
//! with Megatron's request fields, defaults, messages and response.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use megatron_cli::signals::{exit_requested, install_exit_handler};
use megatron_data::flags::TokenizerArgs;
use megatron_data::tokenizer::{build_tokenizer, Tokenizer};
use megatron_inference::{at_least_one, CheckpointModelArgs};
use megatron_inference::{BatchLimits, DecodeSettings, KvBudget, DEFAULT_PREFILL_CHUNK};
use megatron_parallel::ParallelState;
use megatron_serving::chat::ChatTemplate;
use megatron_serving::{
    GenerationServer, ServerOptions, ServingSettings, TextGenerationService,
    DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUED, DEFAULT_MAX_TOKENS,
};

/// Serve a GPT checkpoint over HTTP: `curl -X PUT localhost:5000/api -H 'Content-Type:
/// application/json' -d '{"prompts": ["Hello"], "tokens_to_generate": 16}'`.
///
/// The architecture comes from the checkpoint; give the tokenizer flags it was trained with.
/// Megatron's model flags (`run_text_generation_server_345M.sh`) are accepted and checked
/// against the checkpoint.
/// Also OpenAI's `POST /v1/completions`, `POST /v1/chat/completions` and `GET /v1/models`,
/// Prometheus metrics at `GET /metrics` and `GET /health`.
/// Requests are batched continuously: a request joins the running batch at the next step and
/// leaves when it ends; the KV cache is kept within --kv-cache-gb, requests that do not fit yet
/// wait in a queue (--max-queued), more are answered 503 with Retry-After. SIGTERM or Ctrl-C
/// stops after the requests in flight; requests arriving meanwhile are answered 503.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    model: CheckpointModelArgs,
    #[command(flatten, next_help_heading = "Tokenizer")]
    tokenizer: TokenizerArgs,
    /// Address to listen on; 0.0.0.0 serves other machines too.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 5000)]
    port: u16,
    /// Largest prompts × (longest prompt + tokens_to_generate) a request may ask for.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS)]
    max_tokens_to_oom: usize,
    /// Requests that may wait for room in the batch (or, while the model loads, for the
    /// model); more are answered 503 with Retry-After.
    #[arg(long, default_value_t = DEFAULT_MAX_QUEUED, value_parser = at_least_one)]
    max_queued: usize,
    /// Sequences decoded together at most (1: one request at a time; a request with more
    /// prompts runs alone). Megatron-core's name for it is accepted too.
    #[arg(long, visible_alias = "inference-max-requests", default_value_t = DEFAULT_MAX_BATCH_SIZE, value_parser = at_least_one)]
    max_batch_size: usize,
    /// Memory the KV cache may take, in GiB [default: half the GPU memory free after loading
    /// the model; 2 GiB on a CPU]. A request whose whole length cannot fit is refused.
    /// Megatron-core's dynamic-batching name for it is accepted too.
    #[arg(long, visible_alias = "inference-dynamic-batching-buffer-size-gb")]
    kv_cache_gb: Option<f64>,
    /// Prompt tokens prefilled per step: a long prompt is processed in chunks between decode
    /// steps, so running requests keep streaming.
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK, value_parser = at_least_one)]
    prefill_chunk_size: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_request_bytes: usize,
    /// Threads that serve the HTTP connections. Each serves many connections (a waiting
    /// connection costs no thread); the number of connections is --max-connections.
    #[arg(long, default_value_t = 2, value_parser = at_least_one)]
    http_threads: usize,
    /// Connections open at once; more are answered 503 with Retry-After and closed. Lowered
    /// to what the open-file limit (ulimit -n) allows.
    #[arg(long, default_value_t = 10_000, value_parser = at_least_one)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers; also the longest a kept-alive
    /// connection may stay idle.
    #[arg(long, default_value_t = 30.0)]
    http_header_timeout: f64,
    /// Seconds a client has to send a request's body; slower ones are answered 408.
    #[arg(long, default_value_t = 60.0)]
    http_body_timeout: f64,
    /// Seconds an answer may wait for its client to read it; a client that reads nothing for
    /// that long is disconnected (and its generation stopped).
    #[arg(long, default_value_t = 60.0)]
    http_write_timeout: f64,
    /// The model's id in GET /v1/models (default: the name of the checkpoint directory).
    #[arg(long)]
    served_model_name: Option<String>,
    /// The chat template for /v1/chat/completions: a Jinja file, or a tokenizer_config.json
    /// with a chat_template. By default the chat_template of the tokenizer_config.json next to
    /// --tokenizer-model or in the checkpoint directory, else the plain template
    /// ("Role: content" per message, then "Assistant:").
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Launch every decode step kernel by kernel. By default, on a GPU, each step is replayed
    /// from a CUDA graph captured the first time its batch size and length window occur
    /// (same tokens, several times faster at small batches).
    #[arg(long)]
    no_cuda_graphs: bool,
    /// Decode attention gathers each row's window of KV-cache slots and runs libtorch's
    /// attention under a mask, instead of the paged decode kernel (compiled at start with
    /// NVRTC) that reads the cache blocks in place. For comparing the two; CPUs always gather.
    #[arg(long)]
    no_paged_attention: bool,
    /// Run decode steps of few rows (up to 8) through libtorch's linear layers, with the norms,
    /// bias adds, GeLU and residual adds as kernels of their own, instead of the fused decode
    /// kernels (compiled at start with NVRTC: each linear layer with the norm before it and the
    /// bias, GeLU or residual after it as one kernel reading its weight once). For comparing
    /// the two; CPUs never fuse.
    #[arg(long)]
    no_decode_fusion: bool,
    /// Read each decode step's tokens before queuing the next step, instead of queuing the
    /// next step first whenever it runs the same rows one position on (its tokens read on the
    /// GPU where the last step drew them), so that the host's reading, streaming and launching
    /// overlap the GPU's work. For comparing the two.
    #[arg(long)]
    no_decode_overlap: bool,
    /// The longest prompt + generation a request may have (Megatron's bound on its static KV
    /// cache); longer requests are refused [default: the model's positions].
    #[arg(long, help_heading = "Megatron's server script", value_parser = at_least_one)]
    inference_max_seq_length: Option<usize>,
    /// Accepted: CUDA graphs are on by default here (--no-cuda-graphs turns them off).
    #[arg(
        long,
        help_heading = "Megatron's server script",
        conflicts_with = "no_cuda_graphs"
    )]
    enable_cuda_graph: bool,
    /// Accepted: decode attention runs through the paged decode kernel by default here
    /// (--no-paged-attention turns it off).
    #[arg(
        long,
        help_heading = "Megatron's server script",
        conflicts_with = "no_paged_attention"
    )]
    flash_decode: bool,
    /// Accepted: a --load without a checkpoint is always an error here.
    #[arg(long, help_heading = "Megatron's server script")]
    exit_on_missing_checkpoint: bool,
    /// Accepted and ignored, as Megatron's server ignores it (each request sets its own
    /// temperature) [Megatron's default: 1.0].
    #[arg(long, help_heading = "Megatron's server script")]
    temperature: Option<f64>,
    /// Accepted and ignored, as Megatron's server ignores it (each request sets its own
    /// top_k) [Megatron's default: 1].
    #[arg(long = "top_k", help_heading = "Megatron's server script")]
    top_k: Option<i64>,
    /// Accepted and ignored, as Megatron's server ignores it (each request sets its own
    /// top_p) [Megatron's default: 0.0].
    #[arg(long = "top_p", help_heading = "Megatron's server script")]
    top_p: Option<f64>,
    /// Accepted and ignored, as Megatron's server ignores it (each request asks for logprobs).
    #[arg(long, help_heading = "Megatron's server script")]
    return_log_probs: bool,
    /// Accepted and ignored, as Megatron's server ignores it (each request sets
    /// tokens_to_generate) [Megatron's default: 30].
    #[arg(long, help_heading = "Megatron's server script")]
    num_tokens_to_generate: Option<usize>,
    /// Accepted and ignored, as Megatron's server ignores them (prompts come in requests).
    #[arg(long, num_args = 1.., help_heading = "Megatron's server script")]
    prompts: Vec<String>,
}

impl Cli {
    /// One line per given flag of Megatron's server script that changes nothing here.
    fn script_flag_notes(&self) -> Vec<String> {
        let request_field = |flag: &str, field: &str| {
            format!(
                "note: {flag} is not used by Megatron's server either (each request sets \
                 {field}); ignored"
            )
        };
        let mut notes = Vec::new();
        if self.enable_cuda_graph {
            notes.push("note: --enable-cuda-graph: CUDA graphs are on by default".to_string());
        }
        if self.flash_decode {
            notes.push(
                "note: --flash-decode: decoding reads the paged KV cache in place by default"
                    .to_string(),
            );
        }
        if self.exit_on_missing_checkpoint {
            notes.push(
                "note: --exit-on-missing-checkpoint: a missing checkpoint is always an error"
                    .to_string(),
            );
        }
        let given = [
            ("--temperature", self.temperature.is_some(), "temperature"),
            ("--top_k", self.top_k.is_some(), "top_k"),
            ("--top_p", self.top_p.is_some(), "top_p"),
            ("--return-log-probs", self.return_log_probs, "logprobs"),
            (
                "--num-tokens-to-generate",
                self.num_tokens_to_generate.is_some(),
                "tokens_to_generate",
            ),
            ("--prompts", !self.prompts.is_empty(), "prompts"),
        ];
        notes.extend(
            given
                .iter()
                .filter(|(_, on, _)| *on)
                .map(|(flag, _, field)| request_field(flag, field)),
        );
        notes
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| {
        install_exit_handler();
        // Refuse wrong flags before binding the port and joining the other ranks.
        cli.model.checked_config()?;
        cli.model.print_ignored_flag_notes("text_generation_server");
        for note in cli.script_flag_notes() {
            eprintln!("{note}");
        }
        let (job, parallel, device) = cli.model.join_job()?;
        let rank = job.env.rank;
        megatron_kernels::rng::manual_seed(device, cli.model.seed)?;
        tch::manual_seed(cli.model.seed as i64);
        let tokenizer: Arc<dyn Tokenizer> = Arc::from(build_tokenizer(&cli.tokenizer.config()?)?);
        let settings = serving_settings(&cli)?;
        let build = |parallel: &ParallelState,
                     tokenizer: Arc<dyn Tokenizer>|
         -> anyhow::Result<TextGenerationService> {
            let model = cli.model.load_model_for(&*tokenizer, device, parallel)?;
            Ok(TextGenerationService::new(model, tokenizer, settings)?
                .with_tensor_parallel(parallel.tensor.clone()))
        };
        if rank != 0 {
            build(&parallel, tokenizer)?.follow()?;
            // Tearing down an NCCL communicator waits for every rank's teardown; rank 0 tears
            // its down before it reaches the final rendezvous, so this rank must too.
            drop(parallel);
            return job.finish();
        }
        // An imported HuggingFace or Megatron model is named, and finds its chat template, by
        // its own directory rather than the converted copy's.
        let source = cli.model.given_checkpoint()?.to_path_buf();
        let chat = chat_template(&cli, &source)?;
        let options = ServerOptions {
            host: cli.host.clone(),
            port: cli.port,
            max_queued: cli.max_queued,
            max_body_bytes: cli.max_request_bytes,
            http_threads: cli.http_threads,
            max_connections: cli.max_connections,
            header_timeout: seconds("--http-header-timeout", cli.http_header_timeout)?,
            body_timeout: seconds("--http-body-timeout", cli.http_body_timeout)?,
            write_timeout: seconds("--http-write-timeout", cli.http_write_timeout)?,
            model_name: cli.served_model_name.clone().unwrap_or_else(|| {
                source.file_name().map_or_else(
                    || "megatron-rs".into(),
                    |n| n.to_string_lossy().into_owned(),
                )
            }),
        };
        let chat_origin = chat.origin.clone();
        let server = GenerationServer::bind(options)?.with_chat_template(chat);
        let address = server
            .address()
            .map_or_else(|| format!("{}:{}", cli.host, cli.port), |a| a.to_string());
        let (load, tp) = (
            source.display().to_string(),
            cli.model.tensor_model_parallel_size,
        );
        println!("text_generation_server: chat template: {chat_origin}");
        let serving = format!(
            "text_generation_server: serving {load} on http://{address}/api ({device:?}, TP={tp})"
        );
        // The generation thread makes the KV cache and captures the decode graphs before it
        // takes the first request.
        server.run(
            move || build(&parallel, tokenizer),
            &serving,
            exit_requested,
        )?;
        job.finish()?;
        println!("text_generation_server: stopped");
        Ok(())
    })
}

/// How the service batches and decodes, from the flags.
fn serving_settings(cli: &Cli) -> anyhow::Result<ServingSettings> {
    let kv_budget = match cli.kv_cache_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => KvBudget::Gib(gb),
        Some(gb) => {
            megatron_cli::bail_usage!("--kv-cache-gb must be a positive number of GiB, got {gb}")
        }
        None => KvBudget::default(),
    };
    Ok(ServingSettings {
        limits: BatchLimits {
            max_batch_size: cli.max_batch_size,
            prefill_chunk: cli.prefill_chunk_size,
            max_queued: cli.max_queued,
        },
        decode: DecodeSettings {
            cuda_graphs: !cli.no_cuda_graphs,
            paged_attention: !cli.no_paged_attention,
            fused_kernels: !cli.no_decode_fusion,
            overlap: !cli.no_decode_overlap,
            kv_budget,
            // A server must hold one whole sequence of --seq-length; without it, one block.
            min_sequence: cli
                .model
                .seq_length
                .map_or(DecodeSettings::default().min_sequence, |s| s as i64),
        },
        max_tokens: cli.max_tokens_to_oom,
        max_sequence: cli.inference_max_seq_length,
    })
}

fn seconds(flag: &str, value: f64) -> anyhow::Result<Duration> {
    anyhow::ensure!(
        value.is_finite() && value > 0.0,
        "{flag} must be a positive number of seconds, not {value}"
    );
    Ok(Duration::from_secs_f64(value))
}

/// `--chat-template`, else the first `tokenizer_config.json` with a `chat_template` beside the
/// tokenizer or in the checkpoint, else the plain template.
fn chat_template(cli: &Cli, checkpoint: &std::path::Path) -> anyhow::Result<ChatTemplate> {
    let mut directories = Vec::new();
    if let Some(model) = &cli.tokenizer.tokenizer_model {
        directories.push(if model.is_dir() {
            model.clone()
        } else {
            model.parent().map(PathBuf::from).unwrap_or_default()
        });
    }
    directories.push(checkpoint.to_path_buf());
    ChatTemplate::load(cli.chat_template.as_deref(), &directories)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Megatron's server-script flags that change nothing here each get a line saying so;
    /// --inference-max-seq-length bounds requests.
    #[test]
    fn megatrons_script_flags_are_noted_or_honoured() {
        let cli = Cli::try_parse_from([
            "text_generation_server",
            "--load",
            "ckpt",
            "--temperature",
            "0.5",
            "--top_k",
            "1",
            "--return-log-probs",
            "--prompts",
            "a",
            "b",
            "--enable-cuda-graph",
            "--exit-on-missing-checkpoint",
            "--inference-max-seq-length",
            "48",
        ])
        .unwrap();
        let notes = cli.script_flag_notes();
        assert_eq!(notes.len(), 6, "{notes:?}");
        for flag in [
            "--temperature",
            "--top_k",
            "--return-log-probs",
            "--prompts",
            "--enable-cuda-graph",
            "--exit-on-missing-checkpoint",
        ] {
            assert!(notes.iter().any(|n| n.contains(flag)), "{flag}: {notes:?}");
        }
        assert_eq!(serving_settings(&cli).unwrap().max_sequence, Some(48));
        let quiet = Cli::try_parse_from(["text_generation_server", "--load", "ckpt"]).unwrap();
        assert!(quiet.script_flag_notes().is_empty());
    }
}
