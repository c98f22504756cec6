//! Copies between the host and a GPU that do not hold the calling thread: a copy from pageable
//! host memory, or one read back with `to_device(Cpu)`, first waits for all the work queued on
//! the stream, so the host could not prepare the next step while the GPU runs this one.

use tch::{Device, Tensor};

use super::{CudaEvent, CudaStream};
use crate::autograd::ffi;
use crate::error::check;
use crate::TorchError;

/// Copies the CPU tensor `host` into `dst` (same shape and dtype). To a GPU the copy is queued on
/// the current stream, from a page-locked copy of `host`, and the thread goes on at once.
pub fn copy_from_host(dst: &Tensor, host: &Tensor) -> Result<(), TorchError> {
    // SAFETY: both handles are live for the call; the shim copies, it keeps neither.
    check(unsafe { ffi::mrs_copy_from_host(ffi::handle(dst), ffi::handle(host)) })
}

/// The CPU tensor `host` on `device`; to a GPU the copy is queued (see [`copy_from_host`]).
pub fn to_device_async(host: &Tensor, device: Device) -> Result<Tensor, TorchError> {
    if device == Device::Cpu {
        return Ok(host.shallow_clone());
    }
    let out = Tensor::empty(host.size(), (host.kind(), device));
    copy_from_host(&out, host)?;
    Ok(out)
}

/// Device tensors on their way to the host: the copies run on a stream of their own once the
/// work queued so far on the current stream is done, so they neither hold up what is queued
/// there next nor wait for it; [`HostCopy::read`] waits for them alone.
pub struct HostCopy {
    /// The copied tensors, alive until the copies are done.
    sources: Vec<Tensor>,
    copies: Vec<Tensor>,
    done: Option<CudaEvent>,
}

impl HostCopy {
    /// Queues the copies of `tensors` (on one device) to the host.
    pub fn start(tensors: &[&Tensor]) -> Result<Self, TorchError> {
        let sources: Vec<Tensor> = tensors.iter().map(|t| t.shallow_clone()).collect();
        let Some(Device::Cuda(index)) = tensors.first().map(|t| t.device()) else {
            return Ok(HostCopy {
                copies: sources.iter().map(Tensor::shallow_clone).collect(),
                sources,
                done: None,
            });
        };
        let side = CudaStream::from_pool(index)?;
        side.wait_for(&CudaStream::current(index)?)?;
        // Non-blocking copies to the CPU land in page-locked memory that libtorch allocates.
        let copies = side
            .run(|| {
                sources
                    .iter()
                    .map(|t| t.f_to_device_(Device::Cpu, t.kind(), true, false))
                    .collect::<Result<Vec<_>, _>>()
            })?
            .map_err(|e| TorchError(e.to_string()))?;
        let done = Some(CudaEvent::record(&side)?);
        Ok(HostCopy {
            sources,
            copies,
            done,
        })
    }

    /// Waits for the copies and returns them, in the order given, as CPU tensors.
    pub fn read(self) -> Result<Vec<Tensor>, TorchError> {
        if let Some(done) = &self.done {
            done.wait()?;
        }
        drop(self.sources);
        Ok(self.copies)
    }
}
