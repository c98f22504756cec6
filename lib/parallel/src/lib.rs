//! Parallel state: the communicators of the tensor-, pipeline- and data-parallel groups a rank
//! belongs to, and the autograd regions tensor-parallel layers are built from.
//!
//! Layers only talk to a [`Communicator`]; with one rank per group every collective is the
//! identity and the regions vanish, so the single-GPU model is the tensor-parallel model at
//! `t = 1`, not a separate implementation.

mod address;
mod communicator;
mod host;
mod job;
mod launch;
mod layout;
mod nccl;
mod placement;
mod regions;
mod rendezvous;
mod subgroup;
mod tcp;
mod threads;

pub use address::{choose_address, InterfaceAddress};
pub use communicator::{max_over_ranks, Communicator, P2pOp, ReduceOp, SingleRank};
pub use job::{Backend, Job};
pub use launch::{
    first_host, tasks_on_node, LaunchEnv, NodePlace, RendezvousPlace, DEFAULT_MASTER_PORT,
};
pub use layout::{Coordinates, GroupKind, ParallelLayout};
pub use nccl::NcclCommunicator;
pub use placement::{join_launched_job, JoinOptions, Placement};
pub use regions::{
    all_to_all_region, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
};
pub use rendezvous::Rendezvous;
pub use subgroup::SubGroup;
pub use tcp::TcpMesh;
pub use threads::ThreadWorld;

use std::sync::Arc;

use anyhow::Result;

/// The groups of one rank (Megatron's `parallel_state`).
#[derive(Clone)]
pub struct ParallelState {
    pub layout: ParallelLayout,
    /// This rank's index in the world.
    pub rank: usize,
    pub tensor: Arc<dyn Communicator>,
    pub pipeline: Arc<dyn Communicator>,
    /// The ranks reading different samples.
    pub data: Arc<dyn Communicator>,
    /// The ranks splitting the same samples' sequences (`--context-parallel-size`).
    pub context: Arc<dyn Communicator>,
    /// Data × context: gradients are averaged and the distributed optimizer sharded over it.
    pub data_with_context: Arc<dyn Communicator>,
    /// Tensor × pipeline: reductions over one model replica (gradient norm, overflow flag).
    pub model: Arc<dyn Communicator>,
    /// First and last pipeline stage, for the tied word embeddings.
    pub embedding: Arc<dyn Communicator>,
    /// The ranks splitting the experts of Mixture-of-Experts layers (`--expert-model-parallel-size`).
    pub expert: Arc<dyn Communicator>,
    /// The ranks holding the same experts: their gradients' data-parallel group.
    pub expert_data: Arc<dyn Communicator>,
    /// Expert × pipeline: one replica of the experts (their share of the gradient norm).
    pub expert_model: Arc<dyn Communicator>,
    pub world: Arc<dyn Communicator>,
    /// `--sequence-parallel` (only meaningful with tensor parallelism).
    pub sequence_parallel: bool,
}

impl ParallelState {
    /// One process, one GPU (or the CPU): every group has a single rank.
    pub fn single() -> Self {
        let single: Arc<dyn Communicator> = Arc::new(SingleRank);
        ParallelState {
            layout: ParallelLayout::single(),
            rank: 0,
            tensor: single.clone(),
            pipeline: single.clone(),
            data: single.clone(),
            context: single.clone(),
            data_with_context: single.clone(),
            model: single.clone(),
            embedding: single.clone(),
            expert: single.clone(),
            expert_data: single.clone(),
            expert_model: single.clone(),
            world: single,
            sequence_parallel: false,
        }
    }

    /// The state of `rank` in `layout`, with each group's communicator made by `group`
    /// (called with the group's kind and its world ranks, in the same order on every rank, for
    /// groups of more than one rank).
    pub fn build(
        layout: ParallelLayout,
        rank: usize,
        sequence_parallel: bool,
        mut group: impl FnMut(GroupKind, &[usize]) -> Result<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        // A group of one needs no backend: every collective is the identity. A model without
        // Mixture-of-Experts layers has no expert groups.
        let mut make = |kind: GroupKind| -> Result<Arc<dyn Communicator>> {
            let members = layout.group(kind, rank);
            let expert = matches!(
                kind,
                GroupKind::Expert | GroupKind::ExpertData | GroupKind::ExpertModel
            );
            if members.len() == 1 || (expert && layout.expert.is_none()) {
                return Ok(Arc::new(SingleRank));
            }
            group(kind, &members)
        };
        Ok(ParallelState {
            layout,
            rank,
            tensor: make(GroupKind::Tensor)?,
            pipeline: make(GroupKind::Pipeline)?,
            data: make(GroupKind::Data)?,
            context: make(GroupKind::Context)?,
            data_with_context: make(GroupKind::DataWithContext)?,
            model: make(GroupKind::Model)?,
            embedding: make(GroupKind::Embedding)?,
            expert: make(GroupKind::Expert)?,
            expert_data: make(GroupKind::ExpertData)?,
            expert_model: make(GroupKind::ExpertModel)?,
            world: make(GroupKind::World)?,
            sequence_parallel: sequence_parallel && layout.tensor > 1,
        })
    }

    /// The state of `rank` in a world of threads.
    pub fn threads(
        world: &ThreadWorld,
        layout: ParallelLayout,
        rank: usize,
        sequence_parallel: bool,
    ) -> Result<Self> {
        Self::build(layout, rank, sequence_parallel, |kind, members| {
            world.group(kind.name(), members, rank)
        })
    }

    pub fn coordinates(&self) -> Coordinates {
        self.layout.coordinates(self.rank)
    }

    pub fn tensor_parallel_size(&self) -> usize {
        self.tensor.size()
    }

    pub fn tensor_parallel_rank(&self) -> usize {
        self.tensor.rank()
    }

    pub fn pipeline_parallel_size(&self) -> usize {
        self.pipeline.size()
    }

    pub fn pipeline_parallel_rank(&self) -> usize {
        self.pipeline.rank()
    }

    pub fn is_first_stage(&self) -> bool {
        self.pipeline.rank() == 0
    }

    pub fn is_last_stage(&self) -> bool {
        self.pipeline.rank() + 1 == self.pipeline.size()
    }

    pub fn data_parallel_size(&self) -> usize {
        self.data.size()
    }

    /// This state as the gradients see it: its data-parallel group is data × context, since
    /// every context-parallel rank holds a part of each sample's gradient.
    pub fn for_gradients(&self) -> ParallelState {
        ParallelState {
            data: self.data_with_context.clone(),
            ..self.clone()
        }
    }

    pub fn world_size(&self) -> usize {
        self.layout.world_size
    }

    /// Megatron prints the training log on the last rank (last stage, which has the loss).
    pub fn is_logging_rank(&self) -> bool {
        self.rank + 1 == self.world_size()
    }
}
