//! Declarations of the C ABI in csrc/shim.h.

use std::os::raw::{c_char, c_int, c_void};
use torch_sys::C_tensor;

pub type TensorHandle = *mut C_tensor;

/// Opaque C++ collector of callback results (`mrs_sink`).
#[repr(C)]
pub struct Sink {
    _opaque: [u8; 0],
}

pub const SINK_OUTPUT: c_int = 0;
pub const SINK_SAVED: c_int = 1;

pub type ForwardCallback = unsafe extern "C" fn(
    state: *mut c_void,
    inputs: *const TensorHandle,
    n: usize,
    sink: *mut Sink,
) -> c_int;
pub type BackwardCallback = unsafe extern "C" fn(
    state: *mut c_void,
    grad_outputs: *const TensorHandle,
    n_grads: usize,
    saved: *const TensorHandle,
    n_saved: usize,
    sink: *mut Sink,
) -> c_int;
pub type DropCallback = unsafe extern "C" fn(state: *mut c_void);

#[repr(C)]
pub struct FunctionVtable {
    pub forward: ForwardCallback,
    pub backward: BackwardCallback,
    pub drop: DropCallback,
}

#[repr(C)]
pub struct HookVtable {
    pub call: unsafe extern "C" fn(state: *mut c_void, parameter: TensorHandle),
    pub drop: DropCallback,
}

/// A captured CUDA graph owned by the shim (`csrc/cuda_graph.cpp`).
#[repr(C)]
pub struct CudaGraphHandle {
    _private: [u8; 0],
}

/// A random generator owned by the shim (`csrc/generator.h`).
#[repr(C)]
pub struct GeneratorHandle {
    _private: [u8; 0],
}

/// A c10d TCPStore client (csrc/store.cpp).
#[repr(C)]
pub struct StoreHandle {
    _private: [u8; 0],
}

extern "C" {
    pub fn mrs_tcp_store_connect(
        host: *const c_char,
        port: u16,
        timeout_ms: i64,
        store_out: *mut *mut StoreHandle,
    ) -> *mut c_char;
    pub fn mrs_tcp_store_set(
        store: *mut StoreHandle,
        key: *const c_char,
        value: *const u8,
        length: usize,
    ) -> *mut c_char;
    pub fn mrs_tcp_store_get(
        store: *mut StoreHandle,
        key: *const c_char,
        value_out: *mut *mut u8,
        length_out: *mut usize,
    ) -> *mut c_char;
    pub fn mrs_tcp_store_free(store: *mut StoreHandle);
    pub fn mrs_cuda_graphs_available() -> c_int;
    pub fn mrs_cuda_graph_capture_begin(
        share_pool_of: *mut CudaGraphHandle,
        generators: *const *mut GeneratorHandle,
        n_generators: usize,
        graph_out: *mut *mut CudaGraphHandle,
    ) -> *mut c_char;
    pub fn mrs_cuda_graph_capture_end(graph: *mut CudaGraphHandle) -> *mut c_char;
    pub fn mrs_cuda_graph_replay(graph: *mut CudaGraphHandle) -> *mut c_char;
    pub fn mrs_cuda_graph_free(graph: *mut CudaGraphHandle);
    pub fn mrs_cuda_empty_cache() -> *mut c_char;
    pub fn mrs_cuda_memory_stats(device: c_int, out: *mut i64) -> *mut c_char;
    pub fn mrs_set_post_accumulate_grad_hook(
        parameter: TensorHandle,
        vtable: *const HookVtable,
        state: *mut c_void,
    ) -> *mut c_char;
    pub fn mrs_pool_stream(device_index: c_int, stream_id: *mut i64) -> *mut c_char;
    pub fn mrs_event_record(
        device_index: c_int,
        stream_id: i64,
        event_out: *mut *mut c_void,
    ) -> *mut c_char;
    pub fn mrs_event_block(device_index: c_int, event: *mut c_void, stream_id: i64) -> *mut c_char;
    pub fn mrs_event_destroy(device_index: c_int, event: *mut c_void) -> *mut c_char;
    pub fn mrs_event_synchronize(event: *mut c_void) -> *mut c_char;
    pub fn mrs_copy_from_host(dst: TensorHandle, src: TensorHandle) -> *mut c_char;
    pub fn mrs_current_stream_id(device_index: c_int, stream_id: *mut i64) -> *mut c_char;
    pub fn mrs_exchange_stream(
        device_index: c_int,
        stream_id: i64,
        previous_id: *mut i64,
    ) -> *mut c_char;
    pub fn mrs_sink_push(sink: *mut Sink, slot: c_int, tensor: TensorHandle);
    pub fn mrs_sink_set_error(sink: *mut Sink, message: *const c_char);
    pub fn mrs_free_string(string: *mut c_char);
    pub fn mrs_free_array(array: *mut c_void);
    pub fn mrs_function_apply(
        vtable: *const FunctionVtable,
        state: *mut c_void,
        inputs: *const TensorHandle,
        n_inputs: usize,
        outputs: *mut *mut TensorHandle,
        n_outputs: *mut usize,
    ) -> *mut c_char;
    pub fn mrs_backward(
        tensors: *const TensorHandle,
        grad_tensors: *const TensorHandle,
        n: usize,
        retain_graph: c_int,
        create_graph: c_int,
    ) -> *mut c_char;
    pub fn mrs_grad(
        outputs: *const TensorHandle,
        grad_outputs: *const TensorHandle,
        n_outputs: usize,
        inputs: *const TensorHandle,
        n_inputs: usize,
        retain_graph: c_int,
        create_graph: c_int,
        allow_unused: c_int,
        grads_out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_rng_get_state(device_index: c_int, state_out: *mut TensorHandle) -> *mut c_char;
    pub fn mrs_rng_set_state(device_index: c_int, state: TensorHandle) -> *mut c_char;
    pub fn mrs_rng_manual_seed(device_index: c_int, seed: u64) -> *mut c_char;
    pub fn mrs_cuda_generator_new(
        device_index: c_int,
        seed: u64,
        generator_out: *mut *mut GeneratorHandle,
    ) -> *mut c_char;
    pub fn mrs_generator_get_state(
        generator: *mut GeneratorHandle,
        state_out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_generator_set_state(
        generator: *mut GeneratorHandle,
        state: TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_generator_free(generator: *mut GeneratorHandle);
    pub fn mrs_rng_swap_default_state(
        device_index: c_int,
        with: *const GeneratorHandle,
        previous_out: *mut *mut GeneratorHandle,
    ) -> *mut c_char;
    pub fn mrs_build_config() -> *mut c_char;
    pub fn mrs_profiler_start(with_cuda: c_int, record_shapes: c_int) -> *mut c_char;
    pub fn mrs_profiler_stop(trace_path: *const c_char) -> *mut c_char;
    pub fn mrs_cuda_profiler_start() -> *mut c_char;
    pub fn mrs_cuda_profiler_stop() -> *mut c_char;
    pub fn mrs_current_stream(device_index: c_int, stream_out: *mut *mut c_void) -> *mut c_char;
    pub fn mrs_pin_memory(tensor: TensorHandle, pinned_out: *mut TensorHandle) -> *mut c_char;
    pub fn mrs_set_device(device_index: c_int) -> *mut c_char;
    pub fn mrs_seeded_normal(
        shape: *const i64,
        ndim: usize,
        mean: f64,
        std: f64,
        seed: u64,
        out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_fused_adamw(
        params: *const TensorHandle,
        grads: *const TensorHandle,
        exp_avgs: *const TensorHandle,
        exp_avg_sqs: *const TensorHandle,
        steps: *const TensorHandle,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_divisor: TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_foreach_total_norm(
        tensors: *const TensorHandle,
        n: usize,
        norm_out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_foreach_mul_(
        tensors: *const TensorHandle,
        n: usize,
        factor: TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_foreach_add_(
        targets: *const TensorHandle,
        sources: *const TensorHandle,
        n: usize,
    ) -> *mut c_char;
    pub fn mrs_foreach_copy_(
        targets: *const TensorHandle,
        sources: *const TensorHandle,
        n: usize,
    ) -> *mut c_char;
    pub fn mrs_foreach_zero_(tensors: *const TensorHandle, n: usize) -> *mut c_char;
    pub fn mrs_unscale_and_check_finite(
        tensors: *const TensorHandle,
        n: usize,
        found_inf: TensorHandle,
        inv_scale: TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_set_deterministic(enabled: c_int) -> *mut c_char;
    pub fn mrs_gemm_epilogues_available() -> c_int;
    pub fn mrs_linear_gelu_aux(
        input: TensorHandle,
        weight: TensorHandle,
        bias: TensorHandle,
        out: *mut TensorHandle,
        preactivation_out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_flash_varlen_forward(
        query: TensorHandle,
        key: TensorHandle,
        value: TensorHandle,
        cu_seqlens: TensorHandle,
        max_seqlen: i64,
        dropout: f64,
        causal: c_int,
        out: *mut TensorHandle,
        logsumexp_out: *mut TensorHandle,
        rng_state_out: *mut TensorHandle,
        unused_out: *mut TensorHandle,
    ) -> *mut c_char;
    pub fn mrs_flash_varlen_backward(
        grad_out: TensorHandle,
        query: TensorHandle,
        key: TensorHandle,
        value: TensorHandle,
        out: TensorHandle,
        logsumexp: TensorHandle,
        cu_seqlens: TensorHandle,
        max_seqlen: i64,
        dropout: f64,
        causal: c_int,
        rng_state: TensorHandle,
        unused: TensorHandle,
        grad_query: *mut TensorHandle,
        grad_key: *mut TensorHandle,
        grad_value: *mut TensorHandle,
    ) -> *mut c_char;
}

/// A borrowed tch tensor as a shim handle (the shim copies it by reference count).
pub fn handle(tensor: &tch::Tensor) -> TensorHandle {
    tensor.as_ptr() as TensorHandle
}

/// Takes ownership of handles the shim allocated for us.
///
/// # Safety
/// `handles` must point to `n` handles allocated by the shim and not owned by anyone else.
pub unsafe fn take_handles(handles: *const TensorHandle, n: usize) -> Vec<tch::Tensor> {
    (0..n)
        .map(|i| unsafe { tch::Tensor::from_ptr(*handles.add(i)) })
        .collect()
}
