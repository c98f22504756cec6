//! Build script of every crate above megatron-kernels whose binaries, tests or examples link
//! libtorch (`build = "../kernels/build/linking_build.rs"` in a library,
//! `"../../lib/kernels/build/linking_build.rs"` in a binary): applies the rpath and CUDA link
//! arguments with the libtorch that megatron-kernels was built against. Such a crate depends on
//! megatron-kernels directly, which is what hands it `DEP_MEGATRON_KERNELS_LIBTORCH_LIB`.

#[path = "link_args.rs"]
mod link_args;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MEGATRON_KERNELS_LIBTORCH_LIB");
    let lib = std::env::var("DEP_MEGATRON_KERNELS_LIBTORCH_LIB")
        .expect("crates that link libtorch must depend on megatron-kernels directly");
    link_args::emit(std::path::Path::new(&lib));
}
