//! What every model family's transformer trunk shares: the embeddings' common tail, a block of
//! layers run under the recompute policy and the parameter gates, the gates themselves, and the
//! vocabulary-parallel logits of the output layer.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use tch::Tensor;

use super::gpt::{ParamGate, Recompute, RecomputeMethod};
use super::layers::{AttentionMask, Memory, RotaryTables, TensorParallel, TransformerLayer};
use crate::autograd::checkpoint;
use crate::parallel::{
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
};
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
        self.forward_attending(hidden, mask, rotary, None, train)
    }

    /// [`forward`](Self::forward) of decoder layers that also attend to `memory`, the
    /// encoder's output (T5).
    pub fn forward_attending(
        &self,
        hidden: Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        memory: Option<&Memory>,
        train: bool,
    ) -> Result<Tensor> {
        if self.parallel.sequence_parallel {
            with_model_parallel_rng(hidden.device(), || {
                self.run(hidden, mask, rotary, memory, train)
            })?
        } else {
            self.run(hidden, mask, rotary, memory, train)
        }
    }

    fn run(
        &self,
        mut hidden: Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        memory: Option<&Memory>,
        train: bool,
    ) -> Result<Tensor> {
        let selective = self.recompute == Recompute::Selective;
        let Recompute::Full { method, num_layers } = self.recompute else {
            for (i, layer) in self.layers.iter().enumerate() {
                self.gate.layers(self.scope, i..i + 1)?;
                hidden = layer.forward_attending(
                    &hidden,
                    mask,
                    rotary,
                    memory,
                    train,
                    selective && train,
                )?;
            }
            return Ok(hidden);
        };
        if !train {
            for (i, layer) in self.layers.iter().enumerate() {
                self.gate.layers(self.scope, i..i + 1)?;
                hidden = layer.forward_attending(&hidden, mask, rotary, memory, false, false)?;
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
                // The encoder output is an input of the recomputed block, so its gradient
                // flows back to the encoder.
                let memory_mask = memory.map(|m| m.mask.clone());
                let run = move |inputs: &[Tensor]| -> Result<Vec<Tensor>> {
                    let mut x = inputs[0].shallow_clone();
                    let memory = memory_mask.clone().map(|mask| Memory {
                        states: inputs[1].shallow_clone(),
                        mask,
                    });
                    for layer in &block {
                        x = layer.forward_attending(
                            &x,
                            &mask,
                            rotary.as_ref(),
                            memory.as_ref(),
                            true,
                            false,
                        )?;
                    }
                    Ok(vec![x])
                };
                let mut inputs = vec![&hidden];
                if let Some(memory) = memory {
                    inputs.push(&memory.states);
                }
                hidden = checkpoint(run, &inputs)?.remove(0);
            } else {
                for layer in &self.layers[start..end] {
                    hidden = layer.forward_attending(&hidden, mask, rotary, memory, true, false)?;
                }
            }
            start = end;
        }
        Ok(hidden)
    }
}

/// The logits of this tensor-parallel rank's vocabulary slice: `hidden` (`[s, b, h]`, or a
/// sequence-parallel slice, gathered here) times the output weight `[V/t, h]`, plus `bias`.
pub fn output_logits(
    hidden: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    parallel: &TensorParallel,
) -> Result<Tensor> {
    let group = &parallel.group;
    let hidden = if parallel.sequence_parallel {
        gather_from_sequence_parallel_region(hidden, group, true)?
    } else {
        copy_to_tensor_parallel_region(hidden, group)?
    };
    Ok(hidden.linear(weight, bias))
}
