//! The keys and values inference keeps per layer, so each generated token costs one position
//! of attention instead of a forward over the whole sequence: a contiguous cache per batch
//! (beam search, prompt scoring) and the paged pool continuous batching shares among requests.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

pub use megatron_kernels::ops::paged_attention::BLOCK_SIZE;
use megatron_kernels::ops::paged_attention::{paged_decode_attention, NewKeysValues};

/// One layer's keys and values side by side, `[b, groups, capacity, 2·d]` (keys in the first
/// `d` channels), valid for the first `len` positions.
pub struct LayerCache {
    kv: Tensor,
    pub len: i64,
}

impl LayerCache {
    pub fn new(
        batch: i64,
        groups: i64,
        capacity: i64,
        head_dim: i64,
        kind: Kind,
        device: Device,
    ) -> Self {
        LayerCache {
            kv: Tensor::zeros([batch, groups, capacity, 2 * head_dim], (kind, device)),
            len: 0,
        }
    }

    /// Keys and values of the first `length` slots, `[b, groups, length, d]` each.
    fn split(&self, length: i64) -> (Tensor, Tensor) {
        let kv = self.kv.narrow(2, 0, length);
        let d = self.kv.size()[3] / 2;
        (kv.narrow(3, 0, d), kv.narrow(3, d, d))
    }

    /// Stores `key` and `value` (`[b, groups, s, d]`) after the cached positions and returns all
    /// keys and values so far.
    pub fn append(&mut self, key: &Tensor, value: &Tensor) -> Result<(Tensor, Tensor)> {
        let new = key.size()[2];
        let capacity = self.kv.size()[2];
        ensure!(
            self.len + new <= capacity,
            "the KV cache holds {capacity} positions; {} were asked for",
            self.len + new
        );
        let (keys, values) = self.split(self.len + new);
        keys.narrow(2, self.len, new).copy_(key);
        values.narrow(2, self.len, new).copy_(value);
        self.len += new;
        Ok((keys, values))
    }

    /// Keeps the rows `rows` (in that order, repeats allowed): beam search re-ranks its beams.
    pub fn select_rows(&mut self, rows: &Tensor) {
        self.kv = self.kv.index_select(0, rows);
    }
}

/// The caches of every layer of a model.
pub struct KvCache {
    pub layers: Vec<LayerCache>,
}

impl KvCache {
    /// Positions cached so far.
    pub fn len(&self) -> i64 {
        self.layers.first().map_or(0, |l| l.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions each sequence can hold.
    pub fn capacity(&self) -> i64 {
        self.layers.first().map_or(0, |l| l.kv.size()[2])
    }

    /// Keeps the sequences `rows` of every layer.
    pub fn select_rows(&mut self, rows: &Tensor) {
        self.layers.iter_mut().for_each(|l| l.select_rows(rows));
    }
}

/// The keys and values of many sequences in one pool of fixed-size blocks: every layer holds
/// `[blocks · BLOCK_SIZE, groups, 2·d]` (keys in the first `d` channels), and a sequence owns
/// the blocks its block table lists, so sequences of different lengths take only what they use.
/// Block 0 is never handed out: padding rows of a batch write there and read it.
pub struct PagedKvCache {
    layers: Vec<Tensor>,
    free: Vec<i64>,
    blocks: i64,
    /// Blocks in more than one row's table, and how many tables beyond the first hold each:
    /// a released block is free once no table holds it.
    shared: std::collections::HashMap<i64, u32>,
}

impl PagedKvCache {
    /// A pool of `blocks` blocks (block 0 included) for `layers` layers of `groups` query groups
    /// of `head_dim` channels.
    pub fn new(
        layers: usize,
        blocks: i64,
        groups: i64,
        head_dim: i64,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        ensure!(
            blocks >= 2,
            "a KV cache needs at least 2 blocks of {BLOCK_SIZE} positions"
        );
        let layers = (0..layers)
            .map(|_| {
                Tensor::f_zeros([blocks * BLOCK_SIZE, groups, 2 * head_dim], (kind, device))
                    .map_err(|e| anyhow::anyhow!("cannot allocate the KV cache: {e}"))
            })
            .collect::<Result<_>>()?;
        Ok(PagedKvCache {
            layers,
            // Popped from the end: low blocks first.
            free: (1..blocks).rev().collect(),
            blocks,
            shared: std::collections::HashMap::new(),
        })
    }

    /// Bytes one block takes over all layers.
    pub fn block_bytes(layers: usize, groups: i64, head_dim: i64, kind: Kind) -> u64 {
        (layers as i64 * BLOCK_SIZE * groups * 2 * head_dim * kind.elt_size_in_bytes() as i64)
            as u64
    }

    /// Blocks a sequence of `positions` positions needs.
    pub fn blocks_for(positions: i64) -> i64 {
        (positions + BLOCK_SIZE - 1) / BLOCK_SIZE
    }

    /// Blocks sequences may own at most (all but the padding block).
    pub fn usable_blocks(&self) -> i64 {
        self.blocks - 1
    }

    pub fn free_blocks(&self) -> i64 {
        self.free.len() as i64
    }

    /// `count` blocks for a new sequence, or `None` (nothing taken) when fewer are free.
    pub fn allocate(&mut self, count: i64) -> Option<Vec<i64>> {
        let count = count as usize;
        (count <= self.free.len()).then(|| self.free.split_off(self.free.len() - count))
    }

    /// Gives a sequence's blocks back.
    pub fn release(&mut self, blocks: Vec<i64>) {
        for block in blocks {
            match self.shared.get_mut(&block) {
                Some(1) => {
                    self.shared.remove(&block);
                }
                Some(others) => *others -= 1,
                None => self.free.push(block),
            }
        }
    }

    /// Puts `blocks` (allocated, full) in one more row's table: they are freed once every
    /// table holding them is released.
    pub fn share(&mut self, blocks: &[i64]) {
        for &block in blocks {
            *self.shared.entry(block).or_default() += 1;
        }
    }

    /// Copies the keys and values of block `from` into block `to`, in every layer.
    pub fn copy_block(&mut self, from: i64, to: i64) {
        for layer in &mut self.layers {
            layer
                .narrow(0, to * BLOCK_SIZE, BLOCK_SIZE)
                .copy_(&layer.narrow(0, from * BLOCK_SIZE, BLOCK_SIZE));
        }
    }

    pub fn layer_mut(&mut self, layer: usize) -> &mut Tensor {
        &mut self.layers[layer]
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}

/// Where the new positions of a batch go in a [`PagedKvCache`] and what they attend to, as
/// device tensors (so a decode step can be replayed from a CUDA graph).
pub struct PagedStep {
    /// The pool slot of each new position, `[b·s]` (row-major over `[b, s]`).
    pub write_slots: Tensor,
    read: PagedRead,
    /// Rows of few tokens run through the fused decode kernels ([`megatron_kernels::ops::decode_gemv`]).
    decode_fusion: bool,
}

/// How a step's queries reach the cached keys and values.
enum PagedRead {
    /// Gathered into a window per row, attended under an additive mask.
    Gathered {
        /// The pool slots each row attends to, `[b, window]`.
        read_slots: Tensor,
        /// `[b, 1, s, window]` additive bias in the activations' dtype: 0 where a new position
        /// may attend to a read slot, -inf elsewhere.
        bias: Tensor,
    },
    /// Read in place by the paged decode kernel (one new position per row).
    InPlace {
        /// Block tables, `[b, blocks per row]`.
        tables: Tensor,
        /// Each row's new position, `[b]`: it attends to positions `0..=position`.
        positions: Tensor,
    },
}

impl PagedStep {
    /// The step of rows whose new positions are `positions` (`[b, s]`, int64) and whose
    /// `window` attended slots are `read_slots`: each position sees the slots up to its own.
    pub fn new(write_slots: Tensor, read_slots: Tensor, positions: &Tensor, kind: Kind) -> Self {
        let window = read_slots.size()[1];
        let device = read_slots.device();
        let hidden = Tensor::arange(window, (Kind::Int64, device))
            .view([1, 1, window])
            .gt_tensor(&positions.unsqueeze(2));
        let (b, s) = (positions.size()[0], positions.size()[1]);
        let bias = Tensor::zeros([b, s, window], (kind, device))
            .masked_fill(&hidden, f64::NEG_INFINITY)
            .unsqueeze(1);
        PagedStep {
            write_slots,
            read: PagedRead::Gathered { read_slots, bias },
            decode_fusion: false,
        }
    }

    /// A decode step (one new position per row, at `positions`, `[b]` int64) whose attention
    /// reads the rows' blocks in place through their block `tables` (`[b, blocks per row]`,
    /// covering every position up to the row's own), with the paged decode kernel
    /// ([`megatron_kernels::ops::paged_attention`]; CUDA only).
    pub fn decode_in_place(write_slots: Tensor, tables: Tensor, positions: Tensor) -> Self {
        PagedStep {
            write_slots,
            read: PagedRead::InPlace { tables, positions },
            decode_fusion: false,
        }
    }

    /// With `on`, the model runs this step's linear layers (and the norms, bias adds, GeLU and
    /// residual adds around them) through the fused decode kernels
    /// ([`megatron_kernels::ops::decode_gemv`]) where the step has few enough rows and the layer allows it
    /// (see [`crate::GptModel::supports_decode_fusion`]). CUDA only.
    pub fn with_decode_fusion(mut self, on: bool) -> Self {
        self.decode_fusion = on;
        self
    }

    /// The block tables and positions of a decode step read in place
    /// ([`decode_in_place`](Self::decode_in_place)); `None` for gathered steps.
    pub fn in_place(&self) -> Option<(&Tensor, &Tensor)> {
        match &self.read {
            PagedRead::InPlace { tables, positions } => Some((tables, positions)),
            PagedRead::Gathered { .. } => None,
        }
    }

    /// Whether `rows` rows of this step go through the fused decode kernels.
    pub fn fuses(&self, rows: i64) -> bool {
        self.decode_fusion && (1..=megatron_kernels::ops::decode_gemv::MAX_ROWS).contains(&rows)
    }

    /// Stores `kv` (`[b, groups, s, 2·d]`) in `pool` at the write slots.
    fn store(&self, pool: &mut Tensor, kv: &Tensor) {
        let (b, groups, s, width) = (kv.size()[0], kv.size()[1], kv.size()[2], kv.size()[3]);
        // One position per row (decode) is a view; more are copied into row-major order.
        let rows = if s == 1 {
            kv.select(2, 0)
        } else {
            kv.permute([0, 2, 1, 3]).reshape([b * s, groups, width])
        };
        let _ = pool.index_copy_(0, &self.write_slots, &rows);
    }

    /// Stores `kv` (`[b, groups, s, 2·d]`) in `pool` and returns the attention context of
    /// `query` (`[b, heads, s, d]`) over each row's cached positions up to its own,
    /// `[b, heads, s, d]`. `expand` turns `[b, groups, window, d]` keys or values into one per
    /// query head (the gathered path; the kernel maps heads to groups itself).
    pub fn attend(
        &self,
        pool: &mut Tensor,
        query: &Tensor,
        kv: &Tensor,
        expand: impl Fn(Tensor) -> Tensor,
    ) -> Result<Tensor> {
        match &self.read {
            PagedRead::InPlace { tables, positions } => {
                ensure!(
                    query.size()[2] == 1 && kv.size()[2] == 1,
                    "the paged decode kernel takes one new position per row"
                );
                // The kernel stores the new keys and values as it reads them.
                let new = NewKeysValues {
                    kv: &kv.select(2, 0),
                    write_slots: &self.write_slots,
                };
                let context = paged_decode_attention(
                    &query.squeeze_dim(2),
                    pool,
                    tables,
                    positions,
                    Some(&new),
                )?;
                Ok(context.unsqueeze(2))
            }
            PagedRead::Gathered { read_slots, bias } => {
                self.store(pool, kv);
                let (b, width) = (kv.size()[0], kv.size()[3]);
                let groups = kv.size()[1];
                let window = read_slots.size()[1];
                let read = pool
                    .index_select(0, &read_slots.reshape([-1]))
                    .view([b, window, groups, width])
                    .permute([0, 2, 1, 3]);
                let d = width / 2;
                let (keys, values) = (expand(read.narrow(3, 0, d)), expand(read.narrow(3, d, d)));
                let (heads, s) = (query.size()[1], query.size()[2]);
                if query.device().is_cuda() && s > 1 && window % 16 == 0 {
                    // Prefill chunks straight to the memory-efficient kernel: libtorch's
                    // dispatcher may pick cuDNN's attention for masked calls on Hopper, which
                    // builds an execution plan for every new shape (tens of milliseconds each,
                    // and chunks come in many shapes), in the way of the first tokens.
                    let bias = bias.expand([b, heads, s, window], false);
                    // Shapes the kernel turns down go through the dispatcher below.
                    if let Ok((context, _, _, _)) =
                        Tensor::f_internal_scaled_dot_product_efficient_attention(
                            query,
                            &keys,
                            &values,
                            Some(&bias),
                            false,
                            0.0,
                            false,
                            None,
                        )
                    {
                        return Ok(context);
                    }
                }
                Ok(Tensor::scaled_dot_product_attention(
                    query,
                    &keys,
                    &values,
                    Some(bias),
                    0.0,
                    false,
                    None,
                    false,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_blocks_are_freed_by_their_last_table_and_copies_are_whole_blocks() {
        let mut cache = PagedKvCache::new(2, 5, 1, 2, Kind::Float, Device::Cpu).unwrap();
        let first = cache.allocate(2).unwrap();
        cache.share(&first[..1]);
        let second = cache.allocate(1).unwrap();
        assert_eq!(cache.free_blocks(), 1);
        // The first table goes: its shared block stays with the second.
        cache.release(first.clone());
        assert_eq!(cache.free_blocks(), 2);
        cache.release(vec![first[0], second[0]]);
        assert_eq!(cache.free_blocks(), 4);

        for layer in 0..2 {
            let values = cache.layer_mut(layer);
            let count = values.numel() as i64;
            let filled = Tensor::arange(count, (Kind::Float, Device::Cpu)) + 1000 * layer as i64;
            values.copy_(&filled.view(values.size().as_slice()));
        }
        let before = cache.layer_mut(0).copy();
        cache.copy_block(2, 4);
        for layer in 0..2 {
            let values = cache.layer_mut(layer).shallow_clone();
            let block = |b: i64| values.narrow(0, b * BLOCK_SIZE, BLOCK_SIZE);
            assert!(block(4).equal(&block(2)), "layer {layer}");
            assert!(!block(3).equal(&block(2)), "layer {layer}");
        }
        // Only block 4 changed.
        let after = cache.layer_mut(0).shallow_clone();
        let rest = |t: &Tensor| t.narrow(0, 0, 4 * BLOCK_SIZE);
        assert!(rest(&after).equal(&rest(&before)));
    }
}
