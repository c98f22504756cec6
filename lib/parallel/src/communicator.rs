//! The collectives model-parallel code needs, behind one trait so the same layers run over
//! NCCL, over ranks-as-threads in CPU tests, or over a single rank.

use anyhow::{ensure, Result};
use tch::{Device, Tensor};

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

    /// All-to-all with variable splits (`torch.distributed.all_to_all_single`): `input`'s rows
    /// are cut into `send_splits[r]` rows for each rank `r` of the group, and the result stacks
    /// the `recv_splits[r]` rows each rank `r` sent here, in rank order. Every rank must pass
    /// the splits its peers expect (exchange the counts first). Built on [`exchange`], so it
    /// is one grouped send/recv on NCCL; empty splits send nothing.
    fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[i64],
        recv_splits: &[i64],
    ) -> Result<Tensor> {
        let size = self.size();
        ensure!(
            send_splits.len() == size && recv_splits.len() == size,
            "all-to-all over a group of {size} given {} send and {} receive splits",
            send_splits.len(),
            recv_splits.len()
        );
        let rows = input.size().first().copied().unwrap_or(0);
        ensure!(
            send_splits.iter().sum::<i64>() == rows,
            "all-to-all send splits {send_splits:?} do not add up to the input's {rows} rows"
        );
        let mut shape = input.size();
        shape[0] = recv_splits.iter().sum();
        let output = Tensor::empty(shape.as_slice(), (input.kind(), input.device()));
        let sends = input.split_with_sizes(send_splits, 0);
        let receives = output.split_with_sizes(recv_splits, 0);
        let me = self.rank();
        let mut ops = Vec::new();
        for peer in 0..size {
            if peer == me {
                receives[peer].shallow_clone().copy_(&sends[peer]);
                continue;
            }
            if send_splits[peer] > 0 {
                ops.push(P2pOp::Send {
                    tensor: &sends[peer],
                    peer,
                });
            }
            if recv_splits[peer] > 0 {
                ops.push(P2pOp::Recv {
                    buffer: &receives[peer],
                    peer,
                });
            }
        }
        if !ops.is_empty() {
            self.exchange(&ops)?;
        }
        Ok(output)
    }
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

/// What every backend's all-to-all test checks: over a group of three, rank `r` sends
/// `(r + 2p) % 3` rows to rank `p` (zero rows to some, so some ranks receive nothing from a
/// peer), each row `[100r + 10p + i, -(100r + 10p + i)]` for its index `i`; the result must
/// stack each sender's rows in rank order.
#[cfg(test)]
pub(crate) fn check_all_to_all(group: &dyn Communicator) -> Result<()> {
    use tch::{Device, Kind};
    let (me, size) = (group.rank() as i64, group.size() as i64);
    let count = |from: i64, to: i64| (from + 2 * to) % 3;
    let rows = |from: i64, to: i64| -> Vec<f32> {
        (0..count(from, to))
            .flat_map(|i| {
                let v = (100 * from + 10 * to + i) as f32;
                [v, -v]
            })
            .collect()
    };
    let send_splits: Vec<i64> = (0..size).map(|to| count(me, to)).collect();
    let recv_splits: Vec<i64> = (0..size).map(|from| count(from, me)).collect();
    let input: Vec<f32> = (0..size).flat_map(|to| rows(me, to)).collect();
    let input = Tensor::from_slice(&input)
        .view([-1, 2])
        .to_kind(Kind::Float)
        .to_device(Device::Cpu);
    let output = group.all_to_all(&input, &send_splits, &recv_splits)?;
    let expected: Vec<f32> = (0..size).flat_map(|from| rows(from, me)).collect();
    ensure!(
        output.size() == [expected.len() as i64 / 2, 2],
        "rank {me}: shape {:?}",
        output.size()
    );
    ensure!(
        Vec::<f32>::try_from(&output.reshape([-1]))? == expected,
        "rank {me}: received {output:?}"
    );
    let wrong = group
        .all_to_all(&input, &[4, 0, 0], &recv_splits)
        .unwrap_err();
    ensure!(
        wrong.to_string().contains("do not add up"),
        "rank {me}: {wrong}"
    );
    Ok(())
}

/// Each of `flags` combined by maximum over the ranks of `group`: how ranks agree on whether any
/// of them failed or wants something before they act on it. The reduction runs on `device`, the
/// one the group's backend reduces on; a group of one returns `flags` as they are.
pub fn max_over_ranks<const N: usize>(
    group: &dyn Communicator,
    device: Device,
    flags: [f64; N],
) -> Result<[f64; N]> {
    if group.size() == 1 {
        return Ok(flags);
    }
    let on_device = Tensor::from_slice(&flags).to_device(device);
    group.all_reduce(&on_device, ReduceOp::Max)?;
    let agreed = Vec::<f64>::try_from(&on_device.to_device(Device::Cpu))?;
    Ok(std::array::from_fn(|i| agreed[i]))
}
