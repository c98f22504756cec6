//! LayerNorm and RMSNorm over the hidden dimension (spec §1.1 "Normalization").

use tch::{Kind, Tensor};

use super::{NamedTensors, ParamAttributes};
use crate::model::config::Normalization;
use crate::model::param::{Initializer, Param};

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
        let gamma = if self.one_plus {
            &*self.weight + 1.0
        } else {
            self.weight.shallow_clone()
        };
        let hidden = *input
            .size()
            .last()
            .expect("normalised tensors have a hidden dimension");
        match self.kind {
            Normalization::LayerNorm => {
                input.layer_norm([hidden], Some(&gamma), self.bias.as_deref(), self.eps, true)
            }
            Normalization::RMSNorm => {
                // Statistics in float32 whatever the activation dtype, as Megatron's RMSNorm.
                let x = input.to_kind(Kind::Float);
                let inv_rms = (x.square().mean_dim(-1, true, Kind::Float) + self.eps).rsqrt();
                (x * inv_rms).to_kind(input.kind()) * gamma
            }
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
