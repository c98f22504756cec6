//! libtorch's Kineto profiler (the engine behind `torch.profiler`), and the CUDA runtime's
//! profiler range for `nsys profile --capture-range=cudaProfilerApi`.

use std::ffi::CString;
use std::path::Path;

use anyhow::{Context, Result};

use crate::autograd::ffi;
use crate::error::check;

/// A running Kineto trace of the operators this thread (and the autograd threads it starts)
/// runs, plus the CUDA kernels and copies of the whole process when it traces CUDA. Only one
/// may run at a time; [`KinetoTrace::save`] ends it.
#[must_use = "a trace runs until it is saved"]
pub struct KinetoTrace {
    with_cuda: bool,
}

impl KinetoTrace {
    /// Starts tracing; `record_shapes` adds each operator's input shapes.
    pub fn start(with_cuda: bool, record_shapes: bool) -> Result<KinetoTrace> {
        // SAFETY: plain call.
        check(unsafe { ffi::mrs_profiler_start(i32::from(with_cuda), i32::from(record_shapes)) })
            .context("starting libtorch's profiler")?;
        Ok(KinetoTrace { with_cuda })
    }

    /// Waits for the queued kernels (so the trace holds all of them), ends the trace and writes
    /// it to `path` as a Chrome trace (JSON; chrome://tracing, Perfetto, TensorBoard's profiler).
    pub fn save(self, path: &Path) -> Result<()> {
        if self.with_cuda {
            for device in 0..tch::Cuda::device_count() {
                tch::Cuda::synchronize(device);
            }
        }
        let c_path = CString::new(path.as_os_str().as_encoded_bytes())
            .with_context(|| format!("trace path {} holds a NUL byte", path.display()))?;
        // SAFETY: the path is a valid C string for the call's duration.
        check(unsafe { ffi::mrs_profiler_stop(c_path.as_ptr()) })
            .with_context(|| format!("saving the profiler trace to {}", path.display()))
    }
}

/// Opens the CUDA runtime's profiling range (`cudaProfilerStart`), which
/// `nsys profile --capture-range=cudaProfilerApi` records.
pub fn cuda_profiler_start() -> Result<()> {
    // SAFETY: plain call.
    check(unsafe { ffi::mrs_cuda_profiler_start() }).context("cudaProfilerStart")
}

/// Closes the range [`cuda_profiler_start`] opened.
pub fn cuda_profiler_stop() -> Result<()> {
    // SAFETY: plain call.
    check(unsafe { ffi::mrs_cuda_profiler_stop() }).context("cudaProfilerStop")
}
