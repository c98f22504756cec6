//! What every model family's transformer trunk shares: the embeddings' common tail, a block of
//! layers run under the recompute policy and the parameter gates, and the gates themselves.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::gpt::{ParamGate, Recompute, RecomputeMethod};
use super::layers::{AttentionMask, RotaryTables, TensorParallel, TransformerLayer};
use crate::autograd::checkpoint;
use crate::parallel::scatter_to_sequence_parallel_region;
use crate::rng::with_model_parallel_rng;

/// The gate a chunk consults before each module's parameters are read (`--overlap-param-gather`).
#[derive(Default, Clone)]
pub struct GateSlot(Option<Arc<dyn ParamGate>>);

impl GateSlot {
    pub fn set(&mut self, gate: Arc<dyn ParamGate>) {
        self.0 = Some(gate);
    }

    /// Waits for the parameters of `module` (a parameter-name prefix) when a gate is installed.
    pub fn before(&self, module: &str) -> Result<()> {
        match &self.0 {
            Some(gate) => gate.before(module),
            None => Ok(()),
        }
    }

    fn layers(&self, scope: &str, range: Range<usize>) -> Result<()> {
        if self.0.is_some() {
            for i in range {
                self.before(&format!("{scope}.{i}"))?;
            }
        }
        Ok(())
    }
}

/// Summed embeddings `[b, s, h]` → the stack's input `[s, b, h]` (`[s/t, b, h]` scattered along
/// the sequence with sequence parallelism), after embedding dropout. Dropout on a
/// sequence-parallel slice draws from the per-rank stream (spec §3.2).
pub fn embedding_output(
    embedded: Tensor,
    dropout: f64,
    parallel: &TensorParallel,
    train: bool,
) -> Result<Tensor> {
    let embedded = embedded.transpose(0, 1).contiguous();
    if parallel.sequence_parallel {
        let embedded = scatter_to_sequence_parallel_region(&embedded, &parallel.group)?;
        return Ok(with_model_parallel_rng(embedded.device(), || {
            embedded.dropout(dropout, train)
        })?);
    }
    Ok(embedded.dropout(dropout, train))
}

/// A chunk's block of transformer layers, named `<scope>.<local index>` in its parameters.
pub struct LayerStack<'a> {
    pub layers: &'a [TransformerLayer],
    /// `decoder.layers` (GPT) or `encoder.layers` (BERT).
    pub scope: &'a str,
    pub recompute: Recompute,
    pub parallel: &'a TensorParallel,
    pub gate: &'a GateSlot,
}

impl LayerStack<'_> {
    /// Runs `hidden` through the layers. With sequence parallelism every dropout in the stack
    /// acts on per-rank slices, so the stack runs on the model-parallel stream (spec §3.2).
    pub fn forward(
        &self,
        hidden: Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        train: bool,
    ) -> Result<Tensor> {
        if self.parallel.sequence_parallel {
            with_model_parallel_rng(hidden.device(), || {
                self.run(hidden, mask, rotary, train)
            })?
        } else {
            self.run(hidden, mask, rotary, train)
        }
    }

    fn run(
        &self,
        mut hidden: Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        train: bool,
    ) -> Result<Tensor> {
        let selective = self.recompute == Recompute::Selective;
        let Recompute::Full { method, num_layers } = self.recompute else {
            for (i, layer) in self.layers.iter().enumerate() {
                self.gate.layers(self.scope, i..i + 1)?;
                hidden = layer.forward(&hidden, mask, rotary, train, selective && train)?;
            }
            return Ok(hidden);
        };
        if !train {
            for (i, layer) in self.layers.iter().enumerate() {
                self.gate.layers(self.scope, i..i + 1)?;
                hidden = layer.forward(&hidden, mask, rotary, false, false)?;
            }
            return Ok(hidden);
        }
        let chunk = num_layers.max(1);
        let mut start = 0;
        while start < self.layers.len() {
            let (end, recompute) = match method {
                RecomputeMethod::Uniform => ((start + chunk).min(self.layers.len()), true),
                RecomputeMethod::Block => (start + 1, start < num_layers),
            };
            self.gate.layers(self.scope, start..end)?;
            if recompute {
                let block: Vec<TransformerLayer> = self.layers[start..end].to_vec();
                let (mask, rotary) = (mask.clone(), rotary.cloned());
                let run = move |inputs: &[Tensor]| -> Result<Vec<Tensor>> {
                    let mut x = inputs[0].shallow_clone();
                    for layer in &block {
                        x = layer.forward(&x, &mask, rotary.as_ref(), true, false)?;
                    }
                    Ok(vec![x])
                };
                hidden = checkpoint(run, &[&hidden])?.remove(0);
            } else {
                for layer in &self.layers[start..end] {
                    hidden = layer.forward(&hidden, mask, rotary, true, false)?;
                }
            }
            start = end;
        }
        Ok(hidden)
    }
}
