//! LayerNorm and RMSNorm over the hidden dimension (spec §1.1 "Normalization").

use anyhow::{Context, Result};
use tch::Tensor;

use super::{NamedTensors, ParamAttributes};
use crate::config::Normalization;
use crate::param::{Initializer, MainGrad, Param};
use megatron_kernels::autograd::{self, CustomFunction, SavedTensors};
use megatron_kernels::ops::add_norm;
use megatron_kernels::ops::decode_gemv::InputNorm;

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

    /// `(residual + dropout(delta), norm(residual + dropout(delta)))`, with dropout of
    /// probability `dropout` in training only. In training on a CUDA device the dropout, the add
    /// and the norm run as one kernel, forward and backward ([`add_norm`], its mask from a hash
    /// of a seed drawn here), unless `MEGATRON_RS_FUSED_ADD_NORM=0`, the width or dtype has no
    /// kernel, or its self-check failed; otherwise as libtorch's dropout, add and norm.
    pub fn add_and_norm(
        &self,
        residual: &Tensor,
        delta: &Tensor,
        dropout: f64,
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        let kind = residual.kind();
        let hidden = self.weight.size()[0];
        let fused = train
            && [delta.kind(), self.weight.kind()] == [kind, kind]
            && self.bias.as_ref().is_none_or(|b| b.kind() == kind)
            && residual.size() == delta.size()
            && delta.device() == residual.device()
            && self.weight.device() == residual.device()
            && dropout < 1.0
            && add_norm::usable_on(residual.device(), kind, hidden);
        if !fused {
            let sum = residual + delta.dropout(dropout, train);
            let normed = self.forward(&sum);
            return Ok((sum, normed));
        }
        let dropout = if dropout > 0.0 {
            Some(add_norm::Dropout::draw(dropout, residual.device())?)
        } else {
            None
        };
        // With gradient-accumulation fusion the weight and bias gradients go straight into the
        // optimizer's float32 buffer (no bf16 gradients to accumulate, add there and zero).
        let main_grads = match (self.weight.main_grad().get(), &self.bias) {
            (Some(weight), None) => Some((weight, None)),
            (Some(weight), Some(bias)) => bias.main_grad().get().map(|b| (weight, Some(b))),
            (None, _) => None,
        };
        let function = FusedAddNorm {
            kind: self.kind,
            eps: self.eps,
            one_plus: self.one_plus,
            main_grads,
            dropout,
        };
        let mut inputs = vec![residual, delta, self.weight.tensor()];
        inputs.extend(self.bias.as_ref().map(Param::tensor));
        let mut outputs =
            autograd::apply(function, &inputs).context("the fused residual add + norm")?;
        let normed = outputs
            .pop()
            .context("the fused add + norm's normed output")?;
        let sum = outputs.pop().context("the fused add + norm's sum")?;
        Ok((sum, normed))
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
        out.push_fusable("weight", &self.weight, attributes);
        if let Some(bias) = &self.bias {
            out.push_fusable("bias", bias, attributes);
        }
    }
}

/// The residual add and the norm after it as one autograd node over [`add_norm`]'s kernels:
/// inputs `residual, delta, weight[, bias]`, outputs `sum, normed`; backward gives `residual`
/// the norm's input gradient plus the sum's, and `delta` the same (through the dropout's mask
/// and scale, with dropout).
struct FusedAddNorm {
    kind: Normalization,
    eps: f64,
    one_plus: bool,
    /// The optimizer's float32 gradients of the weight and bias, when it gave them.
    main_grads: Option<(MainGrad, Option<MainGrad>)>,
    /// The dropout of `delta` (its seed is kept here until backward).
    dropout: Option<add_norm::Dropout>,
}

impl FusedAddNorm {
    fn input_norm<'a>(&self, weight: &'a Tensor, bias: Option<&'a Tensor>) -> InputNorm<'a> {
        InputNorm {
            kind: self.kind,
            weight,
            bias,
            eps: self.eps,
            one_plus: self.one_plus,
        }
    }
}

impl CustomFunction for FusedAddNorm {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let norm = self.input_norm(&inputs[2], inputs.get(3));
        let out = add_norm::forward(&inputs[0], &inputs[1], &norm, self.dropout.clone())?;
        let kept = &out.saved;
        // The sum is an output: it is kept as a detached alias, so the saved tensor never
        // refers back to this node (no reference cycle), while in-place changes to the output
        // are still caught by the shared version counter.
        let sum = kept.sum.detach();
        for tensor in [&sum, &kept.mean, &kept.rstd]
            .into_iter()
            .chain(&inputs[2..])
        {
            saved.save(tensor);
        }
        Ok(vec![out.saved.sum, out.normed])
    }

    fn backward(
        &mut self,
        grad_outputs: &[Tensor],
        saved: &[Tensor],
    ) -> Result<Vec<Option<Tensor>>> {
        let kept = add_norm::Saved {
            sum: saved[0].shallow_clone(),
            mean: saved[1].shallow_clone(),
            rstd: saved[2].shallow_clone(),
            dropout: self.dropout.clone(),
        };
        let norm = self.input_norm(&saved[3], saved.get(4));
        if let Some((weight, bias)) = &self.main_grads {
            let main = add_norm::MainGrads {
                weight,
                bias: bias.as_deref(),
            };
            let inputs =
                add_norm::backward_into(&grad_outputs[1], &grad_outputs[0], &kept, &norm, main)?;
            weight.accumulated();
            if let Some(bias) = bias {
                bias.accumulated();
            }
            let mut out = vec![Some(inputs.residual), Some(inputs.delta), None];
            if bias.is_some() {
                out.push(None);
            }
            return Ok(out);
        }
        let grads = add_norm::backward(&grad_outputs[1], &grad_outputs[0], &kept, &norm)?;
        let mut out = vec![
            Some(grads.inputs.residual),
            Some(grads.inputs.delta),
            Some(grads.weight),
        ];
        if let Some(bias) = grads.bias {
            out.push(Some(bias));
        }
        Ok(out)
    }
}
