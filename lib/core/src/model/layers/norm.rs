//! LayerNorm and RMSNorm over the hidden dimension (spec §1.1 "Normalization").

use tch::Tensor;

use super::{NamedTensors, ParamAttributes};
use crate::model::config::Normalization;
use crate::model::param::{Initializer, Param};
use crate::ops::decode_gemv::InputNorm;

#[derive(Clone)]
pub struct Norm {
    kind: Normalization,
    pub weight: Param,
    pub bias: Option<Param>,
    eps: f64,
    /// `--apply-layernorm-1p`: the stored weight is zero-centred, gamma = 1 + w.
    one_plus: bool,
    /// The norm runs on sequence-parallel activations: its gradients are partial sums.
    sequence_parallel: bool,
}

impl Norm {
    pub fn new(
        init: &Initializer,
        kind: Normalization,
        hidden: i64,
        eps: f64,
        one_plus: bool,
        sequence_parallel: bool,
    ) -> Self {
        let weight = init.constant(&[hidden], if one_plus { 0.0 } else { 1.0 });
        let bias = (kind == Normalization::LayerNorm).then(|| init.constant(&[hidden], 0.0));
        Norm {
            kind,
            weight,
            bias,
            eps,
            one_plus,
            sequence_parallel,
        }
    }

    pub fn forward(&self, input: &Tensor) -> Tensor {
        self.as_input_norm().apply(input)
    }

    /// This norm as the decode kernels' prologue takes it (and as plain tensor math).
    pub fn as_input_norm(&self) -> InputNorm<'_> {
        InputNorm {
            kind: self.kind,
            weight: &self.weight,
            bias: self.bias.as_deref(),
            eps: self.eps,
            one_plus: self.one_plus,
        }
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        let attributes = ParamAttributes {
            sequence_parallel: self.sequence_parallel,
            ..Default::default()
        };
        out.push("weight", &self.weight, attributes);
        if let Some(bias) = &self.bias {
            out.push("bias", bias, attributes);
        }
    }
}
