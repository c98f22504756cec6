//! Times batch-1 decode steps of a GPT checkpoint on a GPU (CUDA graphs, one row): with the
//! argmax read on the host before the next step, and the way the server runs them (the next
//! step queued first, reading the argmax on the device); with the fused decode kernels and
//! without. Writes a Kineto trace of 20 steps of each, as the server runs them.
//! `scripts/bench/decode_step.sh` makes the checkpoint and summarises the traces.
//!
//! Usage: `decode_step CHECKPOINT TRACE_PREFIX` (writes `TRACE_PREFIX_fused.json` and
//! `TRACE_PREFIX_unfused.json`).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use megatron_inference::{DecodeRow, DecodeSettings, Decoder, PrefillChunk};
use megatron_kernels::ops::argmax::greedy;
use megatron_kernels::runtime::{HostCopy, KinetoTrace};
use megatron_models::GptModel;
use megatron_parallel::ParallelState;
use megatron_store::load_for_inference;
use tch::{Device, Kind, Tensor};

/// Prompt length before the timed steps.
const PROMPT: i64 = 128;
/// Steps timed each way.
const STEPS: u32 = 200;

/// How a step's token reaches the next step.
#[derive(Clone, Copy)]
enum Mode {
    /// Read on the host before the next step is queued.
    Read,
    /// Read on the device by the next step, queued before the host reads it.
    Overlapped,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, checkpoint, traces] = args.as_slice() else {
        bail!("usage: decode_step CHECKPOINT TRACE_PREFIX");
    };
    if !tch::Cuda::is_available() {
        bail!("decode_step times CUDA graphs: no CUDA device");
    }
    let model: GptModel = load_for_inference(
        Path::new(checkpoint),
        Device::Cuda(0),
        Kind::BFloat16,
        &ParallelState::single(),
    )
    .with_context(|| format!("loading {checkpoint}"))?;
    for fused in [true, false] {
        let label = if fused { "fused" } else { "unfused" };
        let trace = format!("{traces}_{label}.json");
        tch::no_grad(|| time_steps(&model, fused, Path::new(&trace)))
            .with_context(|| format!("{label} decode steps"))?;
    }
    Ok(())
}

fn time_steps(model: &GptModel, fused: bool, trace: &Path) -> Result<()> {
    let mut decoder = Decoder::new(DecodeSettings {
        fused_kernels: fused,
        ..DecodeSettings::default()
    });
    decoder.warm_up(model, 1)?;
    let positions = PROMPT + 3 * i64::from(STEPS) + 64;
    let blocks = decoder
        .cache(model, 1, true)?
        .allocate((positions + 15) / 16)
        .context("the KV cache has no room for one row")?;
    let prompt: Vec<i64> = (0..PROMPT).map(|i| (i * 7919) % 50_000).collect();
    let logits = decoder.prefill(
        model,
        &[PrefillChunk {
            tokens: &prompt,
            start: 0,
            blocks: &blocks,
        }],
    )?;
    let mut token = logits[0].select(0, -1).argmax(-1, false).int64_value(&[]);
    let mut position = PROMPT;
    // The step the server queued last: its argmax on the device, on its way to the host.
    let mut queued: Option<(Tensor, HostCopy)> = None;
    // Host time in the decoder (the inputs' copy and the graph launch), read mode only.
    let host = std::cell::Cell::new(std::time::Duration::ZERO);
    let mut step = |mode: Mode| -> Result<()> {
        let row = DecodeRow {
            token,
            position,
            blocks: &blocks,
        };
        let drawn = match mode {
            Mode::Overlapped => queued.as_ref().map(|(tokens, _)| tokens.shallow_clone()),
            Mode::Read => None,
        };
        let started = Instant::now();
        let logits = decoder.decode(model, &[row], drawn.as_ref())?;
        host.set(host.get() + started.elapsed());
        position += 1;
        match mode {
            Mode::Read => token = greedy(&logits)?.int64_value(&[0]),
            // As the server does: the next step is queued before this one's token is read.
            Mode::Overlapped => {
                let next = greedy(&logits)?;
                let copy = HostCopy::start(&[&next])?;
                if let Some((_, previous)) = queued.replace((next, copy)) {
                    token = previous.read()?[0].int64_value(&[0]);
                }
            }
        }
        Ok(())
    };
    for _ in 0..16 {
        step(Mode::Read)?;
    }
    let mut timed = |mode: Mode| -> Result<f64> {
        let started = Instant::now();
        host.set(std::time::Duration::ZERO);
        for _ in 0..STEPS {
            step(mode)?;
        }
        tch::Cuda::synchronize(0);
        Ok(started.elapsed().as_secs_f64() / f64::from(STEPS))
    };
    let served = timed(Mode::Read)?;
    let host_per_step = host.get().as_secs_f64() / f64::from(STEPS);
    let overlapped = timed(Mode::Overlapped)?;
    let recording = KinetoTrace::start(true, false)?;
    for _ in 0..20 {
        step(Mode::Overlapped)?;
    }
    recording.save(trace)?;
    println!(
        "{}: {:.1} us a step with the argmax read before the next step ({:.0} tokens/s; {:.1} us \
         of it in the decoder's call: inputs and graph launch), {:.1} us with the next step \
         queued first ({:.0} tokens/s)",
        if fused { "fused" } else { "--no-decode-fusion" },
        served * 1e6,
        1.0 / served,
        host_per_step * 1e6,
        overlapped * 1e6,
        1.0 / overlapped,
    );
    Ok(())
}
