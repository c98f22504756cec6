// libtorch's Kineto profiler (what torch.profiler drives from Python): operators on the CPU, and on
// a CUDA build the kernels and memory copies CUPTI reports, saved as a Chrome trace.
#include "shim.h"
#include "protect.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <dlfcn.h>

#include <set>
#include <string>

using mrs_detail::protect;

namespace {

using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

ProfilerConfig trace_config(int record_shapes) {
  return ProfilerConfig(ProfilerState::KINETO, record_shapes != 0);
}

std::set<ActivityType> activities(int with_cuda) {
  std::set<ActivityType> kinds{ActivityType::CPU};
  if (with_cuda) kinds.insert(ActivityType::CUDA);
  return kinds;
}

// cudaProfilerStart/Stop of the CUDA runtime libtorch already loaded, found by name so the shim
// needs neither the runtime's headers nor a link against it.
void call_cuda_runtime(const char* name) {
  using entry_t = int (*)();
  auto entry = reinterpret_cast<entry_t>(dlsym(RTLD_DEFAULT, name));
  TORCH_CHECK(entry != nullptr, name, " not found: no CUDA runtime is loaded");
  int status = entry();
  TORCH_CHECK(status == 0, name, " failed with CUDA error ", status);
}

}  // namespace

extern "C" {

char* mrs_profiler_start(int with_cuda, int record_shapes) {
  return protect([&] {
    auto config = trace_config(record_shapes);
    auto kinds = activities(with_cuda);
    torch::autograd::profiler::prepareProfiler(config, kinds);
    torch::autograd::profiler::enableProfiler(config, kinds);
  });
}

char* mrs_profiler_stop(const char* trace_path) {
  return protect([&] {
    auto result = torch::autograd::profiler::disableProfiler();
    TORCH_CHECK(result, "the profiler was not running");
    result->save(trace_path);
  });
}

char* mrs_cuda_profiler_start(void) {
  return protect([] { call_cuda_runtime("cudaProfilerStart"); });
}

char* mrs_cuda_profiler_stop(void) {
  return protect([] { call_cuda_runtime("cudaProfilerStop"); });
}

}  // extern "C"
