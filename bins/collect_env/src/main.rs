//! `collect_env`: what this machine offers megatron-rs (like `python -m torch.utils.collect_env`),
//! and with `--self-test` a check that every device runs bf16 matmul, SDPA and the autograd shim.

use anyhow::ensure;
use clap::Parser;
use megatron_kernels::runtime::{self, self_test};
use std::process::ExitCode;
use tch::Device;

#[derive(Parser)]
#[command(
    version,
    about = "Report libtorch, CUDA devices and NCCL as megatron-rs sees them"
)]
struct Args {
    /// Run bf16 matmul, bf16 scaled-dot-product attention forward+backward and the autograd
    /// shim on the CPU and on every CUDA device, comparing each with an fp32 reference.
    #[arg(long)]
    self_test: bool,
    /// Print libtorch's full build configuration (compiler, CUDA, cuDNN, CPU capability).
    #[arg(long)]
    build_config: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    megatron_cli::run(|| report(&args))
}

fn report(args: &Args) -> anyhow::Result<()> {
    let gpus = runtime::cuda_devices();
    let location = |name: &str| {
        runtime::loaded_library(name)
            .map_or_else(|| "not loaded".to_string(), |p| p.display().to_string())
    };
    println!("megatron-rs {}", env!("CARGO_PKG_VERSION"));
    println!(
        "libtorch: {} ({})",
        runtime::libtorch_version().unwrap_or_else(|| "unknown version".into()),
        location("libtorch_cpu.so")
    );
    println!("libtorch_cuda: {}", location("libtorch_cuda.so"));
    println!("NCCL: {}", location("libnccl.so"));
    println!("CPU threads: {}", tch::get_num_threads());
    println!(
        "CUDA: {} device(s){}",
        gpus.len(),
        if gpus.is_empty() {
            String::new()
        } else {
            format!(
                ", cuDNN {}",
                if tch::Cuda::cudnn_is_available() {
                    "available"
                } else {
                    "unavailable"
                }
            )
        }
    );
    if args.build_config {
        println!("libtorch build configuration:\n{}", runtime::build_config());
    }
    if !args.self_test {
        return Ok(());
    }

    let devices: Vec<Device> = std::iter::once(Device::Cpu).chain(gpus).collect();
    let (mut passed, mut failed) = (0, 0);
    for &device in &devices {
        for check in self_test::run(device) {
            let name = match device {
                Device::Cuda(index) => format!("cuda:{index}"),
                _ => "cpu".to_string(),
            };
            match check.outcome {
                Ok(detail) => {
                    passed += 1;
                    println!("  {name:<8} {:<28} ok ({detail})", check.name);
                }
                Err(error) => {
                    failed += 1;
                    println!("  {name:<8} {:<28} FAILED: {error:#}", check.name);
                }
            }
        }
    }
    println!(
        "self-test: {passed} passed, {failed} failed on {} device(s)",
        devices.len()
    );
    ensure!(failed == 0, "{failed} self-test check(s) failed");
    Ok(())
}
