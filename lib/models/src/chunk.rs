//! What the training engine needs of a model family's pipeline chunk, whatever the family: which
//! part of the model it holds and what it does with its parameters.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use tch::Tensor;

use super::fp8::Fp8Plan;
use super::layers::{Fp8Linear, NamedParameter};
use super::options::ModelOptions;
use super::stack::ParamGate;

/// Which part of the model a chunk holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkSpec {
    /// The chunk has the embeddings (first pipeline stage, first virtual chunk).
    pub pre_process: bool,
    /// The chunk has the final norm and the output layer (last stage, last virtual chunk).
    pub post_process: bool,
    /// Global indices of its transformer layers.
    pub layers: Range<usize>,
}

impl ChunkSpec {
    pub fn whole(num_layers: usize) -> Self {
        ChunkSpec {
            pre_process: true,
            post_process: true,
            layers: 0..num_layers,
        }
    }

    /// Fails when the chunk's layers run past the model's `num_layers`.
    pub fn check_layers(&self, num_layers: usize) -> Result<()> {
        ensure!(
            self.layers.end <= num_layers,
            "chunk layers {:?} beyond --num-layers {num_layers}",
            self.layers
        );
        Ok(())
    }

    /// Fails unless the chunk is the whole model.
    pub fn check_whole(&self) -> Result<()> {
        ensure!(
            self.pre_process && self.post_process,
            "forward needs the whole model; this is a pipeline chunk"
        );
        Ok(())
    }

    /// Fails unless the chunk takes token ids (`tokens`) or hidden states (not `tokens`): only
    /// the chunk with the embeddings reads tokens.
    pub fn check_input(&self, tokens: bool) -> Result<()> {
        if tokens {
            ensure!(
                self.pre_process,
                "token input for a chunk without embeddings"
            );
        } else {
            ensure!(
                !self.pre_process,
                "hidden-state input for the chunk with the embeddings"
            );
        }
        Ok(())
    }
}

/// One pipeline chunk of a model (the whole model without pipeline parallelism).
pub trait ModelChunk: Send {
    /// Which part of the model the chunk holds.
    fn spec(&self) -> &ChunkSpec;
    fn options(&self) -> &ModelOptions;
    /// Every parameter under its Megatron-core name (layer indices local to the chunk).
    fn named_parameters(&self) -> Vec<NamedParameter>;
    /// Installs the gate the forward pass consults before each module (`--overlap-param-gather`).
    fn set_param_gate(&mut self, gate: Arc<dyn ParamGate>);
    /// Runs the transformer layers' linears that `plan` names in fp8 (`--fp8-format`).
    fn enable_fp8(&mut self, plan: &Fp8Plan) -> Result<()>;
    /// The fp8 linears under their checkpoint names (empty without fp8).
    fn fp8_linears(&self) -> Vec<(String, Arc<Fp8Linear>)>;
    /// The MoE routers' expert biases under their checkpoint names (empty without
    /// `--moe-router-enable-expert-bias`).
    fn expert_biases(&self) -> Vec<(String, crate::layers::moe::expert_bias::ExpertBias)>;
    /// The architecture, as checkpoint metadata records it.
    fn config_json(&self) -> Result<serde_json::Value>;

    /// Copies `tensors` into the parameters; see [`load_named`].
    fn load_parameters(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        load_named(&self.named_parameters(), tensors)
    }
}

/// Copies `tensors` (Megatron-core names, any float dtype) into `parameters`. Every parameter
/// must be present with its exact shape and no unknown name may remain, so a checkpoint of
/// another architecture fails loudly instead of half-loading.
pub fn load_named(parameters: &[NamedParameter], tensors: &HashMap<String, Tensor>) -> Result<()> {
    let mut unknown: Vec<&String> = tensors
        .keys()
        .filter(|k| !parameters.iter().any(|p| &p.name == *k))
        .collect();
    if !unknown.is_empty() {
        unknown.sort();
        bail!(
            "unexpected tensors for this model: {}",
            join_names(&unknown)
        );
    }
    tch::no_grad(|| -> Result<()> {
        for parameter in parameters {
            let name = &parameter.name;
            let source = tensors
                .get(name)
                .with_context(|| format!("missing tensor {name}"))?;
            ensure!(
                source.size() == parameter.tensor.size(),
                "tensor {name}: shape {:?} but the model expects {:?}",
                source.size(),
                parameter.tensor.size()
            );
            parameter.tensor.shallow_clone().copy_(source);
        }
        Ok(())
    })
}

/// Up to 8 names joined by commas, then how many more there are.
pub fn join_names(names: &[&String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names
        .iter()
        .take(SHOWN)
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}

/// Implements [`ModelChunk`] for a family's model, which has the fields `config` (serialisable),
/// `spec`, `options` and `gate` and inherent `named_parameters`, `enable_fp8` and
/// `fp8_linears`.
macro_rules! impl_model_chunk {
    ($model:ty) => {
        impl $crate::chunk::ModelChunk for $model {
            fn spec(&self) -> &$crate::ChunkSpec {
                &self.spec
            }

            fn options(&self) -> &$crate::ModelOptions {
                &self.options
            }

            fn named_parameters(&self) -> Vec<$crate::NamedParameter> {
                <$model>::named_parameters(self)
            }

            fn set_param_gate(&mut self, gate: std::sync::Arc<dyn $crate::ParamGate>) {
                self.gate.set(gate);
            }

            fn enable_fp8(&mut self, plan: &$crate::fp8::Fp8Plan) -> anyhow::Result<()> {
                <$model>::enable_fp8(self, plan)
            }

            fn fp8_linears(&self) -> Vec<(String, std::sync::Arc<$crate::layers::Fp8Linear>)> {
                <$model>::fp8_linears(self)
            }

            fn expert_biases(&self) -> Vec<(String, $crate::layers::moe::expert_bias::ExpertBias)> {
                <$model>::expert_biases(self)
            }

            fn config_json(&self) -> anyhow::Result<serde_json::Value> {
                Ok(serde_json::to_value(&self.config)?)
            }
        }
    };
}
pub(crate) use impl_model_chunk;
