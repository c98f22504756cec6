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
//! - [`ContextExchange::AllToAll`] (Ulysses) trades heads for sequence with one all-to-all
//!   before attention and one after it, so each rank attends over the whole sequence for
//!   `heads / CP` heads.
//! - [`ContextExchange::AllToAllThenRing`] (`a2a+p2p`) trades heads for sequence within groups
//!   of adjacent ranks, then runs the ring over the ranks of the same place in every group.
//!
//! Packed sequences ([`ContextParallel::with_documents`]) keep the same chunks of each
//! sequence; every block's mask then also requires the query and the key to lie in the same
//! document.

use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::packed::PackedSequences;
use megatron_kernels::autograd::{apply, CustomFunction, SavedTensors};
use megatron_parallel::{
    all_to_all_region, gather_from_sequence_parallel_region, Communicator, P2pOp, SubGroup,
};

/// How the ranks of a context-parallel group share keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContextExchange {
    /// `--cp-comm-type p2p`.
    Ring,
    /// `--cp-comm-type allgather`.
    AllGather,
    /// `--cp-comm-type a2a`.
    AllToAll,
    /// `--cp-comm-type a2a+p2p` with `--hierarchical-context-parallel-sizes a2a_size
    /// CP/a2a_size`: all-to-all within each `a2a_size` adjacent ranks, a ring across them.
    AllToAllThenRing { a2a_size: usize },
}

/// A context-parallel group and how it exchanges keys and values.
#[derive(Clone)]
pub struct ContextParallel {
    pub group: Arc<dyn Communicator>,
    pub exchange: ContextExchange,
}

/// A micro-batch's sequences as this rank's chunks of them: how it attends across the group,
/// within each document when the sequences are packed.
pub struct ContextChunks {
    context: ContextParallel,
    documents: Option<ChunkedDocuments>,
}

/// The documents of a packed micro-batch split over the group.
struct ChunkedDocuments {
    /// `[b, s]` int64: the document of every position of the whole sequences (numbered over
    /// the micro-batch, so equal ids mean the same document).
    ids: Tensor,
    /// `[b, local]` int64: this rank's tokens' positions within their documents, where rotary
    /// embeddings restart.
    positions: Tensor,
}

impl Clone for ContextChunks {
    fn clone(&self) -> ContextChunks {
        ContextChunks {
            context: self.context.clone(),
            documents: self.documents.as_ref().map(|d| ChunkedDocuments {
                ids: d.ids.shallow_clone(),
                positions: d.positions.shallow_clone(),
            }),
        }
    }
}

/// The original positions of `rank`'s `local` tokens in a group of `size`: chunk `rank`, then
/// chunk `2·size − 1 − rank`, of `local / 2` positions each.
fn chunk_positions(rank: i64, size: i64, local: i64) -> Vec<i64> {
    let chunk = local / 2;
    let mirror = 2 * size - 1 - rank;
    (rank * chunk..(rank + 1) * chunk)
        .chain(mirror * chunk..(mirror + 1) * chunk)
        .collect()
}

fn on(positions: &[i64], device: Device) -> Tensor {
    Tensor::from_slice(positions).to_device(device)
}

impl ContextParallel {
    pub fn new(group: Arc<dyn Communicator>, exchange: ContextExchange) -> ContextParallel {
        ContextParallel { group, exchange }
    }

    /// Attention causal over the whole sequences.
    pub fn chunks(&self) -> ContextChunks {
        ContextChunks {
            context: self.clone(),
            documents: None,
        }
    }

    /// Attention of a micro-batch of packed sequences (`packed`, of the whole sequences):
    /// causal within each document, rotary positions restarting at each document's start.
    pub fn with_documents(&self, packed: &PackedSequences) -> Result<ContextChunks> {
        let (b, s) = packed.positions.size2()?;
        let boundaries = packed.cu_seqlens.size()[0];
        let starts = packed
            .cu_seqlens
            .narrow(0, 1, (boundaries - 2).max(0))
            .to_kind(Kind::Int64);
        let device = packed.positions.device();
        let ids = Tensor::zeros([b * s], (Kind::Int64, device))
            .index_fill(0, &starts, 1)
            .cumsum(0, Kind::Int64)
            .view([b, s]);
        Ok(ContextChunks {
            context: self.clone(),
            documents: Some(ChunkedDocuments {
                ids,
                positions: self.keep_local_chunks(&packed.positions, 1)?,
            }),
        })
    }

    fn size(&self) -> i64 {
        self.group.size() as i64
    }

    /// This rank's original positions of its `local` tokens, `[local]` int64 on `device`
    /// (for rotary embeddings).
    pub fn positions(&self, local: i64, device: Device) -> Tensor {
        on(
            &chunk_positions(self.group.rank() as i64, self.size(), local),
            device,
        )
    }

    /// Every rank's positions in rank order: the order of keys and values gathered along the
    /// sequence.
    fn gathered_positions(&self, local: i64, device: Device) -> Tensor {
        let all: Vec<i64> = (0..self.size())
            .flat_map(|rank| chunk_positions(rank, self.size(), local))
            .collect();
        on(&all, device)
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
}

impl ContextChunks {
    pub fn context(&self) -> &ContextParallel {
        &self.context
    }

    /// `[b, local]` positions within their documents of this rank's tokens, for packed
    /// sequences.
    pub fn document_positions(&self) -> Option<&Tensor> {
        self.documents.as_ref().map(|d| &d.positions)
    }

    /// Which keys at original positions `keys` (`[k]`) the queries at `queries` (`[q]`) may
    /// attend to (`true` = may): `[q, k]`, or `[b, 1, q, k]` for packed sequences; `None` when
    /// every one may. `causal` asks for keys up to each query's position only.
    fn allowed(&self, queries: &Tensor, keys: &Tensor, causal: bool) -> Option<Tensor> {
        let causal = causal.then(|| keys.unsqueeze(0).le_tensor(&queries.unsqueeze(1)));
        let same_document = self.documents.as_ref().map(|d| {
            d.ids
                .index_select(1, queries)
                .unsqueeze(2)
                .eq_tensor(&d.ids.index_select(1, keys).unsqueeze(1))
                .unsqueeze(1)
        });
        match (causal, same_document) {
            (Some(causal), Some(same)) => Some(same.logical_and(&causal)),
            (causal, same) => causal.or(same),
        }
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
        match self.context.exchange {
            ContextExchange::Ring => {
                self.attend_ring(&self.context.group, query, key, value, dropout)
            }
            ContextExchange::AllGather => self.attend_gathered(query, key, value, dropout),
            ContextExchange::AllToAll => self.attend_all_to_all(query, key, value, dropout),
            ContextExchange::AllToAllThenRing { a2a_size } => {
                self.attend_hierarchical(a2a_size, query, key, value, dropout)
            }
        }
        .context("context-parallel attention")
    }

    /// The ring over `ring`, whose rank `r` holds the pair of chunks `r` and `2·size − 1 − r`
    /// of the sequence cut into `2 · ring.size()` (the whole group's, or `a2a+p2p`'s chunks of
    /// a level's ranks put together).
    fn attend_ring(
        &self,
        ring: &Arc<dyn Communicator>,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let (size, rank) = (ring.size() as i64, ring.rank() as i64);
        let device = query.device();
        let local = query.size()[2];
        let chunk = local / 2;
        let positions_of = |r: i64| on(&chunk_positions(r, size, local), device);
        let mine = positions_of(rank);
        let second_half = mine.narrow(0, chunk, chunk);
        let second_queries = query.narrow(2, chunk, chunk);
        // Each query chunk's partial results (output, log-sum-exp).
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let mut keys_values = Tensor::stack(&[key, value], 0);
        for step in 0..size {
            if step > 0 {
                keys_values = ring_shift(&keys_values, ring)?;
            }
            let source = (rank + size - step) % size;
            let theirs = positions_of(source);
            let (key, value) = (keys_values.get(0), keys_values.get(1));
            if source <= rank {
                let (key, value, mask) = if source == rank {
                    (key, value, self.allowed(&mine, &theirs, true))
                } else {
                    // An earlier rank: its first chunk precedes both query chunks, its second
                    // follows them.
                    (
                        key.narrow(2, 0, chunk),
                        value.narrow(2, 0, chunk),
                        self.allowed(&mine, &theirs.narrow(0, 0, chunk), false),
                    )
                };
                let (output, lse) = attention_block(query, &key, &value, mask.as_ref(), dropout);
                first.push((output.narrow(2, 0, chunk), lse.narrow(2, 0, chunk)));
                second.push((output.narrow(2, chunk, chunk), lse.narrow(2, chunk, chunk)));
            } else {
                // A later rank: both its chunks follow the first query chunk and precede the
                // second.
                let mask = self.allowed(&second_half, &theirs, false);
                second.push(attention_block(
                    &second_queries,
                    &key,
                    &value,
                    mask.as_ref(),
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
            let gathered = gather_from_sequence_parallel_region(
                &t.permute([2, 0, 1, 3]),
                &self.context.group,
                true,
            )?;
            Ok(gathered.permute([1, 2, 0, 3]))
        };
        let (keys, values) = (gather(key)?, gather(value)?);
        let local = query.size()[2];
        let device = query.device();
        let allowed = self
            .allowed(
                &self.context.positions(local, device),
                &self.context.gathered_positions(local, device),
                true,
            )
            .expect("a causal mask");
        Ok(masked_attention(query, &keys, &values, &allowed, dropout))
    }

    fn check_heads(&self, heads: i64, over: usize, what: &str) -> Result<()> {
        ensure!(
            heads % over as i64 == 0,
            "--cp-comm-type {what}: the {heads} attention heads of a tensor-parallel rank are \
             not divisible by {over}, the ranks that trade heads for sequence"
        );
        Ok(())
    }

    fn attend_all_to_all(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        self.check_heads(query.size()[1], self.context.group.size(), "a2a")?;
        // [b, n, s, d] → [b, n/CP, CP·s, d] and back.
        let to_heads = |t: &Tensor| trade(&self.context.group, t, 1, 2);
        let (query_all, key_all, value_all) = (to_heads(query)?, to_heads(key)?, to_heads(value)?);
        let positions = self
            .context
            .gathered_positions(query.size()[2], query.device());
        let allowed = self
            .allowed(&positions, &positions, true)
            .expect("a causal mask");
        let output = masked_attention(&query_all, &key_all, &value_all, &allowed, dropout);
        trade(&self.context.group, &output, 2, 1)
    }

    /// `a2a+p2p`: rank `r` trades heads for sequence with the `a2a_size` ranks of its level-one
    /// group (`r / a2a_size`), whose chunks, reordered, are the pair of chunks `g` and
    /// `2·B − 1 − g` of the sequence cut into `2·B` (`B = CP / a2a_size`, `g` the group);
    /// the ring then runs over the level-two group of the ranks at `r`'s place in every group.
    fn attend_hierarchical(
        &self,
        a2a_size: usize,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let (rank, size) = (self.context.group.rank(), self.context.group.size());
        ensure!(
            a2a_size > 0 && size % a2a_size == 0,
            "--hierarchical-context-parallel-sizes: a first level of {a2a_size} ranks does not \
             divide the context-parallel group of {size}"
        );
        self.check_heads(query.size()[1], a2a_size, "a2a+p2p")?;
        let device = query.device();
        let (level, place) = (rank / a2a_size, rank % a2a_size);
        let subgroup = |members: Vec<usize>| -> Result<Arc<dyn Communicator>> {
            Ok(Arc::new(SubGroup::new(
                self.context.group.clone(),
                members,
                device,
            )?))
        };
        let across = subgroup((0..a2a_size).map(|i| level * a2a_size + i).collect())?;
        let ring = subgroup((0..size / a2a_size).map(|j| j * a2a_size + place).collect())?;
        // After the all-to-all the sequence holds each group member's two chunks in turn;
        // their first chunks in order, then their second chunks in reverse order, run
        // through the sequence.
        let (local, chunk) = (query.size()[2], query.size()[2] / 2);
        let order: Vec<i64> = (0..a2a_size as i64)
            .flat_map(|i| (0..chunk).map(move |t| i * local + t))
            .chain(
                (0..a2a_size as i64)
                    .rev()
                    .flat_map(|i| (0..chunk).map(move |t| i * local + chunk + t)),
            )
            .collect();
        let order = on(&order, device);
        let to_ring =
            |t: &Tensor| -> Result<Tensor> { Ok(trade(&across, t, 1, 2)?.index_select(2, &order)) };
        let output = self.attend_ring(
            &ring,
            &to_ring(query)?,
            &to_ring(key)?,
            &to_ring(value)?,
            dropout,
        )?;
        let back = output.index_select(2, &order.argsort(0, false));
        trade(&across, &back, 2, 1)
    }
}

/// All-to-all over `group`: `tensor` cut into `group.size()` parts along `split`, part `r`
/// sent to rank `r`, and the parts received put together along `join` in rank order. Its
/// backward is the trade the other way.
fn trade(group: &Arc<dyn Communicator>, tensor: &Tensor, split: i64, join: i64) -> Result<Tensor> {
    let size = group.size();
    let parts = tensor.chunk(size as i64, split);
    let ones = vec![1; size];
    let received = all_to_all_region(&Tensor::stack(&parts, 0), group, &ones, &ones)?;
    Ok(Tensor::cat(&received.unbind(0), join))
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

/// The score of a masked key: its weight `exp(MASKED_SCORE − lse)` is 0 in float32.
const MASKED_SCORE: f64 = -1e30;

/// Softmax attention of `query` over `key`/`value` (`allowed` as in [`masked_attention`]) in
/// float32, with each query's log-sum-exp of its scaled scores (`[b, n, q, 1]`), so that
/// partial results over different keys can be merged. Masked scores are a huge negative number
/// rather than −∞: a query whose document has no key in the block (packed sequences) then gets
/// a log-sum-exp near it, weighs nothing in the merge and keeps finite gradients. Dropout
/// applies to the block's probabilities: the merge only rescales them, so dropping them before
/// or after it is the same.
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
        Some(allowed) => scores.masked_fill(&allowed.logical_not(), MASKED_SCORE),
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
