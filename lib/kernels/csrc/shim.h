// C ABI of the megatron-rs autograd shim. Tensors cross the boundary as `at::Tensor*`,
// the same representation tch-rs uses for its `C_tensor` (torch::Tensor is at::Tensor), so Rust can wrap them directly.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#include <ATen/core/Tensor.h>
typedef at::Tensor* mrs_tensor;
extern "C" {
#else
typedef void* mrs_tensor;
#endif

// Collects what a Rust callback produces: output tensors, tensors saved for backward, and an
// error message when the callback fails.
typedef struct mrs_sink mrs_sink;

enum mrs_sink_slot {
  MRS_SINK_OUTPUT = 0,  // forward outputs, or backward's gradients (one per forward input)
  MRS_SINK_SAVED = 1,   // tensors saved for backward (ctx->save_for_backward)
};

// Pushes a tensor (copied by reference count); a null tensor pushes an undefined tensor, which in
// backward means "no gradient for this input".
void mrs_sink_push(mrs_sink* sink, int slot, const mrs_tensor tensor);
void mrs_sink_set_error(mrs_sink* sink, const char* message);

// The Rust side of a custom autograd function. Tensors handed to a callback are newly
// allocated handles that the callback owns. A callback returns 0 on success; on failure it
// sets the sink's error and returns non-zero.
typedef struct {
  int (*forward)(void* state, const mrs_tensor* inputs, size_t n_inputs, mrs_sink* sink);
  int (*backward)(void* state, const mrs_tensor* grad_outputs, size_t n_grads,
                  const mrs_tensor* saved, size_t n_saved, mrs_sink* sink);
  void (*drop)(void* state);
} mrs_function_vtable;

// Every entry point returns NULL on success or a malloc'd error message that the caller frees
// with mrs_free_string.
void mrs_free_string(char* string);

// Applies a custom function. Ownership of `state` passes to the autograd graph: `vtable->drop`
// runs exactly once, when the graph node is freed (or at once if applying fails). On success
// `*outputs` is a malloc'd array of `*n_outputs` tensor handles owned by the caller; free the
// array itself with mrs_free_array.
char* mrs_function_apply(const mrs_function_vtable* vtable, void* state, const mrs_tensor* inputs,
                         size_t n_inputs, mrs_tensor** outputs, size_t* n_outputs);
void mrs_free_array(void* array);

// torch::autograd::backward with explicit output gradients (null entries = implicit ones for
// scalar outputs).
char* mrs_backward(const mrs_tensor* tensors, const mrs_tensor* grad_tensors, size_t n,
                   int retain_graph, int create_graph);

// torch::autograd::grad: writes one handle per input to `grads_out` (null where unused and
// allow_unused is set).
char* mrs_grad(const mrs_tensor* outputs, const mrs_tensor* grad_outputs, size_t n_outputs,
               const mrs_tensor* inputs, size_t n_inputs, int retain_graph, int create_graph,
               int allow_unused, mrs_tensor* grads_out);

// State of the default random generator of a device (device_index < 0: the CPU generator), as a
// uint8 tensor, and restoring it. Used to replay dropout exactly when recomputing activations.
char* mrs_rng_get_state(int device_index, mrs_tensor* state_out);
char* mrs_rng_set_state(int device_index, const mrs_tensor state);
// Reseeds the default generator of a device (device_index < 0: the CPU).
char* mrs_rng_manual_seed(int device_index, uint64_t seed);

// A generator of its own for CUDA device `device_index`, seeded with `seed` (Megatron's
// model-parallel stream); its state as a uint8 tensor, and restoring it.
typedef struct mrs_generator mrs_generator;
char* mrs_cuda_generator_new(int device_index, uint64_t seed, mrs_generator** generator_out);
char* mrs_generator_get_state(mrs_generator* generator, mrs_tensor* state_out);
char* mrs_generator_set_state(mrs_generator* generator, const mrs_tensor state);
void mrs_generator_free(mrs_generator* generator);
// Makes the default generator of CUDA device `device_index` draw from the state of `with` (the
// two then advance one state) and writes a generator holding the state it drew from before, to
// swap back. Only pointers change hands, so this is allowed while a CUDA graph captures
// (graphsafe_set_state).
char* mrs_rng_swap_default_state(int device_index, const mrs_generator* with,
                                 mrs_generator** previous_out);

// A float32 CPU tensor of N(mean, std) values drawn from a fresh generator seeded with `seed`:
// the same values on every thread, process and device for the same seed.
char* mrs_seeded_normal(const int64_t* shape, size_t ndim, double mean, double std, uint64_t seed,
                        mrs_tensor* out);

// libtorch's current CUDA stream of a device (thread-local, as in torch.cuda.current_stream), as
// its raw cudaStream_t, so that collectives launched outside libtorch (NCCL) are ordered with
// libtorch's kernels. Both go through c10's device-guard interface and need no CUDA headers.
char* mrs_current_stream(int device_index, void** stream_out);
// A copy of the CPU tensor `tensor` in page-locked memory (libtorch's caching host allocator),
// from which copies to a GPU run asynchronously.
char* mrs_pin_memory(const mrs_tensor tensor, mrs_tensor* pinned_out);
// Makes a CUDA device current on the calling thread (torch.cuda.set_device).
char* mrs_set_device(int device_index);

// A Rust callback run after a parameter's gradient was accumulated into its `.grad` (torch's
// post-accumulate-grad hook), on the autograd engine's thread, with a new handle to the
// parameter that the callback owns. `drop` runs once, when the hook is replaced or the
// parameter freed.
typedef struct {
  void (*call)(void* state, mrs_tensor parameter);
  void (*drop)(void* state);
} mrs_hook_vtable;
// Installs the hook (replacing any earlier one); ownership of `state` passes to it.
char* mrs_set_post_accumulate_grad_hook(mrs_tensor parameter, const mrs_hook_vtable* vtable,
                                        void* state);

// CUDA streams by c10's packed id, through the device-guard interface (no CUDA headers): a
// stream from libtorch's pool, the calling thread's current stream, and making a stream current
// (returning the previous one).
char* mrs_pool_stream(int device_index, int64_t* stream_id);
char* mrs_current_stream_id(int device_index, int64_t* stream_id);
char* mrs_exchange_stream(int device_index, int64_t stream_id, int64_t* previous_id);
// A CUDA event recorded now on a stream, for a wait enqueued later (`block`): work enqueued on
// the blocked stream afterwards waits for the work enqueued on the recording stream before the
// record. `destroy` frees it (CUDA keeps it alive until pending waits complete).
char* mrs_event_record(int device_index, int64_t stream_id, void** event_out);
char* mrs_event_block(int device_index, void* event, int64_t stream_id);
char* mrs_event_destroy(int device_index, void* event);
// Blocks the calling thread until the work recorded by `event` is done.
char* mrs_event_synchronize(void* event);
// `dst.copy_(src, non_blocking=true)` from a page-locked copy of the CPU tensor `src`: on a GPU
// it is queued on the current stream and the thread goes on (the page-locked block is not
// reused before the copy is done).
char* mrs_copy_from_host(mrs_tensor dst, const mrs_tensor src);

// libtorch's Kineto profiler on the calling thread (and the autograd threads it starts): CPU
// operators, plus CUDA kernels and copies when `with_cuda`. `stop` saves a Chrome trace (JSON) at
// `trace_path`.
char* mrs_profiler_start(int with_cuda, int record_shapes);
char* mrs_profiler_stop(const char* trace_path);
// cudaProfilerStart/Stop: the capture range of `nsys profile --capture-range=cudaProfilerApi`.
char* mrs_cuda_profiler_start(void);
char* mrs_cuda_profiler_stop(void);

// ATen's build configuration (compiler, CUDA, cuDNN, NCCL versions, CPU capability) as a
// malloc'd string, freed with mrs_free_string.
char* mrs_build_config(void);

// CUDA graphs (csrc/cuda_graph.cpp): capture of the calling thread's current stream, which must
// not be the default stream, between begin and end; every tensor allocated meanwhile comes from
// the graph's private memory pool, shared with `share_pool_of` when that is not NULL (graphs
// that never replay concurrently). `replay` launches the graph on the current stream.
// `available` is 0 when the shim was built without CUDA headers; then every call fails.
typedef struct mrs_cuda_graph mrs_cuda_graph;
int mrs_cuda_graphs_available(void);
char* mrs_cuda_graph_capture_begin(mrs_cuda_graph* share_pool_of, mrs_generator* const* generators,
                                   size_t n_generators, mrs_cuda_graph** graph_out);
char* mrs_cuda_graph_capture_end(mrs_cuda_graph* graph);
char* mrs_cuda_graph_replay(mrs_cuda_graph* graph);
void mrs_cuda_graph_free(mrs_cuda_graph* graph);
// Returns the caching allocator's unused blocks to the device (torch.cuda.empty_cache()).
char* mrs_cuda_empty_cache(void);
// The caching allocator's statistics of `device` as torch.cuda.memory_stats() names them, into
// out[0..4]: reserved_bytes.all.current, allocated_bytes.all.current,
// allocated_bytes.all.peak, allocation.all.current.
char* mrs_cuda_memory_stats(int device, int64_t* out);

// Multi-tensor kernels (csrc/multi_tensor.cpp). Each list argument is `n` handles.
// AdamW step with decoupled weight decay over parameters of one device and dtype; increments
// every `steps` entry (a float scalar tensor) first, as torch.optim.AdamW(fused=True) does.
// A non-null `grad_divisor` (a float scalar tensor) divides the gradients inside the same
// kernel, which is how gradient clipping costs no pass of its own.
char* mrs_fused_adamw(const mrs_tensor* params, const mrs_tensor* grads,
                      const mrs_tensor* exp_avgs, const mrs_tensor* exp_avg_sqs,
                      const mrs_tensor* steps, size_t n, double lr, double beta1, double beta2,
                      double weight_decay, double eps, const mrs_tensor grad_divisor);
// sqrt(sum of squared L2 norms) of all tensors, as a float32 scalar tensor.
char* mrs_foreach_total_norm(const mrs_tensor* tensors, size_t n, mrs_tensor* norm_out);
// tensors[i] *= factor (a scalar tensor), in place.
char* mrs_foreach_mul_(const mrs_tensor* tensors, size_t n, const mrs_tensor factor);
// targets[i] += sources[i], in place (sources are converted to the target dtype).
char* mrs_foreach_add_(const mrs_tensor* targets, const mrs_tensor* sources, size_t n);
// targets[i].copy_(sources[i]).
char* mrs_foreach_copy_(const mrs_tensor* targets, const mrs_tensor* sources, size_t n);
char* mrs_foreach_zero_(const mrs_tensor* tensors, size_t n);
// tensors[i] *= inv_scale; sets found_inf (float scalar) to 1 if any value is inf or NaN.
char* mrs_unscale_and_check_finite(const mrs_tensor* tensors, size_t n, const mrs_tensor found_inf,
                                   const mrs_tensor inv_scale);
// torch.use_deterministic_algorithms(enabled) and cuDNN's deterministic/benchmark switches.
char* mrs_set_deterministic(int enabled);

// fc1's GEMM with the bias + tanh-GeLU cuBLASLt epilogue (gemm_epilogue.cpp; bf16/fp16,
// contiguous, 16-byte aligned, widths multiples of 8). Whether this build has it:
int mrs_gemm_epilogues_available(void);
// out = gelu_tanh(input·weightᵀ + bias) and preactivation = input·weightᵀ + bias, [rows, out].
char* mrs_linear_gelu_aux(const mrs_tensor input, const mrs_tensor weight, const mrs_tensor bias,
                          mrs_tensor* out, mrs_tensor* preactivation_out);

// Flash attention over packed variable-length sequences (flash_varlen.cpp): query, key and
// value [tokens, heads, head_dim] in bf16/fp16, documents delimited by cu_seqlens (int32
// offsets, the same for queries and keys). Forward returns what backward needs again.
char* mrs_flash_varlen_forward(const mrs_tensor query, const mrs_tensor key,
                               const mrs_tensor value, const mrs_tensor cu_seqlens,
                               int64_t max_seqlen, double dropout, int causal, mrs_tensor* out,
                               mrs_tensor* logsumexp_out, mrs_tensor* rng_state_out,
                               mrs_tensor* unused_out);
char* mrs_flash_varlen_backward(const mrs_tensor grad_out, const mrs_tensor query,
                                const mrs_tensor key, const mrs_tensor value,
                                const mrs_tensor out, const mrs_tensor logsumexp,
                                const mrs_tensor cu_seqlens, int64_t max_seqlen, double dropout,
                                int causal, const mrs_tensor rng_state, const mrs_tensor unused,
                                mrs_tensor* grad_query, mrs_tensor* grad_key,
                                mrs_tensor* grad_value);

// A client of the c10d TCPStore at host:port (store.cpp): torchrun's agent store. get waits for
// the key up to the timeout given at connection; its value is malloc'd (mrs_free_array).
typedef struct mrs_store mrs_store;
char* mrs_tcp_store_connect(const char* host, uint16_t port, int64_t timeout_ms,
                            mrs_store** store_out);
char* mrs_tcp_store_set(mrs_store* store, const char* key, const uint8_t* value, size_t length);
char* mrs_tcp_store_get(mrs_store* store, const char* key, uint8_t** value_out,
                        size_t* length_out);
void mrs_tcp_store_free(mrs_store* store);

#ifdef __cplusplus
}
#endif
