//! The shared expert of an MoE layer (`--moe-shared-expert-intermediate-size`): an MLP every
//! token passes through beside the routed experts, tensor-parallel like a dense MLP. With
//! `--moe-shared-expert-gate` (Qwen2-MoE's `shared_expert_gate`) its output is scaled per token
//! by `sigmoid(x · gate_weightᵀ)`, as Megatron's `SharedExpertMLP` with its gate does.

use anyhow::Result;
use tch::Tensor;

use crate::config::TransformerConfig;
use crate::layers::mlp::Mlp;
use crate::layers::{NamedTensors, ParamAttributes, TensorParallel};
use crate::param::{Initializer, Param};

#[derive(Clone)]
pub struct SharedExpert {
    pub mlp: Mlp,
    /// `[1, hidden]`: the gate's weight (`mlp.shared_experts.gate_weight`), when gated.
    pub gate_weight: Option<Param>,
    /// With sequence parallelism each tensor-parallel rank gates its part of the sequence, so
    /// the gate's gradient is summed over the group.
    sequence_parallel: bool,
}

impl SharedExpert {
    /// `init` is scoped to `mlp.shared_experts`; `config` has the shared expert's size as its
    /// `ffn_hidden_size`.
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        gated: bool,
        output_std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let sequence_parallel = parallel.sequence_parallel && parallel.group.size() > 1;
        SharedExpert {
            mlp: Mlp::new(init, config, output_std, parallel),
            gate_weight: gated.then(|| {
                init.normal(
                    "gate_weight",
                    &[1, config.hidden_size],
                    config.init_method_std,
                )
            }),
            sequence_parallel,
        }
    }

    /// The shared expert's output for `hidden` `[s, b, h]`.
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let output = self.mlp.forward(hidden)?;
        Ok(match &self.gate_weight {
            Some(weight) => {
                let gate = hidden.linear::<&Tensor>(weight, None).sigmoid();
                output * gate
            }
            None => output,
        })
    }

    /// The gate first: Megatron's module registers it before its linears.
    pub fn named_tensors(&self, out: &mut NamedTensors) {
        if let Some(weight) = &self.gate_weight {
            let attributes = ParamAttributes {
                sequence_parallel: self.sequence_parallel,
                ..ParamAttributes::REPLICATED
            };
            out.push("gate_weight", weight, attributes);
        }
        self.mlp.named_tensors(out);
    }
}
