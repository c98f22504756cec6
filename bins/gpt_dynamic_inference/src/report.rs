//! What `gpt_dynamic_inference` prints, in the format of Megatron's example: the setup line,
//! each unique prompt with the hash and text of its output, and the time and throughput; and
//! the JSON of every request for `--output-path`.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use megatron_cli::python_format::{format_exp_upper, format_fixed};
use megatron_data::tokenizer::Tokenizer;
use megatron_inference::{BatchLimits, CausalLm, Decoder};
use megatron_kernels::runtime::CudaMemoryStats;
use megatron_models::layers::BLOCK_SIZE;
use megatron_models::GptModel;
use sha2::{Digest, Sha256};

use crate::requests::Request;
use crate::Cli;

const GIB: f64 = (1u64 << 30) as f64;

/// A request's output.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The generated tokens (the end-of-document token included when it ended the request).
    pub tokens: Vec<i64>,
    /// With --return-log-probs, the log-probability of each token after the prompt's first.
    pub logprobs: Option<Vec<f32>>,
    pub latency: Duration,
}

pub struct Report {
    /// The setup's parts up to the prompts (the buffer parts come from the KV cache).
    head: Vec<String>,
    prompts: Vec<String>,
    /// The whole setup line, once the cache is known.
    setup: String,
}

/// Megatron's `get_model_size_str`: the parameter count in whole thousands, millions, ...
fn model_size(parameters: i64) -> String {
    for (exponent, suffix) in [(12, "t"), (9, "b"), (6, "m"), (3, "k"), (0, "")] {
        let unit = 10i64.pow(exponent);
        if parameters > unit {
            return format!("{}{suffix}", parameters / unit);
        }
    }
    "0".into()
}

/// Python's `f"{value:.1e}"`.
fn exp1(value: f64) -> String {
    format_exp_upper(value, 1).to_lowercase()
}

impl Report {
    pub fn new(cli: &Cli, model: &GptModel, requests: &[Request]) -> Report {
        let args = &cli.requests;
        let prompts = if !args.prompts.is_empty() {
            format!("<user prompts, n {}>", args.prompts.len())
        } else if let Some(path) = &args.prompt_file {
            format!("<prompt file {}, n {}>", path.display(), requests.len())
        } else {
            let lengths: Vec<String> = args
                .num_tokens_to_prompt
                .iter()
                .map(usize::to_string)
                .collect();
            format!(
                "<auto prompts> ({}), {}, {}, {}",
                lengths.join(" "),
                cli.sampling.num_tokens_to_generate,
                exp1(args.incoming_requests_duration),
                exp1(args.incoming_requests_per_sec)
            )
        };
        let graphs = if cli.engine.enable_cuda_graph && model.device().is_cuda() {
            "graphs on".to_string()
        } else {
            "--".to_string()
        };
        Report {
            head: vec![
                model_size(model.parameter_count()),
                "dynamic".into(),
                graphs,
                prompts,
            ],
            prompts: requests.iter().map(|r| r.prompt.clone()).collect(),
            setup: String::new(),
        }
    }

    /// Makes the KV cache and prints the setup between Megatron's `~~~` rules: the buffer
    /// (GiB, the most requests and KV positions) and the guarantee (every admitted request
    /// has blocks for its whole length).
    pub fn print_setup(
        &mut self,
        limits: BatchLimits,
        decoder: &mut Decoder,
        model: &GptModel,
    ) -> Result<()> {
        let blocks = decoder
            .cache(model, limits.max_batch_size as i64, true)?
            .usable_blocks();
        let bytes = blocks as f64 * model.kv_block_bytes()? as f64;
        let mut parts = self.head.clone();
        parts.push(format!(
            "bf {}, no overflow [r {}, t {}]",
            format_fixed(bytes / GIB, 0),
            limits.max_batch_size,
            blocks * BLOCK_SIZE
        ));
        parts.push(format!("gtd 1.00 [r {}]", limits.max_batch_size));
        parts.push(format!("reqs {}", self.prompts.len()));
        self.setup = parts.join(" | ");
        println!("~~~\n{}\n~~~", self.setup);
        Ok(())
    }

    /// Prints each unique prompt once (with how many requests had it, and its first
    /// request's output) and the totals; writes `output_path`.
    pub fn print_results(
        &self,
        finished: &[Finished],
        elapsed: Duration,
        tokenizer: &dyn Tokenizer,
        output_path: Option<&Path>,
        memory: Option<CudaMemoryStats>,
    ) -> Result<()> {
        let texts = finished
            .iter()
            .map(|f| {
                let ids: Vec<u32> = f.tokens.iter().map(|&t| t as u32).collect();
                Ok(tokenizer.detokenize(&ids)?)
            })
            .collect::<Result<Vec<String>>>()?;
        let mut unique: Vec<(&str, Vec<usize>)> = Vec::new();
        for (index, prompt) in self.prompts.iter().enumerate() {
            match unique.iter_mut().find(|(p, _)| *p == prompt) {
                Some((_, indices)) => indices.push(index),
                None => unique.push((prompt, vec![index])),
            }
        }
        println!("~~~~ Unique prompts + outputs. ~~~~");
        for (number, (prompt, indices)) in unique.iter().enumerate() {
            let text = &texts[indices[0]];
            let hash = format!("{:x}", Sha256::digest(text.as_bytes()));
            println!(
                "{number}/{} [n {}, hash {}]. {prompt} ... {}",
                unique.len(),
                indices.len(),
                &hash[..6],
                text.replace('\n', "\\n")
            );
        }
        if let Some(path) = output_path {
            write_json(path, &self.prompts, finished, &texts)?;
        }
        let tokens: usize = finished.iter().map(|f| f.tokens.len()).sum();
        let seconds = elapsed.as_secs_f64();
        println!("~~~");
        // Megatron's peak allocated and peak reserved; the caching allocator keeps what it
        // reserved, so the reserved bytes at the end are their peak.
        let memory = match memory {
            Some(stats) => format!(
                "{}/{}",
                format_fixed(stats.max_allocated_bytes as f64 / GIB, 1),
                format_fixed(stats.reserved_bytes as f64 / GIB, 1)
            ),
            None => "--/--".into(),
        };
        println!(
            "{} … mem {memory} GB … total time: {}s … throughput: {} tok/s",
            self.setup,
            format_fixed(seconds, 3),
            format_fixed(tokens as f64 / seconds, 3)
        );
        println!("~~~");
        eprintln!(
            "gpt_dynamic_inference: {} requests, {tokens} tokens generated in {}s",
            finished.len(),
            format_fixed(seconds, 3)
        );
        Ok(())
    }
}

/// Megatron's results JSON: `{"<request id>": {"input_prompt", "generated_text",
/// "generated_tokens", "latency"[, "logprobs"]}}`, written under a temporary name first.
fn write_json(
    path: &Path,
    prompts: &[String],
    finished: &[Finished],
    texts: &[String],
) -> Result<()> {
    let mut results = serde_json::Map::new();
    for (index, (done, text)) in finished.iter().zip(texts).enumerate() {
        let mut result = serde_json::json!({
            "input_prompt": prompts[index],
            "generated_text": text,
            "generated_tokens": done.tokens,
            "latency": done.latency.as_secs_f64(),
        });
        if let Some(logprobs) = &done.logprobs {
            result["logprobs"] = serde_json::json!(logprobs);
        }
        results.insert(index.to_string(), result);
    }
    let partial = path.with_extension("json.partial");
    let mut file = std::fs::File::create(&partial)
        .with_context(|| format!("creating {}", partial.display()))?;
    serde_json::to_writer(&mut file, &results)
        .map_err(std::io::Error::from)
        .and_then(|()| file.flush())
        .with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, path)
        .with_context(|| format!("renaming {} to {}", partial.display(), path.display()))
}
