//! CUDA graphs: a sequence of kernels captured once and replayed with one launch, for work whose
//! shapes and addresses stay the same from call to call (a decode step over a static KV cache);
//! and the caching allocator they allocate from (its cache and statistics).

use crate::autograd::ffi::{self, CudaGraphHandle};
use crate::error::check;
use crate::rng::CudaGenerator;
use crate::TorchError;

use super::CudaStream;

/// Whether this build can capture CUDA graphs (the shim was compiled against CUDA headers).
pub fn cuda_graphs_available() -> bool {
    // SAFETY: plain call.
    unsafe { ffi::mrs_cuda_graphs_available() != 0 }
}

/// Returns the unused blocks the caching allocator holds to the device, as
/// `torch.cuda.empty_cache()` does: before a capture, so that the graph's private pool does not
/// come on top of blocks that eager steps cached and will no longer use.
pub fn cuda_empty_cache() -> Result<(), TorchError> {
    // SAFETY: plain call.
    check(unsafe { ffi::mrs_cuda_empty_cache() })
}

/// The caching allocator's statistics of one device, as `torch.cuda.memory_stats()` reports
/// them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaMemoryStats {
    /// `reserved_bytes.all.current`: bytes the allocator holds from the device.
    pub reserved_bytes: i64,
    /// `allocated_bytes.all.current`: bytes in tensors now.
    pub allocated_bytes: i64,
    /// `allocated_bytes.all.peak`: the most bytes in tensors at any time.
    pub max_allocated_bytes: i64,
    /// `allocation.all.current`: live allocations.
    pub allocation_count: i64,
}

/// The caching allocator's statistics of CUDA device `device`; an error on a build without the
/// CUDA runtime headers.
pub fn cuda_memory_stats(device: usize) -> Result<CudaMemoryStats, TorchError> {
    let mut out = [0i64; 4];
    // SAFETY: `out` has the four entries the shim writes.
    check(unsafe { ffi::mrs_cuda_memory_stats(device as i32, out.as_mut_ptr()) })?;
    let [reserved_bytes, allocated_bytes, max_allocated_bytes, allocation_count] = out;
    Ok(CudaMemoryStats {
        reserved_bytes,
        allocated_bytes,
        max_allocated_bytes,
        allocation_count,
    })
}

/// A captured graph. The tensors its capture allocated live in its private memory pool; tensors
/// it reads or writes that were allocated before the capture must outlive it unchanged in place.
pub struct CudaGraph {
    handle: *mut CudaGraphHandle,
}

// SAFETY: the graph is plain device state; libtorch's CUDAGraph may be replayed from any thread.
unsafe impl Send for CudaGraph {}

impl CudaGraph {
    /// Captures the kernels `body` enqueues on `device` into a graph; nothing runs. The capture
    /// happens on a side stream ordered after the work enqueued so far. With `share_pool_of`, the
    /// new graph allocates from that graph's pool: both must never run concurrently. Kernels
    /// may draw random numbers from the default generators and from `generators` (swapped into
    /// a default one, see [`crate::rng::with_model_parallel_rng`]); each replay advances them.
    pub fn capture<T>(
        device: usize,
        share_pool_of: Option<&CudaGraph>,
        generators: &[&CudaGenerator],
        body: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<(CudaGraph, T)> {
        let current = CudaStream::current(device)?;
        let side = CudaStream::from_pool(device)?;
        side.wait_for(&current)?;
        let pool = share_pool_of.map_or(std::ptr::null_mut(), |g| g.handle);
        let generators: Vec<_> = generators.iter().map(|g| g.handle()).collect();
        let captured = side.run(|| -> anyhow::Result<(CudaGraph, T)> {
            let mut handle = std::ptr::null_mut();
            // SAFETY: the generator handles are live for the call; on success the shim writes an
            // owned graph handle.
            check(unsafe {
                ffi::mrs_cuda_graph_capture_begin(
                    pool,
                    generators.as_ptr(),
                    generators.len(),
                    &mut handle,
                )
            })?;
            let graph = CudaGraph { handle };
            let out = body();
            // The capture must end whether or not the body failed, or the stream stays capturing.
            // SAFETY: the handle is live and capturing.
            let ended = check(unsafe { ffi::mrs_cuda_graph_capture_end(graph.handle) });
            let out = out?;
            ended?;
            Ok((graph, out))
        })??;
        current.wait_for(&side)?;
        Ok(captured)
    }

    /// Launches the graph on the calling thread's current stream.
    pub fn replay(&self) -> Result<(), TorchError> {
        // SAFETY: the handle is a live, captured graph.
        check(unsafe { ffi::mrs_cuda_graph_replay(self.handle) })
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: the handle came from capture_begin and is freed once.
        unsafe { ffi::mrs_cuda_graph_free(self.handle) }
    }
}
