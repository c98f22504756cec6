//! Compiles the C++ autograd shim (csrc/) against the libtorch that tch-rs links, checks that
//! libtorch is the 2.11 series, and passes its location on to binary crates.

#[path = "build/link_args.rs"]
mod link_args;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

const SUPPORTED_TORCH_SERIES: &str = "2.11.";

fn main() {
    println!("cargo:rerun-if-changed=csrc/shim.cpp");
    println!("cargo:rerun-if-changed=csrc/shim.h");
    println!("cargo:rerun-if-changed=csrc/multi_tensor.cpp");
    println!("cargo:rerun-if-changed=csrc/cuda_graph.cpp");
    println!("cargo:rerun-if-changed=csrc/gemm_epilogue.cpp");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/store.cpp");
    println!("cargo:rerun-if-changed=csrc/flash_varlen.cpp");
    println!("cargo:rerun-if-changed=csrc/protect.h");
    println!("cargo:rerun-if-changed=csrc/generator.h");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=build/link_args.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");

    let lib_dir = PathBuf::from(
        env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports the libtorch lib directory"),
    );
    let root = lib_dir
        .parent()
        .expect("libtorch lib dir has a parent")
        .to_path_buf();
    check_torch_version(&root);

    let mut build = cc::Build::new();
    match cuda_runtime_headers(&root) {
        Some(include) => {
            build.include(include).define("MRS_CUDA_GRAPHS", None);
        }
        None if lib_dir.join("libtorch_cuda.so").exists() => println!(
            "cargo:warning=no CUDA runtime headers (cuda_runtime.h, crt/host_config.h) beside {}: \
             built without CUDA graphs, so text generation decodes eagerly; scripts/setup.sh \
             installs the headers",
            root.display()
        ),
        None => {}
    }
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .define(
            "_GLIBCXX_USE_CXX11_ABI",
            env::var("LIBTORCH_CXX11_ABI")
                .unwrap_or_else(|_| "1".into())
                .as_str(),
        )
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch's headers are not warning-clean; the shim itself is small and reviewed.
        .warnings(false)
        .file("csrc/shim.cpp")
        .file("csrc/multi_tensor.cpp")
        .file("csrc/cuda_graph.cpp")
        .file("csrc/gemm_epilogue.cpp")
        .file("csrc/profiler.cpp")
        .file("csrc/store.cpp")
        .file("csrc/flash_varlen.cpp")
        .compile("megatron_shim");

    println!("cargo:libtorch_lib={}", lib_dir.display());
    link_args::emit(&lib_dir);
}

/// The include directory with the CUDA runtime headers ATen's CUDA graphs need, for a CUDA
/// build of libtorch: `$CUDA_HOME/include`, the `nvidia/cu13` wheels beside a python torch
/// (`cuda-toolkit[crt]` adds the `crt/` headers there), or /usr/local/cuda.
fn cuda_runtime_headers(root: &Path) -> Option<PathBuf> {
    if !root.join("lib/libtorch_cuda.so").exists() {
        return None;
    }
    let candidates = [
        env::var_os("CUDA_HOME").map(|home| PathBuf::from(home).join("include")),
        root.canonicalize()
            .ok()
            .and_then(|torch| Some(torch.parent()?.join("nvidia/cu13/include"))),
        Some(PathBuf::from("/usr/local/cuda/include")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|dir| dir.join("cuda_runtime.h").exists() && dir.join("crt/host_config.h").exists())
}

/// The libtorch version from a python wheel (`version.py`) or a C++ distribution
/// (`build-version`). torch-sys only checks the latter, and a mismatched libtorch otherwise
/// surfaces as hundreds of undefined symbols.
fn check_torch_version(root: &Path) {
    let version = fs::read_to_string(root.join("build-version"))
        .ok()
        .or_else(|| {
            let py = fs::read_to_string(root.join("version.py")).ok()?;
            let line = py.lines().find(|l| l.starts_with("__version__"))?;
            Some(line.split('\'').nth(1)?.to_string())
        });
    match version {
        Some(v) if v.trim().starts_with(SUPPORTED_TORCH_SERIES) => {}
        Some(v) => panic!(
            "megatron-rs needs libtorch {SUPPORTED_TORCH_SERIES}x but {} is {}; run scripts/setup.sh",
            root.display(),
            v.trim()
        ),
        None => println!(
            "cargo:warning=could not read the libtorch version under {}",
            root.display()
        ),
    }
}
