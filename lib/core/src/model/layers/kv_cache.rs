//! The keys and values inference keeps per layer, so each generated token costs one position
//! of attention instead of a forward over the whole sequence.

use anyhow::{ensure, Result};
use tch::{Device, Kind, Tensor};

/// One layer's keys and values side by side, `[b, groups, capacity, 2·d]` (keys in the first
/// `d` channels), valid for the first `len` positions. Side by side, a decode step stores both
/// with one kernel when they come straight from the fused projection.
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

    /// Stores one position's keys and values side by side (`kv`, `[b, groups, 1, 2·d]`) at the
    /// slot `slot` holds on the device (`[1]`, int64) and returns the first `window` slots of
    /// keys and values. Shapes and addresses do not depend on the slot, so the step can be
    /// replayed from a CUDA graph; `len` is left to the caller, who knows the slot on the host.
    pub fn write_slot(&mut self, slot: &Tensor, kv: &Tensor, window: i64) -> (Tensor, Tensor) {
        let _ = self.kv.index_copy_(2, slot, kv);
        self.split(window)
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

    /// Sequences cached side by side.
    pub fn batch(&self) -> i64 {
        self.layers.first().map_or(0, |l| l.kv.size()[0])
    }

    /// Declares the first `len` positions valid (after steps that wrote slots directly), or
    /// forgets everything (`0`) so the cache can serve another batch of the same shape.
    pub fn set_len(&mut self, len: i64) {
        self.layers.iter_mut().for_each(|l| l.len = len);
    }

    /// Keeps the sequences `rows` of every layer.
    pub fn select_rows(&mut self, rows: &Tensor) {
        self.layers.iter_mut().for_each(|l| l.select_rows(rows));
    }
}
