//! What the linked libtorch offers on this machine, and a self-test of the pieces training needs.

mod cuda_graph;
mod device;
pub mod nvrtc;
mod profiler;
pub mod self_test;
mod store;
mod transfer;

pub use cuda_graph::{
    cuda_empty_cache, cuda_graphs_available, cuda_memory_stats, CudaGraph, CudaMemoryStats,
};
pub use device::resolve_device;
pub use profiler::{cuda_profiler_start, cuda_profiler_stop, KinetoTrace};
pub use store::TorchStore;
pub use transfer::{copy_from_host, to_device_async, HostCopy};

use std::os::raw::{c_int, c_void};

use crate::autograd::ffi;
use crate::error::check;
use crate::TorchError;
use tch::{Cuda, Device};

/// libtorch's own description of its build: compiler, CUDA, cuDNN and NCCL versions, CPU
/// capability.
pub fn build_config() -> String {
    // SAFETY: returns a malloc'd NUL-terminated string that we free.
    unsafe {
        let raw = ffi::mrs_build_config();
        let text = std::ffi::CStr::from_ptr(raw).to_string_lossy().into_owned();
        ffi::mrs_free_string(raw);
        text
    }
}

/// libtorch's current stream on CUDA device `index` for the calling thread, as a raw
/// `cudaStream_t`: work enqueued on it from outside libtorch (NCCL) runs in order with the
/// kernels of the tensors it reads and writes.
pub fn current_cuda_stream(index: usize) -> Result<*mut c_void, TorchError> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: on success the shim writes the stream handle, which libtorch keeps alive.
    check(unsafe { ffi::mrs_current_stream(cuda_index(index)?, &mut stream) })?;
    Ok(stream)
}

/// A copy of the CPU tensor `tensor` in page-locked memory, from which a copy to a GPU runs
/// asynchronously (from pageable memory it would first wait for the work queued on the stream).
pub fn pinned(tensor: &tch::Tensor) -> Result<tch::Tensor, TorchError> {
    let mut handle = std::ptr::null_mut();
    // SAFETY: the tensor handle is live for the call; on success the shim writes a new handle.
    check(unsafe { ffi::mrs_pin_memory(ffi::handle(tensor), &mut handle) })?;
    // SAFETY: the handle is a fresh tensor we own.
    Ok(unsafe { tch::Tensor::from_ptr(handle) })
}

/// Makes CUDA device `index` current on the calling thread, for libraries that act on the
/// current device (NCCL's communicator setup).
pub fn set_cuda_device(index: usize) -> Result<(), TorchError> {
    // SAFETY: plain call.
    check(unsafe { ffi::mrs_set_device(cuda_index(index)?) })
}

/// A CUDA stream of one device, by c10's packed stream id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaStream {
    pub device: usize,
    id: i64,
}

impl CudaStream {
    /// A stream from libtorch's pool (not the default stream), for work that should overlap
    /// with the compute stream.
    pub fn from_pool(device: usize) -> Result<Self, TorchError> {
        let mut id = 0;
        // SAFETY: plain call writing an integer.
        check(unsafe { ffi::mrs_pool_stream(cuda_index(device)?, &mut id) })?;
        Ok(CudaStream { device, id })
    }

    /// The calling thread's current stream on `device`.
    pub fn current(device: usize) -> Result<Self, TorchError> {
        let mut id = 0;
        // SAFETY: plain call writing an integer.
        check(unsafe { ffi::mrs_current_stream_id(cuda_index(device)?, &mut id) })?;
        Ok(CudaStream { device, id })
    }

    /// Work enqueued on `self` from now on waits for the work enqueued so far on `other`.
    pub fn wait_for(&self, other: &CudaStream) -> Result<(), TorchError> {
        CudaEvent::record(other)?.block(self)
    }

    /// Runs `body` with `self` as the calling thread's current stream, restoring the previous
    /// one afterwards.
    pub fn run<T>(&self, body: impl FnOnce() -> T) -> Result<T, TorchError> {
        let index = cuda_index(self.device)?;
        let mut previous = 0;
        // SAFETY: plain calls on stream ids of this device.
        check(unsafe { ffi::mrs_exchange_stream(index, self.id, &mut previous) })?;
        let out = body();
        let mut ignored = 0;
        check(unsafe { ffi::mrs_exchange_stream(index, previous, &mut ignored) })?;
        Ok(out)
    }
}

/// A point in a stream's work, recorded now and waited for later by another stream.
pub struct CudaEvent {
    device: usize,
    raw: *mut c_void,
}

// SAFETY: a CUDA event may be recorded, waited on and destroyed from any thread.
unsafe impl Send for CudaEvent {}
unsafe impl Sync for CudaEvent {}

impl CudaEvent {
    /// Marks the work enqueued on `stream` so far.
    pub fn record(stream: &CudaStream) -> Result<Self, TorchError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: on success the shim writes a new event that this value owns.
        check(unsafe { ffi::mrs_event_record(cuda_index(stream.device)?, stream.id, &mut raw) })?;
        Ok(CudaEvent {
            device: stream.device,
            raw,
        })
    }

    /// Work enqueued on `stream` from now on waits for the recorded work.
    pub fn block(&self, stream: &CudaStream) -> Result<(), TorchError> {
        // SAFETY: the event is live and belongs to the stream's device.
        check(unsafe { ffi::mrs_event_block(cuda_index(self.device)?, self.raw, stream.id) })
    }

    /// Blocks the calling thread until the recorded work is done.
    pub fn wait(&self) -> Result<(), TorchError> {
        // SAFETY: the event is live.
        check(unsafe { ffi::mrs_event_synchronize(self.raw) })
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        if let Ok(index) = cuda_index(self.device) {
            // SAFETY: destroyed once; CUDA defers the release past pending waits.
            let _ = check(unsafe { ffi::mrs_event_destroy(index, self.raw) });
        }
    }
}

fn cuda_index(index: usize) -> Result<c_int, TorchError> {
    c_int::try_from(index).map_err(|_| TorchError(format!("no CUDA device {index}")))
}

/// The CUDA devices libtorch can use, in index order (empty on a CPU-only machine).
pub fn cuda_devices() -> Vec<Device> {
    if !Cuda::is_available() {
        return Vec::new();
    }
    (0..Cuda::device_count() as usize)
        .map(Device::Cuda)
        .collect()
}

/// The device to run on by default: the first GPU when there is one, else the CPU.
pub fn default_device() -> Device {
    cuda_devices().first().copied().unwrap_or(Device::Cpu)
}

/// Path of a shared library this process has loaded whose file name starts with `name`
/// (e.g. `libnccl.so`), read from /proc/self/maps. Shows which libtorch and NCCL a binary
/// really runs with, whatever LD_LIBRARY_PATH and rpath say.
pub fn loaded_library(name: &str) -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            std::path::Path::new(path)
                .file_name()
                .and_then(|f| f.to_str())
                .is_some_and(|f| f.starts_with(name))
        })
        .map(std::path::PathBuf::from)
}

/// Version of the libtorch this process runs with, read next to the loaded `libtorch_cpu.so`
/// (`version.py` of a python wheel, `build-version` of a C++ distribution).
pub fn libtorch_version() -> Option<String> {
    let root = loaded_library("libtorch_cpu.so")?
        .parent()?
        .parent()?
        .to_path_buf();
    if let Ok(version) = std::fs::read_to_string(root.join("build-version")) {
        return Some(version.trim().to_string());
    }
    let py = std::fs::read_to_string(root.join("version.py")).ok()?;
    let line = py.lines().find(|l| l.starts_with("__version__"))?;
    Some(line.split('\'').nth(1)?.to_string())
}

/// Bytes free on CUDA device `index` (`cudaMemGetInfo` of the CUDA runtime libtorch loaded),
/// or `None` when that runtime cannot be found or asked.
pub fn cuda_free_memory(index: usize) -> Option<u64> {
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
    set_cuda_device(index).ok()?;
    let name = c"cudaMemGetInfo";
    // SAFETY: dlsym/dlopen with NUL-terminated names; RTLD_NOLOAD only finds loaded libraries.
    let symbol = unsafe {
        let mut symbol = libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        for library in [c"libcudart.so.13", c"libcudart.so.12", c"libcudart.so"] {
            if !symbol.is_null() {
                break;
            }
            let handle = libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
            if !handle.is_null() {
                symbol = libc::dlsym(handle, name.as_ptr());
            }
        }
        symbol
    };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: the symbol is the CUDA runtime's cudaMemGetInfo, of this signature.
    let get: MemGetInfo = unsafe { std::mem::transmute(symbol) };
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both pointers are valid for writes.
    let status = unsafe { get(&mut free, &mut total) };
    (status == 0).then_some(free as u64)
}
