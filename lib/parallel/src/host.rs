//! Collectives computed on the host from every rank's whole contribution. Both CPU backends
//! (ranks as threads, ranks as processes over TCP) only move tensors; the arithmetic lives
//! here once, reducing in rank order so every rank gets bit-identical results.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::communicator::{Communicator, P2pOp, ReduceOp};

/// Moves CPU tensors between the ranks of one group.
pub(crate) trait HostTransport: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// The group's name in error messages.
    fn label(&self) -> &str;
    /// Every rank's contribution to `operation`, in rank order; all ranks call it, and a rank
    /// calling a different operation is an error.
    fn collect(&self, operation: String, contribution: Tensor) -> Result<Vec<Tensor>>;
    /// Queues `tensor` for `peer` without waiting for it to be received.
    fn send(&self, peer: usize, tensor: Tensor) -> Result<()>;
    /// The next tensor `peer` sent this rank.
    fn recv(&self, peer: usize) -> Result<Tensor>;
}

/// A [`Communicator`] over a [`HostTransport`].
pub(crate) struct HostCollectives<T>(pub T);

/// A private CPU copy (contributions must not change after they are handed over).
pub(crate) fn host_copy(tensor: &Tensor) -> Tensor {
    tensor.to_device(Device::Cpu).copy()
}

fn write_into(target: &Tensor, value: &Tensor) {
    target.shallow_clone().copy_(value);
}

fn sum_in_rank_order(all: &[Tensor]) -> Tensor {
    all[1..]
        .iter()
        .fold(all[0].shallow_clone(), |acc, t| acc + t)
}

impl<T: HostTransport> Communicator for HostCollectives<T> {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let all = self.0.collect(
            format!("all_reduce({op:?}, {:?})", tensor.size()),
            host_copy(tensor),
        )?;
        let reduced = match op {
            ReduceOp::Sum => sum_in_rank_order(&all),
            ReduceOp::Max => all[1..]
                .iter()
                .fold(all[0].shallow_clone(), |acc, t| acc.maximum(t)),
        };
        write_into(tensor, &reduced);
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let all = self
            .0
            .collect(format!("all_gather(dim {dim})"), host_copy(tensor))?;
        Ok(Tensor::cat(&all, dim).to_device(tensor.device()))
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let size = tensor.size();
        let dim_index = if dim < 0 {
            size.len() as i64 + dim
        } else {
            dim
        } as usize;
        let group = self.size() as i64;
        ensure!(
            size[dim_index] % group == 0,
            "reduce_scatter: dimension {dim} of {size:?} is not divisible by the group size {group}"
        );
        let all = self.0.collect(
            format!("reduce_scatter({size:?}, dim {dim})"),
            host_copy(tensor),
        )?;
        let width = size[dim_index] / group;
        Ok(sum_in_rank_order(&all)
            .narrow(dim, self.rank() as i64 * width, width)
            .contiguous()
            .to_device(tensor.device()))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        ensure!(
            root < self.size(),
            "broadcast from rank {root} in a group of {}",
            self.size()
        );
        let all = self
            .0
            .collect(format!("broadcast(root {root})"), host_copy(tensor))?;
        write_into(tensor, &all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.0.collect(
            "barrier".into(),
            Tensor::zeros([0], (Kind::Float, Device::Cpu)),
        )?;
        Ok(())
    }

    fn exchange(&self, ops: &[P2pOp]) -> Result<()> {
        let size = self.size();
        for op in ops {
            if let P2pOp::Send { tensor, peer } = op {
                ensure!(*peer < size, "send to rank {peer} in a group of {size}");
                self.0.send(*peer, host_copy(tensor))?;
            }
        }
        for op in ops {
            if let P2pOp::Recv { buffer, peer } = op {
                ensure!(
                    *peer < size,
                    "receive from rank {peer} in a group of {size}"
                );
                let message = self.0.recv(*peer)?;
                ensure!(
                    message.size() == buffer.size(),
                    "{} group: rank {peer} sent shape {:?} but shape {:?} was expected",
                    self.0.label(),
                    message.size(),
                    buffer.size()
                );
                write_into(buffer, &message);
            }
        }
        Ok(())
    }
}
