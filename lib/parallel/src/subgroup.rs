//! A group of some ranks of another group, whose collectives run as point-to-point transfers
//! of the parent: how the two levels of hierarchical context parallelism (`a2a+p2p`) talk
//! without a communicator of their own per level.

use std::sync::Arc;

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

use super::communicator::{Communicator, P2pOp, ReduceOp};

/// The ranks `members` (ranks of `parent`, this rank among them) as a group of their own:
/// rank `i` of the subgroup is `members[i]` of the parent.
pub struct SubGroup {
    parent: Arc<dyn Communicator>,
    members: Vec<usize>,
    rank: usize,
    /// Where the barrier's token lives (the parent's backend may only move device tensors).
    device: Device,
}

impl SubGroup {
    pub fn new(
        parent: Arc<dyn Communicator>,
        members: Vec<usize>,
        device: Device,
    ) -> Result<SubGroup> {
        let me = parent.rank();
        let rank = members.iter().position(|&m| m == me);
        ensure!(
            members.iter().all(|&m| m < parent.size()),
            "subgroup {members:?} of a group of {}",
            parent.size()
        );
        let Some(rank) = rank else {
            anyhow::bail!("rank {me} is not a member of the subgroup {members:?}");
        };
        Ok(SubGroup {
            parent,
            members,
            rank,
            device,
        })
    }

    /// Every member's `tensor` (all the same shape), in subgroup rank order.
    fn collect(&self, tensor: &Tensor) -> Result<Vec<Tensor>> {
        let tensor = tensor.contiguous();
        let received: Vec<Tensor> = (0..self.size())
            .map(|r| {
                if r == self.rank {
                    tensor.shallow_clone()
                } else {
                    tensor.empty_like()
                }
            })
            .collect();
        let mut ops = Vec::new();
        for peer in (0..self.size()).filter(|&r| r != self.rank) {
            ops.push(P2pOp::Send {
                tensor: &tensor,
                peer,
            });
            ops.push(P2pOp::Recv {
                buffer: &received[peer],
                peer,
            });
        }
        self.exchange(&ops)?;
        Ok(received)
    }
}

fn sum_in_rank_order(all: &[Tensor]) -> Tensor {
    all[1..]
        .iter()
        .fold(all[0].shallow_clone(), |acc, t| acc + t)
}

impl Communicator for SubGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        let all = self.collect(tensor)?;
        let reduced = match op {
            ReduceOp::Sum => sum_in_rank_order(&all),
            ReduceOp::Max => all[1..]
                .iter()
                .fold(all[0].shallow_clone(), |acc, t| acc.maximum(t)),
        };
        tensor.shallow_clone().copy_(&reduced);
        Ok(())
    }

    fn all_gather(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        Ok(Tensor::cat(&self.collect(tensor)?, dim))
    }

    fn reduce_scatter(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let size = self.size() as i64;
        let length = tensor.size()[dim.rem_euclid(tensor.dim() as i64) as usize];
        ensure!(
            length % size == 0,
            "reduce_scatter: dimension {dim} of {:?} is not divisible by the group size {size}",
            tensor.size()
        );
        let parts: Vec<Tensor> = tensor
            .chunk(size, dim)
            .iter()
            .map(Tensor::contiguous)
            .collect();
        let mine = &parts[self.rank];
        let received: Vec<Tensor> = (0..self.size())
            .map(|r| {
                if r == self.rank {
                    mine.shallow_clone()
                } else {
                    mine.empty_like()
                }
            })
            .collect();
        let mut ops = Vec::new();
        for peer in (0..self.size()).filter(|&r| r != self.rank) {
            ops.push(P2pOp::Send {
                tensor: &parts[peer],
                peer,
            });
            ops.push(P2pOp::Recv {
                buffer: &received[peer],
                peer,
            });
        }
        self.exchange(&ops)?;
        Ok(sum_in_rank_order(&received))
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        ensure!(
            root < self.size(),
            "broadcast from rank {root} in a group of {}",
            self.size()
        );
        let all = self.collect(tensor)?;
        tensor.shallow_clone().copy_(&all[root]);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.collect(&Tensor::zeros([1], (Kind::Float, self.device)))?;
        Ok(())
    }

    fn exchange(&self, ops: &[P2pOp]) -> Result<()> {
        let size = self.size();
        let outside = |peer: usize| -> Result<usize> {
            ensure!(
                peer < size,
                "point-to-point with rank {peer} in a group of {size}"
            );
            Ok(self.members[peer])
        };
        let mapped = ops
            .iter()
            .map(|op| {
                Ok(match op {
                    P2pOp::Send { tensor, peer } => P2pOp::Send {
                        tensor,
                        peer: outside(*peer)?,
                    },
                    P2pOp::Recv { buffer, peer } => P2pOp::Recv {
                        buffer,
                        peer: outside(*peer)?,
                    },
                })
            })
            .collect::<Result<Vec<P2pOp>>>()?;
        self.parent.exchange(&mapped)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ThreadWorld;

    /// Over ranks {1, 3} and {0, 2} of a group of four, side by side, every collective sees
    /// only its subgroup's contributions.
    #[test]
    fn subgroups_reduce_gather_and_exchange_among_their_members() {
        let world = ThreadWorld::new(4, Duration::from_secs(30));
        world
            .run(|rank| {
                let parent = world.group("all", &[0, 1, 2, 3], rank)?;
                let members = if rank % 2 == 1 {
                    vec![3, 1]
                } else {
                    vec![0, 2]
                };
                let group = SubGroup::new(parent.clone(), members.clone(), Device::Cpu)?;
                let me = Tensor::from_slice(&[rank as f32, 10.0 * rank as f32]);
                let gathered = Vec::<f32>::try_from(&group.all_gather(&me, 0)?)?;
                let expected: Vec<f32> = members
                    .iter()
                    .flat_map(|&m| [m as f32, 10.0 * m as f32])
                    .collect();
                ensure!(gathered == expected, "rank {rank}: gathered {gathered:?}");
                let total = me.copy();
                group.all_reduce(&total, ReduceOp::Sum)?;
                let sum: f32 = members.iter().map(|&m| m as f32).sum();
                ensure!(
                    Vec::<f32>::try_from(&total)? == vec![sum, 10.0 * sum],
                    "rank {rank}: sum {total:?}"
                );
                let scattered = group.reduce_scatter(&me, 0)?;
                let slot = group.rank() as i64;
                ensure!(
                    scattered.double_value(&[0]) == f64::from(sum) * 10f64.powi(slot as i32),
                    "rank {rank}: scattered {scattered:?}"
                );
                let root = me.copy();
                group.broadcast(&root, 1)?;
                ensure!(
                    root.double_value(&[0]) == members[1] as f64,
                    "rank {rank}: broadcast {root:?}"
                );
                group.barrier()?;
                let strangers = if rank == 0 { vec![1, 2] } else { vec![0] };
                ensure!(
                    SubGroup::new(parent, strangers, Device::Cpu).is_err(),
                    "rank {rank}: a subgroup without this rank"
                );
                Ok(())
            })
            .unwrap();
    }
}
