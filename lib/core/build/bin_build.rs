//! Build script of every binary crate that links libtorch (`build = "../../lib/core/build/bin_build.rs"`):
//! applies the rpath and CUDA link arguments with the libtorch that megatron-core was built against.

#[path = "link_args.rs"]
mod link_args;

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MEGATRON_CORE_LIBTORCH_LIB");
    let lib = std::env::var("DEP_MEGATRON_CORE_LIBTORCH_LIB")
        .expect("binary crates that link libtorch must depend on megatron-core");
    link_args::emit(std::path::Path::new(&lib));
}
