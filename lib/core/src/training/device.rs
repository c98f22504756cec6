//! Choosing the training device and knowing its peak throughput.

use anyhow::{bail, Context, Result};
use tch::Device;

use super::flops::peak_bf16_tflops;

/// `auto`, `cpu`, `cuda` or `cuda:N`; `auto` and `cuda` mean this process's GPU, the one its
/// launcher's `LOCAL_RANK` names (0 without a launcher).
pub fn resolve_device(name: &str, local_rank: usize) -> Result<Device> {
    let cuda_count = tch::Cuda::device_count() as usize;
    let local = || -> Result<Device> {
        if local_rank >= cuda_count {
            bail!("LOCAL_RANK {local_rank} but this machine has {cuda_count} CUDA device(s) visible to libtorch");
        }
        Ok(Device::Cuda(local_rank))
    };
    match name {
        "auto" if cuda_count > 0 => local(),
        "auto" | "cpu" => Ok(Device::Cpu),
        "cuda" if cuda_count > 0 => local(),
        cuda if cuda.starts_with("cuda") => {
            let index: usize = match cuda.strip_prefix("cuda:") {
                Some(index) => index
                    .parse()
                    .with_context(|| format!("--device {cuda}: bad device index"))?,
                None => 0,
            };
            if index >= cuda_count {
                bail!("--device {cuda}: this machine has {cuda_count} CUDA device(s) visible to libtorch");
            }
            Ok(Device::Cuda(index))
        }
        other => bail!("--device {other:?}: expected auto, cpu, cuda or cuda:N"),
    }
}

/// Dense bf16 peak of the device in TFLOP/s, for MFU; the name comes from `nvidia-smi`.
pub fn peak_tflops_of(device: Device) -> Option<f64> {
    let Device::Cuda(index) = device else {
        return None;
    };
    let output = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=name",
            "--format=csv,noheader",
            &format!("--id={index}"),
        ])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&output.stdout).trim().to_string();
    peak_bf16_tflops(&name)
}
