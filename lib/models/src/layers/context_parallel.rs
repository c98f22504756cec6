//! Context parallelism's attention (`--context-parallel-size`, `--cp-comm-type`), without
//! Transformer Engine: each rank of a context-parallel group holds two of the sequence's 2·CP
//! chunks (rank r chunks r and 2·CP−1−r, Megatron's load balancing: every rank gets as much
//! causal work) and attends to the keys and values of all of them.
//!
//! - [`ContextExchange::Ring`] (`p2p`) passes keys and values around the ring; each step's
//!   partial attention comes with its log-sum-exp, and the partials are merged by it. Of each
//!   pair of chunks only the blocks the causal mask leaves are computed: the rank's own block
//!   causally, earlier ranks' first chunk in full for both query chunks, later ranks' chunks in
//!   full for the second query chunk only. The merge is written with differentiable tensor ops,
//!   and the ring's shift is an autograd node whose backward passes the key and value gradients
//!   back around the ring.
//! - [`ContextExchange::AllGather`] gathers every rank's keys and values (their gradients
//!   reduce-scattered in backward) and attends under a mask of the original positions.
//! - [`ContextExchange::AllToAll`] (Ulysses) trades heads for sequence before attention and back
//!   after it, so each rank attends over the whole sequence for `heads / CP` heads.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use megatron_kernels::autograd::{apply, CustomFunction, SavedTensors};
use megatron_parallel::{gather_from_sequence_parallel_region, Communicator, P2pOp};

/// How the ranks of a context-parallel group share keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextExchange {
    /// `--cp-comm-type p2p`.
    Ring,
    /// `--cp-comm-type allgather`.
    AllGather,
    /// `--cp-comm-type a2a`.
    AllToAll,
}

/// A context-parallel group and how it exchanges keys and values.
#[derive(Clone)]
pub struct ContextParallel {
    pub group: Arc<dyn Communicator>,
    pub exchange: ContextExchange,
}

impl ContextParallel {
    fn size(&self) -> i64 {
        self.group.size() as i64
    }

    /// The original positions of `rank`'s `local` tokens: chunk `rank`, then chunk
    /// `2·CP − 1 − rank`, of `local / 2` positions each.
    fn positions_of(&self, rank: i64, local: i64) -> Vec<i64> {
        let chunk = local / 2;
        let mirror = 2 * self.size() - 1 - rank;
        (rank * chunk..(rank + 1) * chunk)
            .chain(mirror * chunk..(mirror + 1) * chunk)
            .collect()
    }

    /// This rank's original positions of its `local` tokens, `[local]` int64 on `device`
    /// (for rotary embeddings).
    pub fn positions(&self, local: i64, device: Device) -> Tensor {
        Tensor::from_slice(&self.positions_of(self.group.rank() as i64, local)).to_device(device)
    }

    /// Every rank's positions in rank order: the order of keys and values gathered along the
    /// sequence.
    fn gathered_positions(&self, local: i64, device: Device) -> Tensor {
        let all: Vec<i64> = (0..self.size())
            .flat_map(|rank| self.positions_of(rank, local))
            .collect();
        Tensor::from_slice(&all).to_device(device)
    }

    /// This rank's two chunks of the whole sequences in `tensor` along `dim`.
    pub fn keep_local_chunks(&self, tensor: &Tensor, dim: i64) -> Result<Tensor> {
        let length = tensor.size()[dim as usize];
        let chunks = 2 * self.size();
        ensure!(
            length % chunks == 0,
            "context parallelism: the sequence length {length} is not divisible by 2 × \
             --context-parallel-size {} = {chunks}",
            self.size()
        );
        let index = self.positions(length / self.size(), tensor.device());
        Ok(tensor.index_select(dim, &index))
    }

    /// Causal attention of this rank's `query` (`[b, n, s, d]`, the rank's two chunks) over the
    /// whole sequence, whose keys and values (`[b, n, s, d]`, every query head's) are spread
    /// over the group as the queries are, with `dropout` on the attention probabilities.
    /// Returns `[b, n, s, d]`.
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        match self.exchange {
            ContextExchange::Ring => self.attend_ring(query, key, value, dropout),
            ContextExchange::AllGather => self.attend_gathered(query, key, value, dropout),
            ContextExchange::AllToAll => self.attend_all_to_all(query, key, value, dropout),
        }
        .context("context-parallel attention")
    }

    fn attend_ring(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let (size, rank) = (self.size(), self.group.rank() as i64);
        let local = query.size()[2];
        let chunk = local / 2;
        let positions = self.positions(local, query.device());
        let own = positions.unsqueeze(0).le_tensor(&positions.unsqueeze(1));
        let second_queries = query.narrow(2, chunk, chunk);
        // Each query chunk's partial results (output, log-sum-exp).
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let mut keys_values = Tensor::stack(&[key, value], 0);
        for step in 0..size {
            if step > 0 {
                keys_values = ring_shift(&keys_values, &self.group)?;
            }
            let source = (rank + size - step) % size;
            let (key, value) = (keys_values.get(0), keys_values.get(1));
            if source == rank || source < rank {
                let (key, value, mask) = if source == rank {
                    (key, value, Some(&own))
                } else {
                    // An earlier rank: its first chunk precedes both query chunks, its second
                    // follows them.
                    (key.narrow(2, 0, chunk), value.narrow(2, 0, chunk), None)
                };
                let (output, lse) = attention_block(query, &key, &value, mask, dropout);
                first.push((output.narrow(2, 0, chunk), lse.narrow(2, 0, chunk)));
                second.push((output.narrow(2, chunk, chunk), lse.narrow(2, chunk, chunk)));
            } else {
                // A later rank: both its chunks follow the first query chunk and precede the
                // second.
                second.push(attention_block(
                    &second_queries,
                    &key,
                    &value,
                    None,
                    dropout,
                ));
            }
        }
        let output = Tensor::cat(&[merge(first), merge(second)], 2);
        Ok(output.to_kind(query.kind()))
    }

    fn attend_gathered(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let gather = |t: &Tensor| -> Result<Tensor> {
            // Along the sequence, which the region gathers as dimension 0; the backward
            // reduce-scatters, since every rank's queries reach every key.
            let gathered =
                gather_from_sequence_parallel_region(&t.permute([2, 0, 1, 3]), &self.group, true)?;
            Ok(gathered.permute([1, 2, 0, 3]))
        };
        let (keys, values) = (gather(key)?, gather(value)?);
        let local = query.size()[2];
        let allowed = self
            .gathered_positions(local, query.device())
            .unsqueeze(0)
            .le_tensor(&self.positions(local, query.device()).unsqueeze(1));
        Ok(masked_attention(query, &keys, &values, &allowed, dropout))
    }

    fn attend_all_to_all(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let heads = query.size()[1];
        ensure!(
            heads % self.size() == 0,
            "--cp-comm-type a2a: the {heads} attention heads of a tensor-parallel rank are not \
             divisible by --context-parallel-size {}",
            self.size()
        );
        // [b, n, s, d] → [b, n/CP, CP·s, d] and back.
        let to_heads = |t: &Tensor| self.redistribute(t, 2, 1);
        let (query_all, key_all, value_all) = (to_heads(query)?, to_heads(key)?, to_heads(value)?);
        let positions = self.gathered_positions(query.size()[2], query.device());
        let allowed = positions.unsqueeze(0).le_tensor(&positions.unsqueeze(1));
        let output = masked_attention(&query_all, &key_all, &value_all, &allowed, dropout);
        self.redistribute(&output, 1, 2)
    }

    /// Gathers `tensor` along `gather` from the group and keeps this rank's share of `keep`.
    fn redistribute(&self, tensor: &Tensor, gather: i64, keep: i64) -> Result<Tensor> {
        let function = Redistribute {
            group: self.group.clone(),
            gather,
            keep,
        };
        Ok(apply(function, &[tensor])?.remove(0))
    }
}

/// Attention of `query` over `key`/`value` where `allowed` (`[queries, keys]`, `true` = may
/// attend) says, through libtorch's fused attention.
fn masked_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    allowed: &Tensor,
    dropout: f64,
) -> Tensor {
    Tensor::scaled_dot_product_attention(
        query,
        key,
        value,
        Some(allowed),
        dropout,
        false,
        None,
        false,
    )
}

/// Softmax attention of `query` over `key`/`value` (`allowed` as in [`masked_attention`], every
/// query row allowing at least one key) in float32, with each query's log-sum-exp of its scaled
/// scores (`[b, n, q, 1]`), so that partial results over different keys can be merged.
/// Dropout applies to the block's probabilities: the merge only rescales them, so dropping
/// them before or after it is the same.
fn attention_block(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    allowed: Option<&Tensor>,
    dropout: f64,
) -> (Tensor, Tensor) {
    let scale = 1.0 / (query.size()[3] as f64).sqrt();
    let scores = query
        .to_kind(Kind::Float)
        .matmul(&key.to_kind(Kind::Float).transpose(-2, -1))
        * scale;
    let scores = match allowed {
        Some(allowed) => scores.masked_fill(&allowed.logical_not(), f64::NEG_INFINITY),
        None => scores,
    };
    let lse = scores.logsumexp([-1], true);
    let probabilities = (scores - &lse).exp();
    let probabilities = if dropout > 0.0 {
        probabilities.dropout(dropout, true)
    } else {
        probabilities
    };
    let output = probabilities.matmul(&value.to_kind(Kind::Float));
    (output, lse)
}

/// The attention over the union of the partials' keys: each partial weighted by its share of
/// the total softmax mass, `exp(lse_i − lse)`.
fn merge(partials: Vec<(Tensor, Tensor)>) -> Tensor {
    if partials.len() == 1 {
        return partials.into_iter().next().expect("one partial").0;
    }
    let lses: Vec<&Tensor> = partials.iter().map(|(_, lse)| lse).collect();
    let total = Tensor::stack(&lses, 0).logsumexp([0], false);
    partials
        .iter()
        .map(|(output, lse)| output * (lse - &total).exp())
        .reduce(|a, b| a + b)
        .expect("partials")
}

/// Sends `tensor` to the next rank of the ring and returns the previous rank's; the gradient
/// goes the other way.
fn ring_shift(tensor: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    let function = RingShift {
        group: group.clone(),
        shape: tensor.size(),
        options: (tensor.kind(), tensor.device()),
    };
    Ok(apply(function, &[tensor])?.remove(0))
}

struct RingShift {
    group: Arc<dyn Communicator>,
    shape: Vec<i64>,
    options: (Kind, Device),
}

impl RingShift {
    /// Sends `tensor` `ahead` ranks on and returns what the rank as far behind sent.
    fn pass(&self, tensor: &Tensor, ahead: usize) -> Result<Tensor> {
        let (rank, size) = (self.group.rank(), self.group.size());
        let to = (rank + ahead) % size;
        let from = (rank + size - ahead % size) % size;
        let tensor = tensor.contiguous();
        let received = tensor.empty_like();
        self.group.exchange(&[
            P2pOp::Send {
                tensor: &tensor,
                peer: to,
            },
            P2pOp::Recv {
                buffer: &received,
                peer: from,
            },
        ])?;
        Ok(received)
    }
}

impl CustomFunction for RingShift {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![self.pass(&inputs[0], 1)?])
    }

    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        // Every rank takes part in the exchange, whether or not its gradient is defined.
        let grad = if grads[0].defined() {
            grads[0].shallow_clone()
        } else {
            Tensor::zeros(self.shape.as_slice(), self.options)
        };
        let size = self.group.size();
        Ok(vec![Some(self.pass(&grad, size - 1)?)])
    }
}

/// All-gather along `gather`, keep this rank's share of `keep` (an all-to-all); the backward is
/// the same with the two dimensions swapped.
struct Redistribute {
    group: Arc<dyn Communicator>,
    gather: i64,
    keep: i64,
}

fn gather_and_keep(
    group: &Arc<dyn Communicator>,
    tensor: &Tensor,
    gather: i64,
    keep: i64,
) -> Result<Tensor> {
    let width = tensor.size()[keep as usize] / group.size() as i64;
    let gathered = group.all_gather(&tensor.contiguous(), gather)?;
    Ok(gathered
        .narrow(keep, group.rank() as i64 * width, width)
        .contiguous())
}

impl CustomFunction for Redistribute {
    fn forward(&mut self, inputs: &[Tensor], _: &mut SavedTensors) -> Result<Vec<Tensor>> {
        Ok(vec![gather_and_keep(
            &self.group,
            &inputs[0],
            self.gather,
            self.keep,
        )?])
    }

    fn backward(&mut self, grads: &[Tensor], _: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(gather_and_keep(
            &self.group,
            &grads[0],
            self.keep,
            self.gather,
        )?)])
    }
}
