//! Causal flash attention over packed variable-length sequences: libtorch's
//! `_flash_attention_forward`/`_flash_attention_backward` with `cum_seq_q/k` (through
//! `csrc/flash_varlen.cpp`) as an autograd function. Each document of a packed batch attends
//! only within itself, from its offsets alone, without an `[s, s]` mask.

use anyhow::{Context, Result};
use tch::{Kind, Tensor};

use crate::autograd::{apply, ffi, CustomFunction, SavedTensors};
use crate::error::check;

/// Whether the varlen flash kernel takes tensors of this device and dtype (CUDA, bf16/fp16).
pub fn supports(query: &Tensor) -> bool {
    query.device().is_cuda() && matches!(query.kind(), Kind::BFloat16 | Kind::Half)
}

/// Causal attention of `query`, `key` and `value` (`[tokens, heads, head_dim]`, the documents
/// of a micro-batch end to end) within each document; `cu_seqlens` holds the documents' int32
/// offsets (`0, ..., tokens`) on the tensors' device and `max_seqlen` the longest document.
pub fn varlen_causal_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    cu_seqlens: &Tensor,
    max_seqlen: i64,
    dropout: f64,
) -> Result<Tensor> {
    let function = VarlenFlashAttention {
        cu_seqlens: cu_seqlens.shallow_clone(),
        max_seqlen,
        dropout,
    };
    let (query, key, value) = (query.contiguous(), key.contiguous(), value.contiguous());
    let mut outputs = apply(function, &[&query, &key, &value])
        .context("varlen flash attention over packed documents")?;
    Ok(outputs.remove(0))
}

struct VarlenFlashAttention {
    cu_seqlens: Tensor,
    max_seqlen: i64,
    dropout: f64,
}

impl CustomFunction for VarlenFlashAttention {
    fn forward(&mut self, inputs: &[Tensor], saved: &mut SavedTensors) -> Result<Vec<Tensor>> {
        let mut handles = [std::ptr::null_mut(); 4];
        let [out, logsumexp, rng_state, unused] = &mut handles;
        // SAFETY: borrowed handles live for the call; on success the shim hands us four new ones.
        check(unsafe {
            ffi::mrs_flash_varlen_forward(
                ffi::handle(&inputs[0]),
                ffi::handle(&inputs[1]),
                ffi::handle(&inputs[2]),
                ffi::handle(&self.cu_seqlens),
                self.max_seqlen,
                self.dropout,
                1,
                out,
                logsumexp,
                rng_state,
                unused,
            )
        })?;
        // SAFETY: handles the shim allocated for us.
        let [out, logsumexp, rng_state, unused] = handles.map(|h| unsafe { Tensor::from_ptr(h) });
        for tensor in [
            &inputs[0], &inputs[1], &inputs[2], &out, &logsumexp, &rng_state, &unused,
        ] {
            saved.save(tensor);
        }
        Ok(vec![out])
    }

    fn backward(&mut self, grads: &[Tensor], saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let [query, key, value, out, logsumexp, rng_state, unused] = saved else {
            anyhow::bail!(
                "varlen flash attention saved {} tensors, not 7",
                saved.len()
            );
        };
        let mut handles = [std::ptr::null_mut(); 3];
        let [dq, dk, dv] = &mut handles;
        // SAFETY: borrowed handles live for the call; on success the shim hands us three new ones.
        check(unsafe {
            ffi::mrs_flash_varlen_backward(
                ffi::handle(&grads[0]),
                ffi::handle(query),
                ffi::handle(key),
                ffi::handle(value),
                ffi::handle(out),
                ffi::handle(logsumexp),
                ffi::handle(&self.cu_seqlens),
                self.max_seqlen,
                self.dropout,
                1,
                ffi::handle(rng_state),
                ffi::handle(unused),
                dq,
                dk,
                dv,
            )
        })
        .context("the backward of varlen flash attention")?;
        // SAFETY: handles the shim allocated for us.
        Ok(handles.map(|h| Some(unsafe { Tensor::from_ptr(h) })).into())
    }
}
