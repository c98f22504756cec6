//! Linker arguments for every artifact that links libtorch: shared by lib/kernels's build script
//! (its tests and examples) and by linking_build.rs, the build script of every crate above it.

use std::path::Path;

/// Emits the link arguments for the targets of the package whose build script calls this.
///
/// * rpath (as RUNPATH, so LD_LIBRARY_PATH still wins on other machines) to the canonical
///   libtorch directory, so binaries run without any environment on the machine that built them.
/// * `libtorch_cuda` behind `--no-as-needed`: nothing references its symbols directly, so with
///   rustc's default `--as-needed` the linker drops it and CUDA is silently unavailable.
/// * `libc10_cuda`, where the shim's CUDA-graph code finds the caching allocator.
pub fn emit(libtorch_lib: &Path) {
    let canonical = libtorch_lib
        .canonicalize()
        .unwrap_or_else(|_| libtorch_lib.to_path_buf());
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", canonical.display());
    if libtorch_lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
        println!("cargo:rustc-link-arg=-lc10_cuda");
    }
}
