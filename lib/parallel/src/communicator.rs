//! The collectives model-parallel code needs, behind one trait so the same layers run over
//! NCCL, over ranks-as-threads in CPU tests, or over a single rank.

use anyhow::Result;
use tch::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// One half of a point-to-point transfer; peers are ranks within the group. A receive writes
/// into `buffer`, whose shape and dtype the receiver knows in advance (as in Megatron).
pub enum P2pOp<'a> {
    Send { tensor: &'a Tensor, peer: usize },
    Recv { buffer: &'a Tensor, peer: usize },
}

/// A process group. Collectives are called by every rank of the group in the same order.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Reduces `tensor` across the group, in place.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;
    /// Concatenates every rank's `tensor` along `dim`, in rank order.
    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor>;
    /// Sums `tensor` across the group and returns this rank's `1/size` slice along `dim`.
    fn reduce_scatter(&self, tensor: &Tensor, dim: i64) -> Result<Tensor>;
    /// Overwrites `tensor` with the root rank's values.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Runs sends and receives as one batch (NCCL's grouped send/recv): it returns when all of
    /// them are done, and cannot deadlock against a peer whose batch holds the matching halves.
    fn exchange(&self, ops: &[P2pOp]) -> Result<()>;
}

/// A group of one: every collective leaves the data as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce(&self, _tensor: &Tensor, _op: ReduceOp) -> Result<()> {
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, _dim: i64) -> Result<Tensor> {
        Ok(tensor.shallow_clone())
    }

    fn reduce_scatter(&self, tensor: &Tensor, _dim: i64) -> Result<Tensor> {
        Ok(tensor.shallow_clone())
    }

    fn broadcast(&self, _tensor: &Tensor, root: usize) -> Result<()> {
        anyhow::ensure!(root == 0, "broadcast from rank {root} in a group of one");
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn exchange(&self, ops: &[P2pOp]) -> Result<()> {
        anyhow::ensure!(ops.is_empty(), "point-to-point transfer in a group of one");
        Ok(())
    }
}
