//! The persistent decode stack kernel: its source compiles with NVRTC for Ampere and Hopper (no
//! GPU needed, so a syntax error fails CI), and on a GPU it equals libtorch's unfused layers
//! (norms, linear layers, attention over the paged cache, GeLU, residual adds) for LayerNorm
//! and RMSNorm, fp32, bf16 and fp16, 1 to 8 rows, grouped heads of 64 and 128 channels, more
//! layers than one launch takes, and stores each layer's new keys and values exactly.

use megatron_core::model::config::Normalization;
use megatron_core::ops::decode_gemv::Gelu;
use megatron_core::ops::decode_stack::{compare_with_reference, MadeUpStack, StackShape, SOURCES};
use megatron_core::runtime::nvrtc::check_compiles;
use tch::{Device, Kind};

#[test]
fn the_decode_stack_kernel_compiles_for_ampere_and_hopper() {
    for arch in ["compute_80", "compute_90"] {
        for source in &SOURCES {
            check_compiles(source, arch).unwrap();
        }
    }
}

#[test]
fn on_a_gpu_the_decode_stack_equals_the_unfused_layers() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    struct Case {
        kind: Kind,
        layers: usize,
        rows: i64,
        sizes: (i64, i64),
        heads: i64,
        groups: i64,
        head_dim: i64,
        gelu: Gelu,
    }
    let cases = [
        // More layers than one launch, in fp32 where the sums' order hardly shows.
        Case {
            kind: Kind::Float,
            layers: 17,
            rows: 3,
            sizes: (256, 512),
            heads: 4,
            groups: 4,
            head_dim: 64,
            gelu: Gelu::Tanh,
        },
        Case {
            kind: Kind::BFloat16,
            layers: 3,
            rows: 1,
            sizes: (1024, 4096),
            heads: 16,
            groups: 16,
            head_dim: 64,
            gelu: Gelu::Tanh,
        },
        Case {
            kind: Kind::BFloat16,
            layers: 2,
            rows: 8,
            sizes: (512, 1536),
            heads: 8,
            groups: 2,
            head_dim: 128,
            gelu: Gelu::Erf,
        },
        Case {
            kind: Kind::Half,
            layers: 2,
            rows: 5,
            sizes: (384, 1024),
            heads: 6,
            groups: 3,
            head_dim: 64,
            gelu: Gelu::Tanh,
        },
    ];
    for case in cases {
        for norm in [Normalization::LayerNorm, Normalization::RMSNorm] {
            let made_up = MadeUpStack::new(
                cuda,
                case.kind,
                case.layers,
                case.rows,
                case.sizes,
                StackShape {
                    heads: case.heads,
                    groups: case.groups,
                    head_dim: case.head_dim,
                    gelu: case.gelu,
                },
            );
            let (excess, pools_agree) = compare_with_reference(&made_up, norm, 2.0).unwrap();
            let what = format!(
                "{:?}, {norm:?}, {} layers, {} rows, sizes {:?}, {} heads on {} groups of {}",
                case.kind,
                case.layers,
                case.rows,
                case.sizes,
                case.heads,
                case.groups,
                case.head_dim
            );
            assert!(pools_agree, "{what}: the pools differ from the reference's");
            assert_eq!(excess, 0.0, "{what}: off by {excess} beyond the tolerance");
            // The sync words are back to zero for the next step.
            assert_eq!(made_up.sync.abs().sum(Kind::Int64).int64_value(&[]), 0, "{what}");
        }
    }
}
