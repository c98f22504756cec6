// Autograd pieces tch-rs does not expose: custom autograd functions whose forward and backward
// are Rust callbacks, backward with explicit output gradients, and generator state access.
#include "shim.h"
#include "generator.h"
#include "protect.h"

#include <ATen/CPUGeneratorImpl.h>
#include <memory>
#include <ATen/Version.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

struct mrs_sink {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> saved;
  std::string error;
};

namespace {

using mrs_detail::malloc_string;
using mrs_detail::protect;

at::Tensor from_handle(const mrs_tensor handle) {
  return handle == nullptr ? at::Tensor() : *handle;
}

std::vector<at::Tensor> from_handles(const mrs_tensor* handles, size_t n) {
  std::vector<at::Tensor> tensors;
  tensors.reserve(n);
  for (size_t i = 0; i < n; ++i) tensors.push_back(from_handle(handles[i]));
  return tensors;
}

// Handles given to a Rust callback; the callback takes ownership of every one of them.
std::vector<mrs_tensor> new_handles(const std::vector<at::Tensor>& tensors) {
  std::vector<mrs_tensor> handles;
  handles.reserve(tensors.size());
  for (const auto& t : tensors) handles.push_back(new at::Tensor(t));
  return handles;
}

// The Rust object behind one application of a custom function. The autograd node owns it
// through its context, so the Rust state lives exactly as long as the graph that may call it.
struct RustState : torch::CustomClassHolder {
  RustState(const mrs_function_vtable* vtable, void* data) : vtable(vtable), data(data) {}
  ~RustState() override { vtable->drop(data); }
  const mrs_function_vtable* vtable;
  void* data;
};

constexpr const char* kStateKey = "rust_state";
constexpr const char* kInputCountKey = "n_inputs";

struct RustFunction : public torch::autograd::Function<RustFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                const c10::intrusive_ptr<RustState>& state) {
    ctx->saved_data[kStateKey] = c10::IValue::make_capsule(state);
    ctx->saved_data[kInputCountKey] = static_cast<int64_t>(inputs.size());
    mrs_sink sink;
    auto handles = new_handles(inputs.vec());
    int rc = state->vtable->forward(state->data, handles.data(), handles.size(), &sink);
    TORCH_CHECK(rc == 0, sink.error);
    ctx->save_for_backward(sink.saved);
    return sink.outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto capsule = ctx->saved_data.at(kStateKey).toCapsule();
    auto* state = static_cast<RustState*>(capsule.get());
    auto n_inputs = static_cast<size_t>(ctx->saved_data.at(kInputCountKey).toInt());
    mrs_sink sink;
    auto grad_handles = new_handles(grad_outputs);
    auto saved_handles = new_handles(ctx->get_saved_variables());
    int rc = state->vtable->backward(state->data, grad_handles.data(), grad_handles.size(),
                                     saved_handles.data(), saved_handles.size(), &sink);
    TORCH_CHECK(rc == 0, sink.error);
    TORCH_CHECK(sink.outputs.size() == n_inputs, "custom function backward returned ",
                sink.outputs.size(), " gradients for ", n_inputs, " inputs");
    // The state argument of forward is not a tensor: its gradient slot stays undefined.
    sink.outputs.emplace_back();
    return sink.outputs;
  }
};

at::Generator default_generator(int device_index) {
  if (device_index < 0) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index)));
}

// The CUDA backend's device guard; throws when libtorch has no CUDA support.
const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

c10::Device cuda_device(int device_index) {
  TORCH_CHECK(device_index >= 0, "not a CUDA device index: ", device_index);
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace

// A post-accumulate-grad hook that calls back into Rust.
struct RustPostAccumulateGradHook : torch::autograd::PostAccumulateGradHook {
  RustPostAccumulateGradHook(mrs_hook_vtable vtable, void* state) : vtable(vtable), state(state) {}
  ~RustPostAccumulateGradHook() override { vtable.drop(state); }
  void operator()(const torch::autograd::Variable& parameter) override {
    vtable.call(state, new at::Tensor(parameter));
  }
  mrs_hook_vtable vtable;
  void* state;
};

extern "C" {

void mrs_sink_push(mrs_sink* sink, int slot, const mrs_tensor tensor) {
  auto& target = slot == MRS_SINK_SAVED ? sink->saved : sink->outputs;
  target.push_back(from_handle(tensor));
}

void mrs_sink_set_error(mrs_sink* sink, const char* message) { sink->error = message; }

void mrs_free_string(char* string) { std::free(string); }

void mrs_free_array(void* array) { std::free(array); }

char* mrs_function_apply(const mrs_function_vtable* vtable, void* state, const mrs_tensor* inputs,
                         size_t n_inputs, mrs_tensor** outputs, size_t* n_outputs) {
  // Owned from here on, so the Rust state is dropped on every path, errors included.
  auto owned = c10::make_intrusive<RustState>(vtable, state);
  return protect([&] {
    auto input_tensors = from_handles(inputs, n_inputs);
    auto results = RustFunction::apply(at::TensorList(input_tensors), owned);
    auto* array = static_cast<mrs_tensor*>(std::malloc(sizeof(mrs_tensor) * results.size()));
    for (size_t i = 0; i < results.size(); ++i) array[i] = new at::Tensor(results[i]);
    *outputs = array;
    *n_outputs = results.size();
  });
}

char* mrs_backward(const mrs_tensor* tensors, const mrs_tensor* grad_tensors, size_t n,
                   int retain_graph, int create_graph) {
  return protect([&] {
    torch::autograd::backward(from_handles(tensors, n), from_handles(grad_tensors, n),
                              retain_graph != 0, create_graph != 0);
  });
}

char* mrs_grad(const mrs_tensor* outputs, const mrs_tensor* grad_outputs, size_t n_outputs,
               const mrs_tensor* inputs, size_t n_inputs, int retain_graph, int create_graph,
               int allow_unused, mrs_tensor* grads_out) {
  return protect([&] {
    auto grads = torch::autograd::grad(from_handles(outputs, n_outputs),
                                       from_handles(inputs, n_inputs),
                                       from_handles(grad_outputs, n_outputs), retain_graph != 0,
                                       create_graph != 0, allow_unused != 0);
    for (size_t i = 0; i < n_inputs; ++i)
      grads_out[i] = grads[i].defined() ? new at::Tensor(grads[i]) : nullptr;
  });
}

char* mrs_rng_get_state(int device_index, mrs_tensor* state_out) {
  return protect([&] {
    auto generator = default_generator(device_index);
    std::lock_guard<std::mutex> lock(generator.mutex());
    *state_out = new at::Tensor(generator.get_state());
  });
}

char* mrs_rng_set_state(int device_index, const mrs_tensor state) {
  return protect([&] {
    auto generator = default_generator(device_index);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(*state);
  });
}

char* mrs_rng_manual_seed(int device_index, uint64_t seed) {
  return protect([&] {
    auto generator = default_generator(device_index);
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  });
}

char* mrs_cuda_generator_new(int device_index, uint64_t seed, mrs_generator** generator_out) {
  return protect([&] {
    TORCH_CHECK(device_index >= 0, "not a CUDA device index: ", device_index);
    auto source = default_generator(device_index);
    auto owned = std::make_unique<mrs_generator>();
    {
      std::lock_guard<std::mutex> lock(source.mutex());
      owned->generator = source.clone();
    }
    owned->generator.set_current_seed(seed);
    *generator_out = owned.release();
  });
}

char* mrs_generator_get_state(mrs_generator* generator, mrs_tensor* state_out) {
  return protect([&] {
    std::lock_guard<std::mutex> lock(generator->generator.mutex());
    *state_out = new at::Tensor(generator->generator.get_state());
  });
}

char* mrs_generator_set_state(mrs_generator* generator, const mrs_tensor state) {
  return protect([&] {
    std::lock_guard<std::mutex> lock(generator->generator.mutex());
    generator->generator.set_state(*state);
  });
}

void mrs_generator_free(mrs_generator* generator) { delete generator; }

char* mrs_rng_swap_default_state(int device_index, const mrs_generator* with,
                                 mrs_generator** previous_out) {
  return protect([&] {
    TORCH_CHECK(device_index >= 0, "not a CUDA device index: ", device_index);
    auto generator = default_generator(device_index);
    std::lock_guard<std::mutex> lock(generator.mutex());
    auto previous = std::make_unique<mrs_generator>();
    previous->generator = generator.graphsafe_get_state();
    generator.graphsafe_set_state(with->generator);
    *previous_out = previous.release();
  });
}

char* mrs_seeded_normal(const int64_t* shape, size_t ndim, double mean, double std, uint64_t seed,
                        mrs_tensor* out) {
  return protect([&] {
    auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
    std::vector<int64_t> sizes(shape, shape + ndim);
    *out = new at::Tensor(at::normal(mean, std, sizes, generator, at::TensorOptions().dtype(at::kFloat)));
  });
}

char* mrs_pin_memory(const mrs_tensor tensor, mrs_tensor* pinned_out) {
  return protect([&] { *pinned_out = new at::Tensor(tensor->pin_memory()); });
}

char* mrs_current_stream(int device_index, void** stream_out) {
  return protect([&] {
    *stream_out = cuda_guard()->getStream(cuda_device(device_index)).native_handle();
  });
}

char* mrs_set_device(int device_index) {
  return protect([&] { cuda_guard()->setDevice(cuda_device(device_index)); });
}

char* mrs_set_post_accumulate_grad_hook(mrs_tensor parameter, const mrs_hook_vtable* vtable,
                                        void* state) {
  // Owning the state before anything can throw guarantees `drop` runs exactly once.
  auto hook = std::make_unique<RustPostAccumulateGradHook>(*vtable, state);
  return protect([&] { torch::autograd::impl::set_post_acc_grad_hooks(*parameter, std::move(hook)); });
}

char* mrs_pool_stream(int device_index, int64_t* stream_id) {
  return protect([&] {
    *stream_id = cuda_guard()->getStreamFromGlobalPool(cuda_device(device_index), false).id();
  });
}

char* mrs_current_stream_id(int device_index, int64_t* stream_id) {
  return protect([&] { *stream_id = cuda_guard()->getStream(cuda_device(device_index)).id(); });
}

char* mrs_exchange_stream(int device_index, int64_t stream_id, int64_t* previous_id) {
  return protect([&] {
    auto device = cuda_device(device_index);
    c10::Stream stream = c10::Stream::unpack3(stream_id, device.index(), c10::DeviceType::CUDA);
    *previous_id = cuda_guard()->exchangeStream(stream).id();
  });
}

char* mrs_event_record(int device_index, int64_t stream_id, void** event_out) {
  return protect([&] {
    auto device = cuda_device(device_index);
    c10::Stream stream = c10::Stream::unpack3(stream_id, device.index(), c10::DeviceType::CUDA);
    void* event = nullptr;
    cuda_guard()->record(&event, stream, device.index(), c10::EventFlag::PYTORCH_DEFAULT);
    *event_out = event;
  });
}

char* mrs_event_block(int device_index, void* event, int64_t stream_id) {
  return protect([&] {
    auto device = cuda_device(device_index);
    c10::Stream stream = c10::Stream::unpack3(stream_id, device.index(), c10::DeviceType::CUDA);
    cuda_guard()->block(event, stream);
  });
}

char* mrs_event_destroy(int device_index, void* event) {
  return protect([&] { cuda_guard()->destroyEvent(event, cuda_device(device_index).index()); });
}

char* mrs_event_synchronize(void* event) {
  return protect([&] { cuda_guard()->synchronizeEvent(event); });
}

char* mrs_copy_from_host(mrs_tensor dst, const mrs_tensor src) {
  return protect([&] {
    if (dst->is_cuda()) {
      dst->copy_(src->pin_memory(), /*non_blocking=*/true);
    } else {
      dst->copy_(*src);
    }
  });
}

char* mrs_build_config(void) { return malloc_string(at::show_config()); }

}  // extern "C"
