//! Packed sequences (`--reset-attention-mask`): the documents of a micro-batch's sequences,
//! end to end, each attending only within itself (Megatron's `PackedSeqParams`). The documents
//! are given by their offsets (`cu_seqlens`), never by an `[s, s]` mask: on GPUs in bf16/fp16
//! libtorch's varlen flash attention takes the offsets as they are; elsewhere each document
//! runs causal attention of its own.

use anyhow::{ensure, Result};
use tch::{Device, Tensor};

use megatron_kernels::ops::flash_varlen;

/// The documents of one micro-batch of `[b, s]` tokens.
pub struct PackedSequences {
    /// `[documents + 1]` int32 offsets into the micro-batch's `b · s` tokens: document `i` is
    /// tokens `cu_seqlens[i]..cu_seqlens[i + 1]`, sequence after sequence.
    pub cu_seqlens: Tensor,
    /// The longest document's length (sizes the flash kernel's grid; kept on the host).
    pub max_seqlen: i64,
    /// `[b, s]` int64: each token's position within its document, where rotary embeddings
    /// restart.
    pub positions: Tensor,
}

impl PackedSequences {
    /// The packing of sequences cut into documents of `lengths` (one list per sequence, each
    /// summing to the sequence length `s`).
    pub fn from_lengths(lengths: &[Vec<i64>], s: i64) -> Result<PackedSequences> {
        let mut offsets = vec![0i32];
        let mut positions = Vec::with_capacity(lengths.len() * s as usize);
        let mut max_seqlen = 0;
        for (row, documents) in lengths.iter().enumerate() {
            let total: i64 = documents.iter().sum();
            ensure!(
                total == s && documents.iter().all(|&n| n > 0),
                "sequence {row} of the micro-batch is cut into documents of lengths \
                 {documents:?}, which do not make up its {s} tokens"
            );
            for &n in documents {
                let end = i64::from(*offsets.last().expect("starts at 0")) + n;
                offsets.push(i32::try_from(end).map_err(|_| {
                    anyhow::anyhow!("a micro-batch of {end} tokens overflows int32 offsets")
                })?);
                positions.extend(0..n);
                max_seqlen = max_seqlen.max(n);
            }
        }
        Ok(PackedSequences {
            cu_seqlens: Tensor::from_slice(&offsets),
            max_seqlen,
            positions: Tensor::from_slice(&positions).view([lengths.len() as i64, s]),
        })
    }

    /// Query, key and value `[b, n, s, d]` (keys and values with every query's head) →
    /// the context `[b, n, s, d]`, causal within each document.
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let (b, n, s, d) = query.size4()?;
        let tokens = |t: &Tensor| t.permute([0, 2, 1, 3]).reshape([b * s, n, d]);
        let (q, k, v) = (tokens(query), tokens(key), tokens(value));
        let context = if flash_varlen::supports(&q) {
            flash_varlen::varlen_causal_attention(
                &q,
                &k,
                &v,
                &self.cu_seqlens,
                self.max_seqlen,
                dropout,
            )?
        } else {
            self.per_document(&q, &k, &v, dropout)?
        };
        Ok(context.view([b, s, n, d]).permute([0, 2, 1, 3]))
    }

    /// Causal attention of each document alone (`[tokens, n, d]` in and out): exact in any
    /// dtype, on any device.
    fn per_document(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        dropout: f64,
    ) -> Result<Tensor> {
        let offsets = Vec::<i32>::try_from(&self.cu_seqlens.to_device(Device::Cpu))?;
        let documents: Vec<Tensor> = offsets
            .windows(2)
            .map(|w| {
                let (start, length) = (i64::from(w[0]), i64::from(w[1] - w[0]));
                // [length, n, d] → [1, n, length, d] for SDPA.
                let part = |t: &Tensor| t.narrow(0, start, length).transpose(0, 1).unsqueeze(0);
                Tensor::scaled_dot_product_attention::<&Tensor>(
                    &part(query),
                    &part(key),
                    &part(value),
                    None,
                    dropout,
                    true,
                    None,
                    false,
                )
                .squeeze_dim(0)
                .transpose(0, 1)
            })
            .collect();
        Ok(Tensor::cat(&documents, 0))
    }

    /// The same packing with its tensors mapped by `f` (moved to a device, say).
    pub fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> PackedSequences {
        PackedSequences {
            cu_seqlens: f(&self.cu_seqlens),
            max_seqlen: self.max_seqlen,
            positions: f(&self.positions),
        }
    }
}

impl Clone for PackedSequences {
    fn clone(&self) -> PackedSequences {
        self.map_tensors(&mut Tensor::shallow_clone)
    }
}
