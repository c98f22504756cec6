//! Megatron's Mixture-of-Experts layer, in place of a transformer layer's MLP: a router picks
//! `--moe-router-topk` of `--num-experts` expert MLPs for each token, the tokens are regrouped
//! by expert, each expert runs over its tokens, and the outputs, weighted by the router's
//! probabilities, are summed back per token; a shared expert may see every token besides.
//! Dropless: every expert takes all the tokens routed to it. With expert parallelism each rank
//! of the expert-parallel group holds `--num-experts / --expert-model-parallel-size` of the
//! experts and the tokens travel to them ([`exchange`]).

pub mod aux_loss;
pub mod capacity;
pub mod config;
mod dispatch;
mod exchange;
pub mod expert_bias;
mod expert_stack;
mod experts;
mod grouped_gemm;
mod host_sync;
mod router;
mod shared_expert;

use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::mlp::Mlp;
use super::{NamedTensors, TensorParallel};
use crate::config::TransformerConfig;
use crate::param::Initializer;
use config::{MoeConfig, TokenDispatcher};
use dispatch::Permutation;
pub use expert_stack::GroupOrder;
pub use experts::RoutedExperts;
pub use host_sync::host_wait_reason;
use megatron_parallel::{Communicator, SingleRank};
pub use router::{Assignments, Routing, TopKRouter};
pub use shared_expert::SharedExpert;

#[derive(Clone)]
pub struct MoeLayer {
    pub router: TopKRouter,
    pub experts: RoutedExperts,
    /// `--moe-shared-expert-intermediate-size`: an MLP every token passes through.
    pub shared_experts: Option<SharedExpert>,
    /// The expert-parallel group the experts are split over.
    expert_group: Arc<dyn Communicator>,
    dispatcher: TokenDispatcher,
}

impl MoeLayer {
    /// `init` is scoped to the layer's `mlp`; this rank holds its share of the experts of
    /// `expert_group` (whose size divides `--num-experts`). Each expert is drawn under its
    /// global index, so every layout holds the same experts.
    pub fn new(
        init: &Initializer,
        config: &TransformerConfig,
        moe: &MoeConfig,
        output_std: f64,
        parallel: TensorParallel,
        expert_group: Arc<dyn Communicator>,
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
        let local = moe.num_experts / expert_group.size() as i64;
        let first = expert_group.rank() as i64 * local;
        let mut local_experts: Vec<Mlp> = (first..first + local)
            .map(|e| {
                Mlp::new(
                    &expert_init.scope(&e.to_string()),
                    &expert_config,
                    output_std,
                    whole.clone(),
                )
            })
            .collect();
        expert_stack::share_one_storage(
            &mut local_experts
                .iter_mut()
                .map(|expert| &mut expert.linear_fc1.weight)
                .collect::<Vec<_>>(),
        );
        expert_stack::share_one_storage(
            &mut local_experts
                .iter_mut()
                .map(|expert| &mut expert.linear_fc2.weight)
                .collect::<Vec<_>>(),
        );
        let router = TopKRouter::new(
            &init.scope("router"),
            moe,
            config.hidden_size,
            config.init_method_std,
            &parallel,
        );
        let shared_experts = moe.shared_expert_intermediate_size.map(|size| {
            SharedExpert::new(
                &init.scope("shared_experts"),
                &sized(size),
                moe.shared_expert_gate,
                output_std,
                parallel,
            )
        });
        MoeLayer {
            router,
            experts: RoutedExperts {
                first,
                local_experts,
                grouped_gemm: moe.grouped_gemm,
            },
            shared_experts,
            expert_group,
            dispatcher: moe.token_dispatcher,
        }
    }

    /// The layer over `hidden` `[s, b, h]` (with sequence parallelism, this rank's part of
    /// the sequence); `train` adds the router's auxiliary losses.
    pub fn forward(&self, hidden: &Tensor, train: bool) -> Result<Tensor> {
        let shape = hidden.size();
        let tokens = hidden.reshape([-1, shape[2]]);
        let routing = self.router.forward(hidden, train)?;
        let group = &self.expert_group;
        let routed = match self.dispatcher {
            _ if group.size() == 1 => {
                // Grouped GEMMs take the experts in their weights' order in memory, which the
                // sorted permutation of dropless routing follows.
                let any_order = matches!(routing.assignments, Assignments::TopK(_));
                let grouped = self.experts.grouped_weights(&tokens, any_order)?;
                let order = grouped.as_ref().map_or(GroupOrder::Ascending, |w| w.order);
                let permutation = Permutation::new(&tokens, &routing, order)?;
                let outputs = self.experts.forward_with(
                    grouped.as_ref(),
                    &permutation.tokens,
                    &permutation.probs,
                    &permutation.tokens_per_expert,
                )?;
                permutation.unpermute(&outputs)
            }
            TokenDispatcher::Alltoall => {
                exchange::all_to_all(&tokens, &routing, &self.experts, group)?
            }
            TokenDispatcher::Allgather => {
                exchange::all_gather(&tokens, &routing, &self.experts, group)?
            }
        }
        .view(shape.as_slice());
        self.plus_shared_expert(routed, hidden)
    }

    /// Inference of few tokens (a decode step, `hidden` `[1, b, h]`): every local expert runs
    /// over every token and each token's outputs are weighted by its routing probabilities,
    /// zero for the experts not chosen, so nothing waits for token counts from the device and
    /// the step can be captured in a CUDA graph; for that few tokens, reading every expert's
    /// weights is what routing costs too once the tokens spread over the experts. The same
    /// values as [`forward`](Self::forward) (an unchosen expert adds exact zeros). Experts
    /// split over expert-parallel ranks take the routed path.
    pub fn forward_every_expert(&self, hidden: &Tensor) -> Result<Tensor> {
        if self.expert_group.size() > 1 {
            return self.forward(hidden, false);
        }
        let shape = hidden.size();
        let tokens = hidden.reshape([-1, shape[2]]);
        let routing = self.router.forward(hidden, false)?;
        let mut routed = tokens.zeros_like();
        for (e, expert) in self.experts.local_experts.iter().enumerate() {
            let probs = routing.probs.select(1, self.experts.first + e as i64);
            routed += expert.forward_scaled(&tokens, &probs)?;
        }
        self.plus_shared_expert(routed.view(shape.as_slice()), hidden)
    }

    fn plus_shared_expert(&self, routed: Tensor, hidden: &Tensor) -> Result<Tensor> {
        Ok(match &self.shared_experts {
            Some(shared) => routed + shared.forward(hidden)?,
            None => routed,
        })
    }

    pub fn named_tensors(&self, out: &mut NamedTensors) {
        self.router.named_tensors(&mut out.scope("router"));
        out.experts("experts", |experts| self.experts.named_tensors(experts));
        if let Some(shared) = &self.shared_experts {
            shared.named_tensors(&mut out.scope("shared_experts"));
        }
    }
}
