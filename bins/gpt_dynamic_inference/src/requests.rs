//! The requests of Megatron's inference examples (`examples/inference/gpt/utils.py`): the
//! `--prompts` given, the `text` of each line of `--prompt-file`, or simulated prompts ("hi "
//! repeated a number of times drawn from `--num-tokens-to-prompt`). Simulated requests arrive
//! as a Poisson process at `--incoming-requests-per-sec` over `--incoming-requests-duration`
//! seconds, drawn with Python's `random` seeded by `--seed` exactly as Megatron draws them;
//! given prompts arrive at once unless `--random-sample-prompts`.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use megatron_cli::bail_usage;
use megatron_data::random::PythonRandom;

#[derive(Debug, Args)]
pub struct RequestArgs {
    /// Prompts to serve, each one argument (quote a prompt with spaces).
    #[arg(long, num_args = 1.., conflicts_with = "prompt_file")]
    pub prompts: Vec<String>,
    /// A JSON-lines file of prompts: the "text" of each line (lines without one are skipped).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Given prompts arrive at simulated times too, and only as many as the simulation has
    /// arrivals; without it every given prompt arrives at once.
    #[arg(long)]
    pub random_sample_prompts: bool,
    /// Simulated prompts: "hi " repeated a number of times drawn uniformly from this range
    /// (two integers, both included).
    #[arg(long, num_args = 1.., default_values_t = [64, 1024])]
    pub num_tokens_to_prompt: Vec<usize>,
    /// Simulated requests per second (the rate of their Poisson process).
    #[arg(long, default_value_t = 100.0)]
    pub incoming_requests_per_sec: f64,
    /// Seconds over which simulated requests arrive (about this times
    /// --incoming-requests-per-sec requests; at least one).
    #[arg(long, default_value_t = 10.0)]
    pub incoming_requests_duration: f64,
}

/// A prompt and when it arrives, in seconds after the run starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub prompt: String,
    pub arrival: f64,
}

impl RequestArgs {
    /// The requests these flags describe, drawn from `random.seed(seed)`.
    pub fn requests(&self, seed: i64) -> Result<Vec<Request>> {
        let rate = self.incoming_requests_per_sec;
        if !(rate.is_finite() && rate > 0.0) {
            bail_usage!("--incoming-requests-per-sec must be a positive number, got {rate}");
        }
        let duration = self.incoming_requests_duration;
        if !(duration.is_finite() && duration >= 0.0) {
            bail_usage!(
                "--incoming-requests-duration must be a number of seconds ≥ 0, got {duration}"
            );
        }
        let mut random = PythonRandom::new(seed);
        let given = match &self.prompt_file {
            Some(path) => Some(read_prompt_file(path)?),
            None if !self.prompts.is_empty() => Some(self.prompts.clone()),
            None => None,
        };
        if let Some(prompts) = given {
            if !self.random_sample_prompts {
                return Ok(prompts
                    .into_iter()
                    .map(|prompt| Request {
                        prompt,
                        arrival: 0.0,
                    })
                    .collect());
            }
            let arrivals = arrivals(&mut random, rate, duration);
            return Ok(prompts
                .into_iter()
                .zip(arrivals)
                .map(|(prompt, arrival)| Request { prompt, arrival })
                .collect());
        }
        let &[shortest, longest] = &self.num_tokens_to_prompt[..] else {
            bail_usage!(
                "--num-tokens-to-prompt takes two numbers, the shortest and the longest prompt, \
                 got {:?}",
                self.num_tokens_to_prompt
            );
        };
        if shortest > longest {
            bail_usage!(
                "--num-tokens-to-prompt {shortest} {longest}: the first must not exceed the second"
            );
        }
        let arrivals = arrivals(&mut random, rate, duration);
        Ok(arrivals
            .into_iter()
            .map(|arrival| {
                let repeats = random.randint(shortest as i64, longest as i64) as usize;
                Request {
                    prompt: "hi ".repeat(repeats),
                    arrival,
                }
            })
            .collect())
    }
}

/// The arrival times of a Poisson process at `rate` per second before `duration` seconds
/// (exponential gaps, as a simpy process timing out after each), at least one at 0.
fn arrivals(random: &mut PythonRandom, rate: f64, duration: f64) -> Vec<f64> {
    let mut times = Vec::new();
    let mut now = 0.0;
    loop {
        now += random.expovariate(rate);
        if now >= duration {
            break;
        }
        times.push(now);
    }
    if times.is_empty() {
        times.push(0.0);
    }
    times
}

fn read_prompt_file(path: &PathBuf) -> Result<Vec<String>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut prompts = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let item: serde_json::Value = serde_json::from_str(&line)
            .with_context(|| format!("{}:{}: not a JSON object", path.display(), number + 1))?;
        match item.get("text") {
            Some(serde_json::Value::String(text)) => prompts.push(text.clone()),
            Some(_) => anyhow::bail!(
                "{}:{}: \"text\" must be a string",
                path.display(),
                number + 1
            ),
            None => {}
        }
    }
    if prompts.is_empty() {
        anyhow::bail!("{} has no line with a \"text\"", path.display());
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_stop_before_the_duration_and_never_come_empty() {
        let times = arrivals(&mut PythonRandom::new(42), 8.0, 1.0);
        assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
        assert!(times.iter().all(|&t| t > 0.0 && t < 1.0), "{times:?}");
        assert_eq!(arrivals(&mut PythonRandom::new(42), 8.0, 0.0), [0.0]);
    }
}
