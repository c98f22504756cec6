//! `generate_samples_gpt`: continue prompts with a trained GPT (Megatron's
//! `tools/generate_samples_gpt.py`). The architecture comes from the checkpoint metadata; only
//! the tokenizer flags are needed (Megatron's model flags are accepted and checked against it).

use std::io::{BufRead, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use megatron_data::flags::TokenizerArgs;
use megatron_data::tokenizer::build_tokenizer;
use megatron_inference::CheckpointModelArgs;
use megatron_inference::{
    generate_tokens, DecodeSettings, Decoder, GenerationRequest, LogitAdjust, Sampling,
    StopCondition,
};
use megatron_kernels::runtime::resolve_device;
use megatron_parallel::ParallelState;

/// Continue prompts with a GPT checkpoint: `--prompt` texts, or one prompt per line of
/// `--sample-input-file`; each continuation is printed (or written to `--sample-output-file`
/// as JSON lines).
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    #[command(flatten)]
    model: CheckpointModelArgs,
    #[command(flatten, next_help_heading = "Tokenizer")]
    tokenizer: TokenizerArgs,
    /// A prompt; repeat for several.
    #[arg(long, required_unless_present = "sample_input_file")]
    prompt: Vec<String>,
    /// A file with one prompt per line.
    #[arg(long)]
    sample_input_file: Option<PathBuf>,
    /// Write {"prompt", "text"} JSON lines here instead of printing.
    #[arg(long)]
    sample_output_file: Option<PathBuf>,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 64)]
    out_seq_length: usize,
    /// Always take the most likely token.
    #[arg(long)]
    greedy: bool,
    /// Sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Sample among the k most likely tokens (0: off).
    #[arg(long = "top_k", alias = "top-k", default_value_t = 0)]
    top_k: i64,
    /// Sample among the most likely tokens reaching probability p (0: off).
    #[arg(long = "top_p", alias = "top-p", default_value_t = 0.0)]
    top_p: f64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| run(&cli))
}

fn run(cli: &Cli) -> Result<()> {
    let mut prompts = cli.prompt.clone();
    if let Some(path) = &cli.sample_input_file {
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        for line in std::io::BufReader::new(file).lines() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            if !line.trim().is_empty() {
                prompts.push(line);
            }
        }
    }
    if prompts.is_empty() {
        bail!(
            "{} holds no prompt (every line is blank)",
            cli.sample_input_file
                .as_ref()
                .expect("clap requires --prompt or --sample-input-file")
                .display()
        );
    }
    cli.model.print_ignored_flag_notes("generate_samples_gpt");
    cli.model.validate_run_time(1)?;
    let device = resolve_device(&cli.model.device, 0)?;
    let tokenizer = build_tokenizer(&cli.tokenizer.config()?)?;
    let model = cli
        .model
        .load_model_for(&*tokenizer, device, &ParallelState::single())?;
    let sampling = if cli.greedy {
        Sampling::greedy()
    } else {
        Sampling {
            temperature: cli.temperature,
            top_k: cli.top_k,
            top_p: cli.top_p,
            top_p_decay: 0.0,
            top_p_bound: 0.0,
        }
    };
    sampling.validate()?;
    tch::manual_seed(cli.model.seed as i64);
    let eod = tokenizer.eod().map(i64::from);
    let stop = eod.map_or(StopCondition::Never, StopCondition::Token);
    let window = (model.config.max_position_embeddings as usize).saturating_sub(cli.out_seq_length);
    if window == 0 {
        bail!(
            "--out-seq-length {} leaves no room for a prompt within the model's {} positions",
            cli.out_seq_length,
            model.config.max_position_embeddings
        );
    }
    let mut output: Box<dyn Write> = match &cli.sample_output_file {
        Some(path) => Box::new(BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut generated = 0;
    let mut decoder = Decoder::new(DecodeSettings::default());
    for prompt in &prompts {
        let ids: Vec<i64> = tokenizer
            .tokenize(prompt)?
            .into_iter()
            .map(i64::from)
            .collect();
        // The model sees at most its positions: keep the end of a long prompt.
        let ids = ids[ids.len().saturating_sub(window)..].to_vec();
        if ids.is_empty() {
            bail!("prompt {prompt:?} has no tokens");
        }
        let request = GenerationRequest {
            prompts: vec![ids.clone()],
            tokens_to_generate: cli.out_seq_length,
            sampling,
            stop,
            prevent_newline_after_colon: None,
            logprobs: false,
            top_logprobs: 0,
            pad: eod.unwrap_or(0),
            adjust: LogitAdjust::default(),
        };
        let tokens = generate_tokens(&model, &request, &mut decoder)?
            .tokens
            .remove(0);
        let continuation: Vec<u32> = tokens[ids.len()..]
            .iter()
            .filter(|&&t| Some(t) != eod)
            .map(|&t| t as u32)
            .collect();
        generated += continuation.len();
        let text = tokenizer.detokenize(&continuation)?;
        if cli.sample_output_file.is_some() {
            writeln!(
                output,
                "{}",
                serde_json::json!({"prompt": prompt, "text": text})
            )?;
        } else {
            writeln!(output, "{prompt}{text}\n")?;
        }
    }
    output.flush()?;
    eprintln!(
        "generate_samples_gpt: {} prompts, {generated} tokens generated",
        prompts.len()
    );
    Ok(())
}
