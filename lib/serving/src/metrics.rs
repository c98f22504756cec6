//! What `GET /metrics` reports, in Prometheus' text format: requests by endpoint and status,
//! prompt and generated tokens, the queue, the running requests and batch, the KV cache's
//! blocks, time to first token and request duration histograms, and generation throughput
//! over the last seconds.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds over which `megatron_generation_tokens_per_second` is averaged.
const THROUGHPUT_WINDOW: Duration = Duration::from_secs(10);

const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
const DURATION_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

/// A cumulative histogram over fixed upper bounds (seconds).
struct Histogram {
    bounds: &'static [f64],
    state: Mutex<HistogramState>,
}

#[derive(Default)]
struct HistogramState {
    /// Observations at or below each bound (not yet cumulative).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len()],
                ..Default::default()
            }),
        }
    }

    fn observe(&self, seconds: f64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bucket) = self.bounds.iter().position(|&b| seconds <= b) {
            state.counts[bucket] += 1;
        }
        state.sum += seconds;
        state.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, count) in self.bounds.iter().zip(&state.counts) {
            cumulative += count;
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", state.count);
        let _ = writeln!(out, "{name}_sum {}", state.sum);
        let _ = writeln!(out, "{name}_count {}", state.count);
    }
}

/// The gauges read from the server's state at the time of the scrape.
#[derive(Default)]
pub struct Gauges {
    /// Requests waiting for room in the batch (or for the model to load).
    pub queued: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Sequences (prompts or beams) decoded together.
    pub batch_size: usize,
    pub kv_blocks_used: u64,
    /// KV cache blocks the budget (`--kv-cache-gb`) holds.
    pub kv_blocks_capacity: u64,
    /// The most KV cache blocks used at once so far.
    pub kv_blocks_peak: u64,
    /// Generation steps run so far.
    pub steps: u64,
    /// Decode steps queued before the previous step's tokens were read.
    pub steps_ahead: u64,
    /// Prompt positions prefilled (the samples of one prompt share its prefill).
    pub prefilled_positions: u64,
    pub open_connections: usize,
    pub draining: bool,
}

pub struct ServerMetrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    cancelled: AtomicU64,
    /// Connections beyond `--max-connections`, answered 503 and closed.
    refused_connections: AtomicU64,
    /// Requests whose client went away before their answer, by endpoint.
    disconnected: Mutex<BTreeMap<&'static str, u64>>,
    time_to_first_token: Histogram,
    duration: Histogram,
    /// When recent requests finished and how many tokens each generated.
    recent: Mutex<VecDeque<(Instant, u64)>>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            disconnected: Mutex::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            duration: Histogram::new(DURATION_BUCKETS),
            recent: Mutex::default(),
        }
    }
}

impl ServerMetrics {
    /// An answered request; `endpoint` is one of the server's routes (or "other").
    pub fn answered(&self, endpoint: &'static str, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *requests.entry((endpoint, status)).or_default() += 1;
    }

    pub fn first_token(&self, after: Duration) {
        self.time_to_first_token.observe(after.as_secs_f64());
    }

    /// A generation finished (or was cancelled) `after` its arrival.
    pub fn generated(&self, prompt_tokens: u64, generated_tokens: u64, after: Duration) {
        self.prompt_tokens
            .fetch_add(prompt_tokens, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(generated_tokens, Ordering::Relaxed);
        self.duration.observe(after.as_secs_f64());
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.push_back((Instant::now(), generated_tokens));
        Self::forget_old(&mut recent);
    }

    /// A generation stopped early because its client went away.
    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection beyond `--max-connections` was answered 503 and closed.
    pub fn refused_connection(&self) {
        self.refused_connections.fetch_add(1, Ordering::Relaxed);
    }

    /// A client of `endpoint` went away before its answer was ready.
    pub fn disconnected(&self, endpoint: &'static str) {
        let mut disconnected = self.disconnected.lock().unwrap_or_else(|p| p.into_inner());
        *disconnected.entry(endpoint).or_default() += 1;
    }

    fn forget_old(recent: &mut VecDeque<(Instant, u64)>) {
        while recent
            .front()
            .is_some_and(|(at, _)| at.elapsed() > THROUGHPUT_WINDOW)
        {
            recent.pop_front();
        }
    }

    fn tokens_per_second(&self) -> f64 {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        Self::forget_old(&mut recent);
        recent.iter().map(|(_, n)| *n as f64).sum::<f64>() / THROUGHPUT_WINDOW.as_secs_f64()
    }

    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "megatron_prompt_tokens_total",
            "counter",
            "Prompt tokens of the generation requests served.",
            self.prompt_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "megatron_generation_tokens_total",
            "counter",
            "Tokens generated.",
            self.generated_tokens.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "megatron_cancelled_requests_total",
            "counter",
            "Generations stopped early because their client went away.",
            self.cancelled.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "megatron_refused_connections_total",
            "counter",
            "Connections beyond --max-connections, answered 503 and closed.",
            self.refused_connections.load(Ordering::Relaxed).to_string(),
        );
        metric(
            "megatron_generation_tokens_per_second",
            "gauge",
            "Tokens generated per second over the last 10 seconds.",
            format!("{:.3}", self.tokens_per_second()),
        );
        metric(
            "megatron_queue_depth",
            "gauge",
            "Requests waiting for room in the running batch.",
            gauges.queued.to_string(),
        );
        metric(
            "megatron_running_requests",
            "gauge",
            "Requests in the running batch.",
            gauges.running.to_string(),
        );
        metric(
            "megatron_batch_size",
            "gauge",
            "Sequences (prompts or beams) decoded together in the last step.",
            gauges.batch_size.to_string(),
        );
        metric(
            "megatron_kv_cache_blocks_used",
            "gauge",
            "KV cache blocks held by running requests.",
            gauges.kv_blocks_used.to_string(),
        );
        metric(
            "megatron_kv_cache_blocks_capacity",
            "gauge",
            "KV cache blocks within the budget (--kv-cache-gb).",
            gauges.kv_blocks_capacity.to_string(),
        );
        metric(
            "megatron_kv_cache_blocks_peak",
            "gauge",
            "The most KV cache blocks used at once.",
            gauges.kv_blocks_peak.to_string(),
        );
        metric(
            "megatron_generation_steps_total",
            "counter",
            "Batched generation steps run.",
            gauges.steps.to_string(),
        );
        metric(
            "megatron_generation_steps_ahead_total",
            "counter",
            "Decode steps queued before the previous step's tokens were read (the host's work \
             overlapping the GPU's).",
            gauges.steps_ahead.to_string(),
        );
        metric(
            "megatron_prefill_positions_total",
            "counter",
            "Prompt positions prefilled (a prompt's samples, n or best_of, share one prefill).",
            gauges.prefilled_positions.to_string(),
        );
        metric(
            "megatron_open_connections",
            "gauge",
            "Open HTTP connections.",
            gauges.open_connections.to_string(),
        );
        metric(
            "megatron_draining",
            "gauge",
            "1 while the server finishes its requests before stopping.",
            u8::from(gauges.draining).to_string(),
        );
        {
            let disconnected = self.disconnected.lock().unwrap_or_else(|p| p.into_inner());
            let name = "megatron_client_disconnects_total";
            let _ = writeln!(
                out,
                "# HELP {name} Requests whose client went away before the answer, by endpoint.\n\
                 # TYPE {name} counter"
            );
            for (endpoint, count) in disconnected.iter() {
                let _ = writeln!(out, "{name}{{endpoint=\"{endpoint}\"}} {count}");
            }
        }
        {
            let requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
            let _ = writeln!(
                out,
                "# HELP megatron_requests_total HTTP requests answered, by endpoint and status.\n\
                 # TYPE megatron_requests_total counter"
            );
            for ((endpoint, status), count) in requests.iter() {
                let _ = writeln!(
                    out,
                    "megatron_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {count}"
                );
            }
        }
        self.time_to_first_token.render(
            &mut out,
            "megatron_time_to_first_token_seconds",
            "Seconds from a completion's arrival to its first generated text.",
        );
        self.duration.render(
            &mut out,
            "megatron_request_duration_seconds",
            "Seconds from a generation request's arrival to its last token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, line_start: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(line_start))
            .unwrap_or_else(|| panic!("no {line_start} in {text}"))
            .trim()
            .parse()
            .unwrap()
    }

    #[test]
    fn counters_histograms_and_gauges_in_prometheus_text() {
        let metrics = ServerMetrics::default();
        metrics.answered("/api", 200);
        metrics.answered("/api", 200);
        metrics.answered("/v1/completions", 503);
        metrics.first_token(Duration::from_millis(30));
        metrics.first_token(Duration::from_secs(3));
        metrics.generated(7, 20, Duration::from_millis(700));
        metrics.generated(3, 10, Duration::from_secs(400));
        metrics.refused_connection();
        metrics.disconnected("/api");
        metrics.disconnected("/api");
        let text = metrics.render(&Gauges {
            queued: 4,
            running: 1,
            batch_size: 2,
            kv_blocks_used: 5,
            kv_blocks_capacity: 64,
            kv_blocks_peak: 7,
            steps: 11,
            steps_ahead: 6,
            prefilled_positions: 12,
            open_connections: 9,
            draining: false,
        });
        assert_eq!(
            value(
                &text,
                "megatron_requests_total{endpoint=\"/api\",status=\"200\"}"
            ),
            2.0
        );
        assert_eq!(
            value(
                &text,
                "megatron_requests_total{endpoint=\"/v1/completions\",status=\"503\"}"
            ),
            1.0
        );
        assert_eq!(value(&text, "megatron_refused_connections_total "), 1.0);
        assert_eq!(
            value(
                &text,
                "megatron_client_disconnects_total{endpoint=\"/api\"}"
            ),
            2.0
        );
        assert_eq!(value(&text, "megatron_prompt_tokens_total "), 10.0);
        assert_eq!(value(&text, "megatron_generation_tokens_total "), 30.0);
        assert_eq!(value(&text, "megatron_generation_tokens_per_second "), 3.0);
        assert_eq!(value(&text, "megatron_queue_depth "), 4.0);
        assert_eq!(value(&text, "megatron_batch_size "), 2.0);
        assert_eq!(value(&text, "megatron_kv_cache_blocks_used "), 5.0);
        assert_eq!(value(&text, "megatron_kv_cache_blocks_capacity "), 64.0);
        assert_eq!(value(&text, "megatron_kv_cache_blocks_peak "), 7.0);
        assert_eq!(value(&text, "megatron_generation_steps_total "), 11.0);
        assert_eq!(value(&text, "megatron_generation_steps_ahead_total "), 6.0);
        assert_eq!(value(&text, "megatron_prefill_positions_total "), 12.0);
        let ttft = "megatron_time_to_first_token_seconds_bucket";
        assert_eq!(value(&text, &format!("{ttft}{{le=\"0.025\"}}")), 0.0);
        assert_eq!(value(&text, &format!("{ttft}{{le=\"0.05\"}}")), 1.0);
        assert_eq!(value(&text, &format!("{ttft}{{le=\"5\"}}")), 2.0);
        let duration = "megatron_request_duration_seconds";
        // 400 s is beyond the last bound: only in +Inf and the count.
        assert_eq!(
            value(&text, &format!("{duration}_bucket{{le=\"300\"}}")),
            1.0
        );
        assert_eq!(
            value(&text, &format!("{duration}_bucket{{le=\"+Inf\"}}")),
            2.0
        );
        assert_eq!(value(&text, &format!("{duration}_sum ")), 400.7);
    }

    /// Prometheus reserves the `_total` suffix for counters: a gauge named so reads as a
    /// cumulative count to dashboards and linters.
    #[test]
    fn only_counters_are_named_total() {
        let text = ServerMetrics::default().render(&Gauges::default());
        let typed: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|line| line.strip_prefix("# TYPE "))
            .filter_map(|rest| rest.split_once(' '))
            .collect();
        assert!(typed.len() >= 16, "{text}");
        for (name, kind) in typed {
            assert_eq!(
                name.ends_with("_total"),
                kind == "counter",
                "{name} is a {kind}"
            );
        }
    }
}
