//! Which device a process computes on.

use anyhow::{bail, Context, Result};
use tch::Device;

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
