//! Megatron's Mixture-of-Experts layer, in place of a transformer layer's MLP: a router picks
//! `--moe-router-topk` of `--num-experts` expert MLPs for each token, the tokens are regrouped
//! by expert, each expert runs over its tokens, and the outputs, weighted by the router's
//! probabilities, are summed back per token; a shared expert may see every token besides.
//! Dropless: every expert takes all the tokens routed to it.

pub mod aux_loss;
pub mod config;
mod dispatch;
mod experts;
mod router;

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::mlp::Mlp;
use super::{NamedTensors, TensorParallel};
use crate::config::TransformerConfig;
use crate::param::Initializer;
use config::MoeConfig;
use dispatch::Permutation;
pub use experts::SequentialExperts;
use megatron_parallel::SingleRank;
pub use router::{Routing, TopKRouter};

#[derive(Clone)]
pub struct MoeLayer {
    pub router: TopKRouter,
    pub experts: SequentialExperts,
    /// `--moe-shared-expert-intermediate-size`: an MLP every token passes through.
    pub shared_experts: Option<Mlp>,
}

impl MoeLayer {
    /// `init` is scoped to the layer's `mlp`.
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        moe: &MoeConfig,
        output_std: f64,
        parallel: TensorParallel,
    ) -> Self {
        let sized = |ffn_hidden_size| TransformerConfig {
            ffn_hidden_size,
            ..config.clone()
        };
        // Each expert is whole on its rank (expert tensor parallelism 1).
        let whole = TensorParallel {
            group: Arc::new(SingleRank),
            sequence_parallel: false,
        };
        let expert_init = init.scope("experts.local_experts").whole();
        let expert_config = sized(moe.ffn_hidden_size);
        let local_experts = (0..moe.num_experts)
            .map(|e| {
                Mlp::new(
                    &expert_init.scope(&e.to_string()),
                    &expert_config,
                    output_std,
                    whole.clone(),
                )
            })
            .collect();
        let shared_experts = moe.shared_expert_intermediate_size.map(|size| {
            Mlp::new(
                &init.scope("shared_experts"),
                &sized(size),
                output_std,
                parallel,
            )
        });
        MoeLayer {
            router: TopKRouter::new(
                &init.scope("router"),
                moe,
                config.hidden_size,
                config.init_method_std,
            ),
            experts: SequentialExperts { local_experts },
            shared_experts,
        }
    }

    /// The layer over `hidden` `[s, b, h]`; `train` adds the router's auxiliary losses.
    pub fn forward(&self, hidden: &Tensor, train: bool) -> Result<Tensor> {
        let shape = hidden.size();
        let h = shape[2];
        let routing = self.router.forward(hidden, train)?;
        let permutation = Permutation::new(&hidden.reshape([-1, h]), &routing)?;
        let routed = permutation
            .unpermute(&self.experts.forward(&permutation)?)
            .view(shape.as_slice());
        Ok(match &self.shared_experts {
            Some(shared) => routed + shared.forward(hidden)?,
            None => routed,
        })
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.router.named_tensors(&mut out.scope("router"));
        self.experts.named_tensors(&mut out.scope("experts"));
        if let Some(shared) = &self.shared_experts {
            shared.named_tensors(&mut out.scope("shared_experts"));
        }
    }
}
