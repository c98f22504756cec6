//! Parallel state: the communicators of the tensor-, pipeline- and data-parallel groups a rank
//! belongs to, and the autograd regions tensor-parallel layers are built from.
//!
//! Layers only talk to a [`Communicator`]; with one rank per group every collective is the
//! identity and the regions vanish, so the single-GPU model is the tensor-parallel model at
//! `t = 1`, not a separate implementation.

mod communicator;
mod regions;

pub use communicator::{Communicator, ReduceOp, SingleRank};
pub use regions::{copy_to_tensor_parallel_region, gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region};

use std::sync::Arc;

/// The groups of one rank (Megatron's `parallel_state`).
#[derive(Clone)]
pub struct ParallelState {
    pub tensor: Arc<dyn Communicator>,
    pub pipeline: Arc<dyn Communicator>,
    pub data: Arc<dyn Communicator>,
}

impl ParallelState {
    /// One process, one GPU (or the CPU): every group has a single rank.
    pub fn single() -> Self {
        let single: Arc<dyn Communicator> = Arc::new(SingleRank);
        ParallelState { tensor: single.clone(), pipeline: single.clone(), data: single }
    }

    pub fn tensor_parallel_size(&self) -> usize {
        self.tensor.size()
    }

    pub fn tensor_parallel_rank(&self) -> usize {
        self.tensor.rank()
    }

    pub fn data_parallel_size(&self) -> usize {
        self.data.size()
    }

    pub fn world_size(&self) -> usize {
        self.tensor.size() * self.pipeline.size() * self.data.size()
    }
}
