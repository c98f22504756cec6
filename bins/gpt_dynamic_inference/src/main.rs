//! `gpt_dynamic_inference`: Megatron's `examples/inference/gpt/gpt_dynamic_inference.py`.
//! Requests arrive over simulated time (or all at once), join the running batch as they come
//! (continuous batching over the paged KV cache, the engine `text_generation_server` serves
//! with), and the run prints its setup, each unique prompt with its output, and the total time
//! and throughput, in Megatron's format; `--output-path` writes every request as JSON.

mod report;
mod requests;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser};
use megatron_cli::bail_usage;
use megatron_data::flags::TokenizerArgs;
use megatron_data::tokenizer::build_tokenizer;
use megatron_inference::{
    row_seed, BatchLimits, Batcher, CheckpointModelArgs, DecodeSettings, Decoder,
    GenerationRequest, KvBudget, LogitAdjust, Refusal, Sampling, StopCondition,
    DEFAULT_PREFILL_CHUNK,
};
use megatron_kernels::runtime::{cuda_memory_stats, resolve_device};
use megatron_models::GptModel;
use megatron_parallel::ParallelState;

use report::{Finished, Report};
use requests::{Request, RequestArgs};

/// Serve simulated (or given) requests arriving over time by continuous batching, as Megatron's
/// gpt_dynamic_inference.py does, and report the outputs and the throughput.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    model: CheckpointModelArgs,
    #[command(flatten, next_help_heading = "Tokenizer")]
    tokenizer: TokenizerArgs,
    #[command(flatten, next_help_heading = "Requests")]
    requests: RequestArgs,
    #[command(flatten, next_help_heading = "Sampling")]
    sampling: SamplingArgs,
    #[command(flatten, next_help_heading = "Dynamic batching")]
    engine: EngineArgs,
    /// Write every request (prompt, generated text and tokens, latency, log-probabilities with
    /// --return-log-probs) as JSON here, keyed by request id.
    #[arg(long)]
    output_path: Option<PathBuf>,
    /// gpt (the only model family here; Megatron's example also builds Mamba models).
    #[arg(long, default_value = "gpt", value_parser = ["gpt", "mamba"])]
    model_provider: String,
}

#[derive(Args)]
struct SamplingArgs {
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Sample among the k most likely tokens (1, the default, is greedy).
    #[arg(long = "top_k", alias = "top-k", default_value_t = 1)]
    top_k: i64,
    /// Sample among the most likely tokens reaching probability p (0: off).
    #[arg(long = "top_p", alias = "top-p", default_value_t = 0.0)]
    top_p: f64,
    /// Keep the log-probability of every prompt and generated token (written to --output-path).
    #[arg(long)]
    return_log_probs: bool,
    /// The n most likely tokens at each position with their log-probabilities; not supported
    /// here (0 only).
    #[arg(long, default_value_t = 0)]
    top_n_logprobs: usize,
    /// Tokens to generate for each prompt (fewer when the end-of-document token comes first).
    #[arg(long, default_value_t = 30)]
    num_tokens_to_generate: usize,
}

/// Megatron-core's dynamic-batching flags. Here the KV cache is paged in blocks and a request is
/// admitted only when blocks for its whole length are free, so every running request finishes:
/// nothing needs reserving or overcommitting.
#[derive(Args)]
struct EngineArgs {
    /// Memory the KV cache may take, in GiB [default: half the GPU memory free after loading
    /// the model; 2 GiB on a CPU].
    #[arg(long)]
    inference_dynamic_batching_buffer_size_gb: Option<f64>,
    /// Requests decoded together at most [default: 64].
    #[arg(long)]
    inference_dynamic_batching_max_requests_override: Option<usize>,
    /// Prompt tokens prefilled per step [default: 512].
    #[arg(long)]
    inference_dynamic_batching_max_tokens_override: Option<usize>,
    /// Replay decode steps from CUDA graphs on a GPU (captured per batch size and length
    /// window as they occur).
    #[arg(long)]
    enable_cuda_graph: bool,
    /// Accepted (this tool always batches dynamically).
    #[arg(long)]
    inference_dynamic_batching: bool,
    /// Accepted and ignored: KV blocks are of 16 positions.
    #[arg(long)]
    inference_dynamic_batching_chunk_size: Option<usize>,
    /// Accepted and ignored: admission never overcommits the KV cache.
    #[arg(long)]
    inference_dynamic_batching_buffer_overflow_factor: Option<f64>,
    /// Accepted and ignored: every admitted request is guaranteed its whole length.
    #[arg(long)]
    inference_dynamic_batching_buffer_guaranteed_fraction: Option<f64>,
    /// Accepted and ignored: graphs are captured for the batch sizes that occur.
    #[arg(long)]
    inference_dynamic_batching_num_cuda_graphs: Option<usize>,
    /// Accepted (a missing checkpoint is always an error here).
    #[arg(long)]
    exit_on_missing_checkpoint: bool,
    /// Accepted and ignored: each request draws from its own random stream, seeded from
    /// --seed and its index.
    #[arg(long)]
    inference_rng_tracker: bool,
    /// Accepted and ignored: checkpoints load strictly (every tensor present).
    #[arg(long)]
    inference_ckpt_non_strict: bool,
}

const DEFAULT_MAX_REQUESTS: usize = 64;

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| run(&cli))
}

fn run(cli: &Cli) -> Result<()> {
    if cli.model_provider == "mamba" {
        bail_usage!("--model-provider mamba: only GPT models are served here");
    }
    if cli.sampling.top_n_logprobs > 0 {
        bail_usage!(
            "--top-n-logprobs {}: the top tokens' log-probabilities are not reported here; use \
             --return-log-probs for the chosen tokens'",
            cli.sampling.top_n_logprobs
        );
    }
    let requests = cli.requests.requests(cli.model.seed as i64)?;
    cli.model.print_ignored_flag_notes("gpt_dynamic_inference");
    cli.model.validate_run_time(1)?;
    let device = resolve_device(&cli.model.device, 0)?;
    let tokenizer = build_tokenizer(&cli.tokenizer.config()?)?;
    let model = cli
        .model
        .load_model_for(&*tokenizer, device, &ParallelState::single())?;
    let sampling = Sampling {
        temperature: cli.sampling.temperature,
        top_k: cli.sampling.top_k,
        top_p: cli.sampling.top_p,
        top_p_decay: 0.0,
        top_p_bound: 0.0,
    };
    sampling.validate()?;
    let eod = tokenizer.eod().map(i64::from);
    let prompts = requests
        .iter()
        .enumerate()
        .map(|(i, request)| {
            let ids: Vec<i64> = tokenizer
                .tokenize(&request.prompt)?
                .into_iter()
                .map(i64::from)
                .collect();
            if ids.is_empty() {
                bail!("request {i}: the prompt {:?} has no tokens", request.prompt);
            }
            Ok(ids)
        })
        .collect::<Result<Vec<_>>>()?;

    let limits = BatchLimits {
        max_batch_size: positive(
            "--inference-dynamic-batching-max-requests-override",
            cli.engine.inference_dynamic_batching_max_requests_override,
            DEFAULT_MAX_REQUESTS,
        )?,
        prefill_chunk: positive(
            "--inference-dynamic-batching-max-tokens-override",
            cli.engine.inference_dynamic_batching_max_tokens_override,
            DEFAULT_PREFILL_CHUNK,
        )?,
        max_queued: requests.len(),
    };
    let kv_budget = match cli.engine.inference_dynamic_batching_buffer_size_gb {
        Some(gb) if gb.is_finite() && gb > 0.0 => {
            KvBudget::Bytes((gb * (1u64 << 30) as f64) as u64)
        }
        Some(gb) => bail_usage!(
            "--inference-dynamic-batching-buffer-size-gb must be a positive number of GiB, got {gb}"
        ),
        None => KvBudget::default(),
    };
    let mut decoder = Decoder::new(DecodeSettings {
        cuda_graphs: cli.engine.enable_cuda_graph,
        kv_budget,
        ..DecodeSettings::default()
    });
    let mut report = Report::new(cli, &model, &requests);
    tch::manual_seed(cli.model.seed as i64);
    let run = Serve {
        requests: &requests,
        prompts: &prompts,
        sampling,
        stop: eod.map_or(StopCondition::Never, StopCondition::Token),
        pad: eod.unwrap_or(0),
        tokens_to_generate: cli.sampling.num_tokens_to_generate,
        logprobs: cli.sampling.return_log_probs,
        seed: cli.model.seed,
    };
    report.print_setup(limits, &mut decoder, &model)?;
    let (finished, elapsed) = run.serve(&model, &mut decoder, limits)?;
    let memory = match device {
        tch::Device::Cuda(index) => Some(cuda_memory_stats(index)?),
        _ => None,
    };
    report.print_results(
        &finished,
        elapsed,
        &*tokenizer,
        cli.output_path.as_deref(),
        memory,
    )
}

/// `value` or `default`, which must be at least 1.
fn positive(flag: &str, value: Option<usize>, default: usize) -> Result<usize> {
    match value {
        Some(0) => bail_usage!("{flag} must be at least 1"),
        Some(value) => Ok(value),
        None => Ok(default),
    }
}

/// One run: every request submitted at its arrival time, the batch stepped until all finish.
struct Serve<'a> {
    requests: &'a [Request],
    prompts: &'a [Vec<i64>],
    sampling: Sampling,
    stop: StopCondition,
    pad: i64,
    tokens_to_generate: usize,
    logprobs: bool,
    seed: u64,
}

impl Serve<'_> {
    fn serve(
        &self,
        model: &GptModel,
        decoder: &mut Decoder,
        limits: BatchLimits,
    ) -> Result<(Vec<Finished>, Duration)> {
        let mut batcher = Batcher::new(limits);
        let bar = megatron_cli::progress_bar(self.requests.len() as u64, "requests");
        let mut started: HashMap<u64, Instant> = HashMap::new();
        let mut finished: Vec<Option<Finished>> = vec![None; self.requests.len()];
        let mut next = 0;
        let start = Instant::now();
        loop {
            // Requests whose arrival has come join, in order, while the batch takes them.
            while next < self.requests.len()
                && start + seconds(self.requests[next].arrival) <= Instant::now()
            {
                let rows = GenerationRequest {
                    prompts: vec![self.prompts[next].clone()],
                    tokens_to_generate: self.tokens_to_generate,
                    sampling: self.sampling,
                    stop: self.stop,
                    prevent_newline_after_colon: None,
                    logprobs: self.logprobs,
                    top_logprobs: 0,
                    pad: self.pad,
                    adjust: LogitAdjust::default(),
                }
                .rows(row_seed(self.seed, next))?;
                match batcher.submit(model, decoder, next as u64, rows) {
                    Ok(()) => {}
                    Err(Refusal::Busy(_)) => break,
                    Err(Refusal::TooLarge(why)) => bail!("request {next}: {why}"),
                    Err(Refusal::Failed(error)) => return Err(error),
                }
                started.insert(next as u64, Instant::now());
                next += 1;
            }
            if batcher.is_idle() {
                if next == self.requests.len() {
                    break;
                }
                let arrival = start + seconds(self.requests[next].arrival);
                std::thread::sleep(arrival.saturating_duration_since(Instant::now()));
                continue;
            }
            for (id, generation) in batcher.step(model, decoder, &mut |_| false)? {
                let index = id as usize;
                let prompt_length = self.prompts[index].len();
                finished[index] = Some(Finished {
                    tokens: generation.tokens[0][prompt_length..].to_vec(),
                    logprobs: generation.logprobs.map(|mut rows| rows.remove(0)),
                    latency: started[&id].elapsed(),
                });
                bar.inc(1);
            }
        }
        bar.finish_and_clear();
        let elapsed = start.elapsed();
        let finished = finished
            .into_iter()
            .enumerate()
            .map(|(i, f)| f.with_context(|| format!("request {i} never finished")))
            .collect::<Result<Vec<_>>>()?;
        Ok((finished, elapsed))
    }
}

fn seconds(value: f64) -> Duration {
    Duration::from_secs_f64(value.max(0.0))
}
