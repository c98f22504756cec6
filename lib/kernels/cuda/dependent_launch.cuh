// For kernels launched with `Kernels::launch_overlapping` (runtime/nvrtc.rs):
// `let_next_kernel_start()` lets the next such kernel on the stream begin (its blocks then load
// what does not depend on this kernel), and `wait_for_previous_kernel()` waits until the
// previous kernel has finished and its writes are visible. Both do nothing before Hopper.
#ifndef MEGATRON_DEPENDENT_LAUNCH_CUH
#define MEGATRON_DEPENDENT_LAUNCH_CUH

__device__ __forceinline__ void let_next_kernel_start() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

#endif  // MEGATRON_DEPENDENT_LAUNCH_CUH
