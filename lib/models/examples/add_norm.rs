//! Times one residual add + norm of a training step on a GPU, forward and forward + backward, as
//! the fused kernels run it (`Norm::add_and_norm` in training) and as libtorch's add and norm
//! (`MEGATRON_RS_FUSED_ADD_NORM=0`'s path): the activations of GPT-345M at micro batch 8
//! (`[1024, 8, 1024]`) and of GPT-1.3B (`[1024, 8, 2048]`), bf16, LayerNorm and RMSNorm. With
//! hidden dropout 0.1 the fused kernels drop the delta out themselves, against libtorch's dropout
//! followed by the fused add + norm. `scripts/bench/add_norm.sh` runs it.

use std::time::Instant;

use anyhow::{bail, Result};
use megatron_kernels::ops::add_norm;
use megatron_models::config::Normalization;
use megatron_models::layers::Norm;
use megatron_models::param::Initializer;
use tch::{Device, Kind, Tensor};

/// Calls timed per case, after as many for warm-up.
const CALLS: u32 = 200;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    if !tch::Cuda::is_available() {
        bail!("add_norm times CUDA kernels: no CUDA device");
    }
    let device = Device::Cuda(0);
    let kind = Kind::BFloat16;
    println!(
        "| shape | norm | dropout | fused forward µs | unfused forward µs | fused fwd+bwd µs | \
         unfused fwd+bwd µs |"
    );
    println!("|---|---|---|---|---|---|---|");
    for hidden in [1024, 2048] {
        for (normalization, dropout) in [
            (Normalization::LayerNorm, 0.0),
            (Normalization::RMSNorm, 0.0),
            (Normalization::LayerNorm, 0.1),
        ] {
            let init = Initializer::new(kind, device, 0, 1, 1234).scope("norm");
            let norm = Norm::new(&init, normalization, hidden, 1e-5, false, false);
            if !add_norm::usable_on(device, kind, hidden) {
                bail!(
                    "the fused add + norm is off (MEGATRON_RS_FUSED_ADD_NORM=0 or its \
                     self-check failed)"
                );
            }
            let shape = [1024, 8, hidden];
            let residual = Tensor::randn(shape, (kind, device)).set_requires_grad(true);
            let delta = Tensor::randn(shape, (kind, device)).set_requires_grad(true);
            let grads = [
                Tensor::randn(shape, (kind, device)),
                Tensor::randn(shape, (kind, device)),
            ];
            let unfused = if dropout > 0.0 {
                "libtorch's dropout, then the fused add + norm"
            } else {
                "libtorch's add and norm"
            };
            let mut row = format!("| {shape:?} | {normalization:?} | {dropout} ({unfused}) |");
            let mut times = Vec::new();
            for backward in [false, true] {
                for fused in [true, false] {
                    let call = || -> Result<()> {
                        let (sum, normed) = match (fused, dropout > 0.0) {
                            (true, _) => norm.add_and_norm(&residual, &delta, dropout, true)?,
                            (false, true) => norm.add_and_norm(
                                &residual,
                                &delta.dropout(dropout, true),
                                0.0,
                                true,
                            )?,
                            (false, false) => norm.add_and_norm(&residual, &delta, 0.0, false)?,
                        };
                        if backward {
                            // Gradients handed back rather than accumulated into `.grad`, which
                            // would add the same two kernels to both ways.
                            let mut inputs = vec![&residual, &delta, norm.weight.tensor()];
                            inputs.extend(norm.bias.as_ref().map(|b| b.tensor()));
                            megatron_kernels::autograd::grad(
                                &[&sum, &normed],
                                &[&grads[0], &grads[1]],
                                &inputs,
                                false,
                                false,
                            )?;
                        }
                        Ok(())
                    };
                    let run = |calls: u32| -> Result<f64> {
                        tch::Cuda::synchronize(0);
                        let started = Instant::now();
                        for _ in 0..calls {
                            if backward {
                                call()?;
                            } else {
                                tch::no_grad(call)?;
                            }
                        }
                        tch::Cuda::synchronize(0);
                        Ok(started.elapsed().as_secs_f64() * 1e6 / f64::from(calls))
                    };
                    run(CALLS)?;
                    times.push(run(CALLS)?);
                }
            }
            for t in times {
                row.push_str(&format!(" {t:.1} |"));
            }
            println!("{row}");
        }
    }
    Ok(())
}
