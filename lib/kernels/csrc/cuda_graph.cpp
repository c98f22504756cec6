// CUDA graphs through ATen's CUDAGraph: the capture allocates from a private memory pool of the
// caching allocator, so the addresses a graph replays into are never handed to other tensors.
// Compiled with MRS_CUDA_GRAPHS only when build.rs found the CUDA runtime headers next to a
// CUDA build of libtorch; otherwise every entry point reports that graphs are unavailable.
#include "shim.h"
#include "generator.h"
#include "protect.h"

using mrs_detail::protect;

#ifdef MRS_CUDA_GRAPHS

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>

struct mrs_cuda_graph {
  at::cuda::CUDAGraph graph;
};

extern "C" {

int mrs_cuda_graphs_available(void) { return 1; }

char* mrs_cuda_graph_capture_begin(mrs_cuda_graph* share_pool_of, mrs_generator* const* generators,
                                   size_t n_generators, mrs_cuda_graph** graph_out) {
  return protect([&] {
    auto owned = std::make_unique<mrs_cuda_graph>();
    // The default generators register themselves; others whose state kernels draw from while
    // the default generator is swapped to it (the model-parallel stream) must be registered so
    // that each replay advances their offsets.
    for (size_t i = 0; i < n_generators; ++i) {
      owned->graph.register_generator_state(generators[i]->generator);
    }
    decltype(owned->graph.pool()) pool{0, 0};
    if (share_pool_of != nullptr) pool = share_pool_of->graph.pool();
    // Thread-local mode: other threads (HTTP workers, the rendezvous watchdog) may go on making
    // calls that the global mode forbids while any stream captures.
    owned->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    *graph_out = owned.release();
  });
}

char* mrs_cuda_graph_capture_end(mrs_cuda_graph* graph) {
  return protect([&] { graph->graph.capture_end(); });
}

char* mrs_cuda_graph_replay(mrs_cuda_graph* graph) {
  return protect([&] { graph->graph.replay(); });
}

void mrs_cuda_graph_free(mrs_cuda_graph* graph) { delete graph; }

char* mrs_cuda_empty_cache(void) {
  return protect([] { c10::cuda::CUDACachingAllocator::emptyCache(); });
}

char* mrs_cuda_memory_stats(int device, int64_t* out) {
  return protect([&] {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
        static_cast<c10::DeviceIndex>(device));
    constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.reserved_bytes[all].current;
    out[1] = stats.allocated_bytes[all].current;
    out[2] = stats.allocated_bytes[all].peak;
    out[3] = stats.allocation[all].current;
  });
}

}  // extern "C"

#else

#include <stdexcept>

struct mrs_cuda_graph {};

namespace {

char* unavailable() {
  return protect([] {
    throw std::runtime_error(
        "this build of megatron-rs has no CUDA graphs: its build found no CUDA runtime headers "
        "(cuda_runtime.h with crt/host_config.h) beside a CUDA libtorch; scripts/setup.sh "
        "installs them into the project venv");
  });
}

}  // namespace

extern "C" {

int mrs_cuda_graphs_available(void) { return 0; }

char* mrs_cuda_graph_capture_begin(mrs_cuda_graph*, mrs_generator* const*, size_t,
                                   mrs_cuda_graph**) {
  return unavailable();
}

char* mrs_cuda_graph_capture_end(mrs_cuda_graph*) { return unavailable(); }

char* mrs_cuda_graph_replay(mrs_cuda_graph*) { return unavailable(); }

void mrs_cuda_graph_free(mrs_cuda_graph* graph) { delete graph; }

char* mrs_cuda_empty_cache(void) { return unavailable(); }

char* mrs_cuda_memory_stats(int, int64_t*) { return unavailable(); }

}  // extern "C"

#endif
