//! The training device's BLAS set-up (cuBLAS, and MKL on the CPU) and its peak throughput.

use tch::Device;

use super::flops::peak_bf16_tflops;

/// The cuBLAS workspace libtorch gives its handles, in Megatron's (and PyTorch's) variable.
const CUBLAS_WORKSPACE: &str = "CUBLAS_WORKSPACE_CONFIG";
/// libtorch's cuBLASLt workspace (KiB), which it caps at the cuBLAS one with a warning.
const CUBLASLT_WORKSPACE: &str = "CUBLASLT_WORKSPACE_SIZE";
/// MKL's conditional numerical reproducibility branch.
const MKL_REPRODUCIBILITY: &str = "MKL_CBWR";

/// Given a workspace, cuBLAS on Hopper runs GEMM kernels that first clear a counter in it: a
/// 4-byte memset before every GEMM and, inside CUDA graphs, a dependency gap after it. Without
/// a workspace it picks statically scheduled kernels of the same tiles and speed (GPT-1.3B's
/// twelve GEMM shapes on an H100: 3,289 µs against 3,296). So unless the user chose a workspace,
/// libtorch's cuBLAS handles get none (`:0:0`, which also leaves results deterministic) and its
/// cuBLASLt calls none either (else libtorch warns that it caps theirs); set before libtorch
/// creates its first handle. Training only: its GEMMs are large, while serving's skinny decode
/// GEMMs may want a workspace for split-K reductions.
pub(crate) fn gemms_without_workspace() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(CUBLAS_WORKSPACE).is_none() {
            std::env::set_var(CUBLAS_WORKSPACE, ":0:0");
            if std::env::var_os(CUBLASLT_WORKSPACE).is_none() {
                std::env::set_var(CUBLASLT_WORKSPACE, "0");
            }
        }
    });
}

/// MKL, libtorch's CPU BLAS, splits a GEMM among its threads as their timing falls out, so on
/// a loaded machine about one run in thirty of the CPU tests' GPT with the fused cross entropy
/// took different bits at some step. Conditional numerical reproducibility (`MKL_CBWR`, read
/// when MKL starts, before the first GEMM) fixes the split; the user's own setting wins.
pub(crate) fn reproducible_cpu_gemms() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(MKL_REPRODUCIBILITY).is_none() {
            std::env::set_var(MKL_REPRODUCIBILITY, "AUTO,STRICT");
        }
    });
}

/// `MKL_CBWR` is read once, when MKL starts, and libtorch may start it before a run sets the
/// variable: a clean-clone test run still saw one resumed run of the CPU tests' GPT end one
/// step in different bits. One intra-op thread (libtorch's setting, which MKL follows at any
/// time) leaves nothing to split, so a deterministic CPU run is reproducible whatever MKL read.
pub(crate) fn single_threaded_cpu_ops() {
    tch::set_num_threads(1);
}

/// Dense bf16 peak of the device in TFLOP/s, for MFU; the name comes from `nvidia-smi`.
pub fn peak_tflops_of(device: Device) -> Option<f64> {
    let Device::Cuda(index) = device else {
        return None;
    };
    let output = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=name",
            "--format=csv,noheader",
            &format!("--id={index}"),
        ])
        .output()
        .ok()?;
    let name = String::from_utf8_lossy(&output.stdout).trim().to_string();
    peak_bf16_tflops(&name)
}
