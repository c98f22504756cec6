//! `text_generation_server`: Megatron's `tools/run_text_generation_server.py` — `PUT /api`
//! with Megatron's request fields, defaults, messages and response.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use megatron_core::args::TokenizerArgs;
use megatron_core::inference::{
    load_gpt_for_inference, GenerationServer, ServerOptions, TextGenerationService,
    DEFAULT_MAX_TOKENS,
};
use megatron_core::parallel::{Backend, Job, LaunchEnv, ParallelLayout, ParallelState};
use megatron_core::signals::{exit_requested, install_exit_handler};
use megatron_core::training::resolve_device;
use megatron_data::tokenizer::{build_tokenizer, Tokenizer};
use tch::Kind;

/// Serve a GPT checkpoint over HTTP: `curl -X PUT localhost:5000/api -H 'Content-Type:
/// application/json' -d '{"prompts": ["Hello"], "tokens_to_generate": 16}'`.
///
/// The architecture comes from the checkpoint; give the tokenizer flags it was trained with.
/// Requests are served one at a time by the model, the others wait in a queue (--max-queued);
/// SIGTERM or Ctrl-C stops after the requests in flight.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    /// Checkpoint directory (the iteration its tracker names is used; any TP/PP layout).
    #[arg(long)]
    load: std::path::PathBuf,
    /// Do not verify the checkpoint's per-file checksums (recorded in its metadata.json).
    #[arg(long)]
    no_checkpoint_checksums: bool,
    #[command(flatten)]
    tokenizer: TokenizerArgs,
    /// Address to listen on; 0.0.0.0 serves other machines too.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one and prints it).
    #[arg(long, default_value_t = 5000)]
    port: u16,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Run the model in bfloat16 (GPUs).
    #[arg(long)]
    bf16: bool,
    /// Largest prompts × (longest prompt + tokens_to_generate) a request may ask for.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS)]
    max_tokens_to_oom: usize,
    /// Requests that may wait for the model; more are answered 503.
    #[arg(long, default_value_t = 256)]
    max_queued: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    max_request_bytes: usize,
    /// Connections handled at once.
    #[arg(long, default_value_t = 64)]
    http_threads: usize,
    /// Split the model over this many GPUs, one process each (launched by torchrun or srun);
    /// rank 0 serves HTTP and the others follow its requests.
    #[arg(long, default_value_t = 1)]
    tensor_model_parallel_size: usize,
    /// Minutes ranks wait for each other at start-up.
    #[arg(long, default_value_t = 10.0)]
    distributed_timeout_minutes: f64,
    /// Launch every decode step kernel by kernel. By default, on a GPU, each step is replayed
    /// from a CUDA graph captured the first time its batch size and length window occur
    /// (same tokens, several times faster at small batches).
    #[arg(long)]
    no_cuda_graphs: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| {
        megatron_core::checkpoint::set_checksums_enabled(!cli.no_checkpoint_checksums);
        install_exit_handler();
        let env = LaunchEnv::from_env()?;
        anyhow::ensure!(
            env.world_size == cli.tensor_model_parallel_size,
            "{} processes were launched for --tensor-model-parallel-size {}; serving needs one process per tensor-parallel rank",
            env.world_size,
            cli.tensor_model_parallel_size
        );
        let device = resolve_device(&cli.device, env.local_rank)?;
        let backend = if device.is_cuda() {
            Backend::Nccl
        } else {
            Backend::Gloo
        };
        let job = Job::join(
            env.clone(),
            Duration::from_secs_f64(cli.distributed_timeout_minutes * 60.0),
        )?;
        let layout = ParallelLayout::new(env.world_size, cli.tensor_model_parallel_size, 1)?;
        let parallel = job.parallel_state(layout, false, backend, device)?;
        let tokenizer: Arc<dyn Tokenizer> = Arc::from(build_tokenizer(&cli.tokenizer.config()?)?);
        let dtype = if cli.bf16 {
            Kind::BFloat16
        } else {
            Kind::Float
        };
        let (max_tokens, no_cuda_graphs) = (cli.max_tokens_to_oom, cli.no_cuda_graphs);
        let build = |parallel: &ParallelState,
                     tokenizer: Arc<dyn Tokenizer>|
         -> anyhow::Result<TextGenerationService> {
            let model = load_gpt_for_inference(&cli.load, device, dtype, parallel)?;
            anyhow::ensure!(
                tokenizer.vocab_size() as i64 == model.config.vocab_size,
                "the tokenizer has {} tokens but the checkpoint was trained with {}",
                tokenizer.vocab_size(),
                model.config.vocab_size
            );
            let service = TextGenerationService::new(model, tokenizer, max_tokens)?
                .with_tensor_parallel(parallel.tensor.clone());
            Ok(if no_cuda_graphs {
                service.without_cuda_graphs()
            } else {
                service
            })
        };
        if env.rank != 0 {
            build(&parallel, tokenizer)?.follow()?;
            // Tearing down an NCCL communicator waits for every rank's teardown; rank 0 tears
            // its down before it reaches the final rendezvous, so this rank must too.
            drop(parallel);
            return job.finish();
        }
        let options = ServerOptions {
            host: cli.host.clone(),
            port: cli.port,
            max_queued: cli.max_queued,
            max_body_bytes: cli.max_request_bytes,
            http_threads: cli.http_threads,
        };
        let server = GenerationServer::bind(options)?;
        let address = server
            .address()
            .map_or_else(|| format!("{}:{}", cli.host, cli.port), |a| a.to_string());
        let (load, tp) = (
            cli.load.display().to_string(),
            cli.tensor_model_parallel_size,
        );
        let service = move || {
            let service = build(&parallel, tokenizer)?;
            println!("text_generation_server: serving {load} on http://{address}/api ({device:?}, TP={tp})");
            Ok(service)
        };
        server.run(service, exit_requested)?;
        job.finish()?;
        println!("text_generation_server: stopped");
        Ok(())
    })
}
