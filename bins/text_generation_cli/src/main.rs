//! `text_generation_cli host:port`: Megatron's `tools/text_generation_cli.py` — read a prompt
//! and a token count, `PUT /api`, print the response; or, with `--prompt`, `--request` or
//! `--completion` or `--chat` (OpenAI's `/v1/completions`, `/v1/chat/completions`), one
//! request for scripts.

mod http;

use std::io::{BufRead, Write};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};

/// Query a text_generation_server interactively (like Megatron's CLI), or once with --prompt.
#[derive(Parser)]
#[command(version, about, long_about = None, args_override_self = true, max_term_width = 100)]
struct Cli {
    /// The server, as host:port.
    server: String,
    /// Send this prompt once and print the generated text (no prompting).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate in --prompt mode.
    #[arg(long, default_value_t = 64)]
    tokens_to_generate: u64,
    /// In --prompt mode print the server's whole JSON response instead of the text.
    #[arg(long)]
    json: bool,
    /// Send this request body as it is (any of Megatron's fields) and print the JSON response.
    #[arg(long, conflicts_with = "prompt")]
    request: Option<String>,
    /// POST this OpenAI completion request to /v1/completions and print the answer (the JSON
    /// body, or with "stream": true the server-sent events).
    #[arg(long, conflicts_with_all = ["prompt", "request"])]
    completion: Option<String>,
    /// POST this OpenAI chat completion request ({"messages": [...], ...}) to
    /// /v1/chat/completions and print the answer like --completion.
    #[arg(long, conflicts_with_all = ["prompt", "request", "completion"])]
    chat: Option<String>,
}

/// Sends one request; the server's error message on a non-200 answer.
fn query(
    server: &str,
    prompt: &str,
    tokens_to_generate: u64,
) -> Result<std::result::Result<Value, String>> {
    let body = json!({"prompts": [prompt], "tokens_to_generate": tokens_to_generate});
    send(server, &serde_json::to_vec(&body)?)
}

fn send(server: &str, body: &[u8]) -> Result<std::result::Result<Value, String>> {
    let (status, reply) = http::send(server, "PUT", "/api", body)?;
    let reply: Value = serde_json::from_slice(&reply)
        .with_context(|| format!("{server} answered {status} with non-JSON"))?;
    if status != 200 {
        let message = reply
            .as_str()
            .map(str::to_string)
            .or_else(|| reply["message"].as_str().map(str::to_string));
        return Ok(Err(format!(
            "Error {status}: {}",
            message.unwrap_or_else(|| reply.to_string())
        )));
    }
    Ok(Ok(reply))
}

fn first_text(reply: &Value) -> Result<&str> {
    reply["text"][0]
        .as_str()
        .context("the response has no text")
}

fn interactive(server: &str) -> Result<()> {
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut ask = |question: &str| -> Result<Option<String>> {
        print!("{question}");
        std::io::stdout().flush()?;
        lines.next().transpose().map_err(Into::into)
    };
    loop {
        let Some(prompt) = ask("Enter prompt: ")? else {
            return Ok(());
        };
        let Some(count) = ask("Enter number of tokens to generate: ")? else {
            return Ok(());
        };
        let Ok(tokens) = count.trim().parse::<u64>() else {
            println!("not a number: {count:?}");
            continue;
        };
        match query(server, &prompt, tokens)? {
            Ok(reply) => println!("Megatron Response: \n{}", first_text(&reply)?),
            Err(message) => println!("{message}"),
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    megatron_cli::run(|| {
        let openai = match (&cli.completion, &cli.chat) {
            (Some(body), _) => Some(("/v1/completions", body)),
            (None, Some(body)) => Some(("/v1/chat/completions", body)),
            (None, None) => None,
        };
        if let Some((path, body)) = openai {
            let (status, reply) = http::send(&cli.server, "POST", path, body.as_bytes())?;
            let text = String::from_utf8_lossy(&reply);
            if status != 200 {
                bail!("Error {status}: {text}");
            }
            print!("{text}");
            return Ok(());
        }
        if let Some(body) = &cli.request {
            match send(&cli.server, body.as_bytes())? {
                Ok(reply) => println!("{reply}"),
                Err(message) => bail!("{message}"),
            }
            return Ok(());
        }
        let Some(prompt) = &cli.prompt else {
            return interactive(&cli.server);
        };
        match query(&cli.server, prompt, cli.tokens_to_generate)? {
            Ok(reply) if cli.json => println!("{reply}"),
            Ok(reply) => println!("{}", first_text(&reply)?),
            Err(message) => bail!("{message}"),
        }
        Ok(())
    })
}
