//! The fused decode linear kernels: on a GPU they equal libtorch's unfused math
//! (norm, linear, bias, GeLU, residual add) over K from 64 to 8192, odd N, 1 to 8 rows, fp32,
//! bf16 and fp16, each prologue and epilogue, strided and misaligned inputs; a row's result is
//! the same alone and in a batch; shapes they have no kernel for are turned away.

use megatron_kernels::ops::decode_gemv::{
    self, decode_linear, excess_difference, reference_linear, tolerance, Epilogue, Gelu, InputNorm,
};
use megatron_models::config::Normalization;
use tch::{Device, Kind, Tensor};

/// A prologue and epilogue combination of the kernels.
#[derive(Debug, Clone, Copy)]
struct Variant {
    norm: Option<Normalization>,
    one_plus: bool,
    bias: bool,
    gelu: Option<Gelu>,
    residual: bool,
}

const VARIANTS: [Variant; 6] = [
    Variant {
        norm: None,
        one_plus: false,
        bias: false,
        gelu: None,
        residual: false,
    },
    // Norm + QKV + bias; the final norm + output layer without the bias.
    Variant {
        norm: Some(Normalization::LayerNorm),
        one_plus: false,
        bias: true,
        gelu: None,
        residual: false,
    },
    // Norm + fc1 + bias + GeLU.
    Variant {
        norm: Some(Normalization::LayerNorm),
        one_plus: true,
        bias: true,
        gelu: Some(Gelu::Tanh),
        residual: false,
    },
    Variant {
        norm: Some(Normalization::RMSNorm),
        one_plus: false,
        bias: false,
        gelu: Some(Gelu::Erf),
        residual: false,
    },
    Variant {
        norm: Some(Normalization::RMSNorm),
        one_plus: true,
        bias: true,
        gelu: None,
        residual: true,
    },
    // Output projection or fc2 + bias + residual.
    Variant {
        norm: None,
        one_plus: false,
        bias: true,
        gelu: None,
        residual: true,
    },
];

/// The tensors of one case, random.
struct Case {
    input: Tensor,
    weight: Tensor,
    gamma: Tensor,
    beta: Tensor,
    bias: Tensor,
    residual: Tensor,
}

impl Case {
    fn new(rows: i64, k: i64, n: i64, kind: Kind, one_plus: bool) -> Case {
        let cuda = Device::Cuda(0);
        let random = |shape: &[i64], scale: f64| {
            (Tensor::randn(shape, (Kind::Float, cuda)) * scale).to_kind(kind)
        };
        Case {
            // Not centred and not of unit scale, so that the norm matters.
            input: (Tensor::randn([rows, k], (Kind::Float, cuda)) * 3.0 + 0.5).to_kind(kind),
            weight: random(&[n, k], 1.0 / (k as f64).sqrt()),
            gamma: random(&[k], 0.2) + if one_plus { 0.0 } else { 1.0 },
            beta: random(&[k], 0.1),
            bias: random(&[n], 0.5),
            residual: random(&[rows, n], 1.0),
        }
    }

    fn norm(&self, variant: Variant) -> Option<InputNorm<'_>> {
        variant.norm.map(|kind| InputNorm {
            kind,
            weight: &self.gamma,
            bias: (kind == Normalization::LayerNorm).then_some(&self.beta),
            eps: 1e-5,
            one_plus: variant.one_plus,
        })
    }

    fn epilogue(&self, variant: Variant) -> Epilogue<'_> {
        Epilogue {
            bias: variant.bias.then_some(&self.bias),
            gelu: variant.gelu,
            residual: variant.residual.then_some(&self.residual),
        }
    }

    /// The kernel's result on `input` (this case's, or a view of it) and the reference's.
    fn run(&self, input: &Tensor, variant: Variant) -> (Tensor, Tensor) {
        let (norm, epilogue) = (self.norm(variant), self.epilogue(variant));
        let got = decode_linear(input, &self.weight, norm.as_ref(), &epilogue).unwrap();
        let want = reference_linear(&self.input, &self.weight, norm.as_ref(), &epilogue);
        (got, want)
    }
}

#[test]
fn the_decode_linear_kernels_equal_the_unfused_layers_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    tch::manual_seed(11);
    // (K, N): the smallest K, odd K and N, GPT-345M's shapes (QKV, fc1, fc2), a wide K.
    let shapes = [
        (64, 1),
        (136, 77),
        (1024, 3072),
        (1024, 4096),
        (4096, 1024),
        (8192, 333),
    ];
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        let (absolute, relative) = tolerance(kind);
        for (k, n) in shapes {
            for rows in 1..=8 {
                for variant in VARIANTS {
                    let case = Case::new(rows, k, n, kind, variant.one_plus);
                    let (got, want) = case.run(&case.input, variant);
                    assert_eq!(got.size(), [rows, n]);
                    assert_eq!(got.kind(), kind);
                    let excess = excess_difference(&got, &want, absolute, relative);
                    assert!(
                        excess == 0.0,
                        "{kind:?}, K {k}, N {n}, {rows} rows, {variant:?}: off by {excess} \
                         beyond the tolerance"
                    );
                }
            }
        }
        decode_gemv::self_check(0, kind).unwrap();
    }
}

#[test]
fn the_decode_linear_kernels_take_strided_and_misaligned_inputs_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    tch::manual_seed(12);
    let (rows, k, n) = (3, 256, 100);
    for kind in [Kind::Float, Kind::BFloat16] {
        let (absolute, relative) = tolerance(kind);
        let case = Case::new(rows, k, n, kind, false);
        // A transposed copy's transpose (strided), and a view two bytes or more off alignment.
        let strided = case.input.tr().contiguous().tr();
        let flat = Tensor::zeros([rows * k + 1], (kind, Device::Cuda(0)));
        flat.narrow(0, 1, rows * k).copy_(&case.input.reshape([-1]));
        let misaligned = flat.narrow(0, 1, rows * k).view([rows, k]);
        for input in [strided, misaligned] {
            for variant in [VARIANTS[1], VARIANTS[5]] {
                let (got, want) = case.run(&input, variant);
                let excess = excess_difference(&got, &want, absolute, relative);
                assert!(excess == 0.0, "{kind:?}, {variant:?}: off by {excess}");
            }
        }
    }
}

/// A row's result does not depend on the rows beside it: each row of a batch of 8 equals the
/// row run alone, bit for bit (the kernel of 8 rows and the kernel of 1 sum in the same order).
#[test]
fn a_row_of_the_decode_linear_kernels_is_the_same_alone_and_batched_on_a_gpu() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device");
        return;
    }
    tch::manual_seed(13);
    let (k, n) = (1024, 1000);
    for kind in [Kind::Float, Kind::BFloat16] {
        for variant in VARIANTS {
            let case = Case::new(8, k, n, kind, variant.one_plus);
            let (norm, epilogue) = (case.norm(variant), case.epilogue(variant));
            let batched =
                decode_linear(&case.input, &case.weight, norm.as_ref(), &epilogue).unwrap();
            for (rows, start) in [(1, 0), (1, 5), (2, 6), (3, 1), (4, 4)] {
                let residual = case.residual.narrow(0, start, rows);
                let part = Epilogue {
                    residual: variant.residual.then_some(&residual),
                    ..case.epilogue(variant)
                };
                let input = case.input.narrow(0, start, rows);
                let alone = decode_linear(&input, &case.weight, norm.as_ref(), &part).unwrap();
                assert!(
                    alone.equal(&batched.narrow(0, start, rows)),
                    "{kind:?}, {variant:?}: rows {start}..{} differ alone",
                    start + rows
                );
            }
        }
    }
}

#[test]
fn shapes_the_decode_linear_kernels_do_not_take_are_turned_away() {
    let cpu = Tensor::zeros([4, 64], (Kind::Float, Device::Cpu));
    assert!(!decode_gemv::fits(1, &cpu), "CPU weights");
    if !tch::Cuda::is_available() {
        eprintln!("skipped the GPU part: no CUDA device");
        return;
    }
    let cuda = Device::Cuda(0);
    let weight = Tensor::zeros([4, 100], (Kind::BFloat16, cuda));
    assert!(
        !decode_gemv::fits(1, &weight),
        "rows of 100 bf16 are not whole 16-byte loads"
    );
    let input = Tensor::zeros([1, 100], (Kind::BFloat16, cuda));
    let error = decode_linear(&input, &weight, None, &Epilogue::default())
        .unwrap_err()
        .to_string();
    assert!(error.contains("no decode linear kernel"), "{error}");
    let weight = Tensor::zeros([4, 64], (Kind::BFloat16, cuda));
    assert!(decode_gemv::fits(8, &weight));
    assert!(!decode_gemv::fits(9, &weight), "more than 8 rows");
    assert!(!decode_gemv::fits(1, &weight.tr()), "a transposed weight");
    let input = Tensor::zeros([1, 64], (Kind::Float, cuda));
    let error = decode_linear(&input, &weight, None, &Epilogue::default())
        .unwrap_err()
        .to_string();
    assert!(error.contains("BFloat16"), "{error}");
}
