//! Every CUDA source of `lib/kernels/cuda/` compiles with NVRTC, with the headers it includes,
//! for Ampere and Hopper (no GPU needed, so a broken source or header fails CI), and every
//! `.cu` and `.cuh` file there is one of the sources or headers handed to NVRTC.

use std::collections::BTreeSet;

use megatron_kernels::ops::{
    add_norm, argmax, bias_grad, decode_attention, decode_embedding, decode_gemv, fp8_cast,
    optimizer_kernels, paged_attention, rope, softmax_cross_entropy,
};
use megatron_kernels::runtime::nvrtc::{check_compiles, KernelSource};

/// Every kernel source.
const SOURCES: [&KernelSource; 11] = [
    &add_norm::SOURCE,
    &argmax::SOURCE,
    &bias_grad::SOURCE,
    &decode_attention::SOURCE,
    &decode_embedding::SOURCE,
    &decode_gemv::SOURCE,
    &fp8_cast::SOURCE,
    &optimizer_kernels::SOURCE,
    &paged_attention::SOURCE,
    &rope::SOURCE,
    &softmax_cross_entropy::SOURCE,
];

#[test]
fn every_kernel_source_compiles_for_ampere_and_hopper() {
    std::thread::scope(|scope| {
        for source in SOURCES {
            scope.spawn(move || {
                let archs: &[&'static str] = if needs_sm89(source) {
                    &["compute_90"]
                } else {
                    &["compute_80", "compute_90"]
                };
                for &arch in archs {
                    check_compiles(source, arch)
                        .unwrap_or_else(|e| panic!("{} for {arch}: {e:#}", source.name));
                }
            });
        }
    });
}

/// Whether the source says it needs sm_89 or newer (fp8_cast's e4m3/e5m2 conversions) on a
/// line of its own, as `scripts/check_cuda_sources.sh` reads it too: then it is built for
/// Hopper alone.
fn needs_sm89(source: &KernelSource) -> bool {
    source
        .source
        .lines()
        .any(|line| line == "// requires: sm_89")
}

/// The names of the files in `lib/kernels/cuda/` that end in `extension`.
fn cuda_files(extension: &str) -> BTreeSet<String> {
    let folder = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    std::fs::read_dir(&folder)
        .unwrap_or_else(|e| panic!("{}: {e}", folder.display()))
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(extension))
        .collect()
}

#[test]
fn every_cuda_file_is_a_kernel_source_or_a_header_of_them() {
    let sources: BTreeSet<String> = SOURCES
        .iter()
        .map(|source| format!("{}.cu", source.name))
        .collect();
    assert_eq!(sources, cuda_files(".cu"));
    for source in SOURCES {
        let headers: BTreeSet<String> = source.headers.iter().map(|h| h.name.into()).collect();
        assert_eq!(
            headers,
            cuda_files(".cuh"),
            "the {} kernels' headers",
            source.name
        );
    }
}
