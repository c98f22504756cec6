//! What every model family's transformer trunk shares: the embeddings' common tail, a block of
//! layers run under the recompute policy and the parameter gates, the gates themselves, and the
//! output layer the loss is computed through (`OutputHead`).

use std::ops::Range;
use std::sync::Arc;

use anyhow::{ensure, Result};
use tch::{Kind, Tensor};

use super::config::TransformerConfig;
use super::cross_entropy::cross_entropy;
use super::fused_cross_entropy::fused_output_cross_entropy;
use super::layers::{
    AttentionMask, Memory, NamedTensors, Norm, ParamAttributes, Residual, RotaryTables,
    TensorParallel, TransformerLayer, VocabParallelEmbedding,
};
use super::options::{ModelOptions, Recompute, RecomputeMethod};
use super::param::{Initializer, Param};
use megatron_kernels::autograd;
use megatron_kernels::rng::with_model_parallel_rng;
use megatron_parallel::{
    copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region, ParallelState,
};

/// Told before a module's parameters are first read in a forward pass, by the parameter-name
/// prefix of the module (`embedding`, `decoder.layers.3`, `decoder.final_layernorm`,
/// `output_layer`): with `--overlap-param-gather` their all-gather may still be running.
pub trait ParamGate: Send + Sync {
    fn before(&self, module: &str) -> Result<()>;
}

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

/// What building any family's chunk starts from on this rank: the tensor-parallel setting, the
/// initialiser that draws every weight from the seed and its global name (so any layout of the
/// same model holds the same weights), and the trunk's architecture.
pub(crate) struct TrunkBuilder<'a> {
    pub init: Initializer,
    pub parallel: TensorParallel,
    /// The expert-parallel group Mixture-of-Experts layers split their experts over.
    pub experts: Arc<dyn megatron_parallel::Communicator>,
    pub config: &'a TransformerConfig,
    pub padded_vocab: i64,
    bias_dropout_fusion: bool,
}

impl<'a> TrunkBuilder<'a> {
    pub fn new(
        config: &'a TransformerConfig,
        options: &ModelOptions,
        parallel: &ParallelState,
    ) -> Self {
        let tp = parallel.tensor_parallel_size() as i64;
        TrunkBuilder {
            init: Initializer::new(
                options.params_dtype,
                options.device,
                parallel.tensor_parallel_rank() as i64,
                tp,
                options.seed,
            ),
            parallel: TensorParallel {
                group: parallel.tensor.clone(),
                sequence_parallel: parallel.sequence_parallel,
            },
            experts: parallel.expert.clone(),
            config,
            padded_vocab: config.padded_vocab_size(tp),
            bias_dropout_fusion: options.bias_dropout_fusion,
        }
    }

    /// `embedding.word_embeddings`, split over the vocabulary.
    pub fn word_embeddings(&self) -> VocabParallelEmbedding {
        VocabParallelEmbedding::new(
            &self.init.scope("embedding.word_embeddings"),
            self.padded_vocab,
            self.config.hidden_size,
            self.config.init_method_std,
            self.parallel.group.clone(),
        )
    }

    /// `embedding.position_embeddings`: learned absolute positions.
    pub fn position_embeddings(&self) -> Param {
        self.init.scope("embedding.position_embeddings").normal(
            "weight",
            &[self.config.max_position_embeddings, self.config.hidden_size],
            self.config.init_method_std,
        )
    }

    /// The layers `<scope>.<i>` for the global indices `range`, with cross-attention for a
    /// decoder that attends to an encoder.
    pub fn layers(&self, scope: &str, range: Range<usize>, cross: bool) -> Vec<TransformerLayer> {
        range
            .map(|i| {
                let init = self.init.scope(&format!("{scope}.{i}"));
                let layer = if cross {
                    TransformerLayer::with_cross_attention(
                        &init,
                        self.config,
                        self.parallel.clone(),
                    )
                } else {
                    TransformerLayer::new(
                        &init,
                        self.config,
                        self.parallel.clone(),
                        i,
                        &self.experts,
                    )
                };
                layer.with_bias_dropout_fusion(self.bias_dropout_fusion)
            })
            .collect()
    }

    /// A norm of the trunk's kind over the hidden size, named `scope`.
    pub fn norm(&self, scope: &str) -> Norm {
        Norm::new(
            &self.init.scope(scope),
            self.config.normalization,
            self.config.hidden_size,
            self.config.norm_epsilon,
            self.config.apply_layernorm_1p,
            self.parallel.sequence_parallel,
        )
    }

    /// The output projection tied to the word embeddings of a post-process chunk: the
    /// embeddings themselves when the chunk holds them, else the last stage's copy. Megatron
    /// zero-fills that copy and all-reduces it with the first stage's; drawing it under the word
    /// embeddings' name gives the same values directly.
    pub fn tied_output(&self, pre_process: bool) -> OutputWeight {
        if pre_process {
            return OutputWeight::WordEmbeddings;
        }
        OutputWeight::Own {
            weight: self
                .init
                .scope("embedding.word_embeddings")
                .normal_partitioned(
                    "weight",
                    &[self.padded_vocab, self.config.hidden_size],
                    self.config.init_method_std,
                    0,
                ),
            shared_embedding: true,
        }
    }
}

/// The attributes of a parameter split over the tensor-parallel ranks.
pub(crate) fn sharded() -> ParamAttributes {
    ParamAttributes {
        tensor_parallel: true,
        ..Default::default()
    }
}

/// Names the word embeddings (tied to a copy on another stage when `tied_across_stages`) and the
/// learned position embeddings of a pre-process chunk.
pub(crate) fn push_embeddings(
    names: &mut NamedTensors,
    word: Option<&VocabParallelEmbedding>,
    positions: Option<&Param>,
    tied_across_stages: bool,
) {
    // The word embeddings are fusable as the output layer's weight (tied): the fused output
    // layer and cross entropy adds its gradient straight into the float32 buffer.
    if let Some(word) = word {
        names.push_fusable(
            "embedding.word_embeddings.weight",
            &word.weight,
            ParamAttributes {
                tied_across_stages,
                ..sharded()
            },
        );
    }
    if let Some(positions) = positions {
        names.push(
            "embedding.position_embeddings.weight",
            positions,
            ParamAttributes::default(),
        );
    }
}

/// Names `layers` `<scope>.<local index>`, as Megatron's checkpoints do.
pub(crate) fn push_layers(names: &mut NamedTensors, scope: &str, layers: &[TransformerLayer]) {
    for (i, layer) in layers.iter().enumerate() {
        layer.named_tensors(&mut names.scope(&format!("{scope}.{i}")));
    }
}

/// The output projection of a post-process chunk.
pub(crate) enum OutputWeight {
    /// Tied, and the word embeddings are in this chunk.
    WordEmbeddings,
    /// The untied `output_layer`, or the last stage's copy of the tied word embeddings.
    Own {
        weight: Param,
        shared_embedding: bool,
    },
}

impl OutputWeight {
    /// The projection's weight; `word_embeddings` are the chunk's own, if any.
    pub(crate) fn weight<'a>(
        &'a self,
        word_embeddings: Option<&'a VocabParallelEmbedding>,
    ) -> &'a Param {
        match self {
            OutputWeight::WordEmbeddings => {
                &word_embeddings
                    .expect("tied to this chunk's embeddings")
                    .weight
            }
            OutputWeight::Own { weight, .. } => weight,
        }
    }

    /// Names an own weight `output_layer.weight` (the tied embeddings are named already).
    pub(crate) fn push(&self, names: &mut NamedTensors) {
        if let OutputWeight::Own {
            weight,
            shared_embedding,
        } = self
        {
            let attributes = ParamAttributes {
                shared_embedding: *shared_embedding,
                tied_across_stages: *shared_embedding,
                ..sharded()
            };
            names.push_fusable("output_layer.weight", weight, attributes);
        }
    }
}

/// Position ids `[b, s]` counting from 0 for `tokens` `[b, s]`, which must fit the position table.
pub(crate) fn positions_from_zero(tokens: &Tensor, max_positions: i64) -> Result<Tensor> {
    let (b, s) = tokens.size2()?;
    ensure!(
        s <= max_positions,
        "sequence length {s} exceeds --max-position-embeddings {max_positions}"
    );
    Ok(Tensor::arange(s, (Kind::Int64, tokens.device()))
        .unsqueeze(0)
        .expand([b, s], false))
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

impl<'a> LayerStack<'a> {
    pub fn new(
        layers: &'a [TransformerLayer],
        scope: &'a str,
        options: &ModelOptions,
        parallel: &'a TensorParallel,
        gate: &'a GateSlot,
    ) -> Self {
        LayerStack {
            layers,
            scope,
            recompute: options.recompute,
            parallel,
            gate,
        }
    }

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
        hidden: Tensor,
        mask: &AttentionMask,
        rotary: Option<&RotaryTables>,
        memory: Option<&Memory>,
        train: bool,
    ) -> Result<Tensor> {
        let selective = self.recompute == Recompute::Selective;
        let mut stream = Residual::Summed(hidden);
        // Full recompute applies to training only.
        let (Recompute::Full { method, num_layers }, true) = (self.recompute, train) else {
            for (i, layer) in self.layers.iter().enumerate() {
                self.gate.layers(self.scope, i..i + 1)?;
                stream = layer.forward_residual(
                    stream,
                    mask,
                    rotary,
                    memory,
                    train,
                    selective && train,
                )?;
            }
            return Ok(stream.sum());
        };
        let chunk = num_layers.max(1);
        let mut start = 0;
        // Layers run outside recompute hand each other the stream, as without recompute.
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
                    let mut x = Residual::Summed(inputs[0].shallow_clone());
                    let memory = memory_mask.clone().map(|mask| Memory {
                        states: inputs[1].shallow_clone(),
                        mask,
                    });
                    for layer in &block {
                        x = layer.forward_residual(
                            x,
                            &mask,
                            rotary.as_ref(),
                            memory.as_ref(),
                            true,
                            false,
                        )?;
                    }
                    Ok(vec![x.sum()])
                };
                let hidden = stream.sum();
                let mut inputs = vec![&hidden];
                if let Some(memory) = memory {
                    inputs.push(&memory.states);
                }
                stream = Residual::Summed(autograd::recompute(run, &inputs)?.remove(0));
            } else {
                for layer in &self.layers[start..end] {
                    stream = layer.forward_residual(stream, mask, rotary, memory, true, false)?;
                }
            }
            start = end;
        }
        Ok(stream.sum())
    }
}

/// `hidden` as the output layer reads it: the whole sequence on every tensor-parallel rank.
fn output_layer_input(hidden: &Tensor, parallel: &TensorParallel) -> Result<Tensor> {
    let group = &parallel.group;
    if parallel.sequence_parallel {
        gather_from_sequence_parallel_region(hidden, group, true)
    } else {
        copy_to_tensor_parallel_region(hidden, group)
    }
}

/// A post-process chunk's last hidden states with the output layer that turns them into
/// logits, handed to the loss so that `--cross-entropy-loss-fusion` can compute the loss
/// without the full logits. GPT, BERT and T5 end in one.
pub struct OutputHead<'a> {
    /// `[s, b, h]`, a sequence-parallel slice when enabled.
    pub hidden: Tensor,
    pub weight: &'a Param,
    pub bias: Option<&'a Tensor>,
    pub parallel: &'a TensorParallel,
}

impl OutputHead<'_> {
    /// This rank's logits `[s, b, V/t]` (the hidden states gathered along the sequence first
    /// with sequence parallelism).
    pub fn logits(&self) -> Result<Tensor> {
        Ok(
            output_layer_input(&self.hidden, self.parallel)?
                .linear(self.weight.tensor(), self.bias),
        )
    }

    /// `Σ loss_mask · cross_entropy` over the tokens (float32), for `labels` and `loss_mask`
    /// `[b, s]`: through the logits, or with `fused` through the chunked output layer and
    /// cross entropy, which never hold all the logits.
    pub fn masked_loss_sum(
        &self,
        labels: &Tensor,
        loss_mask: &Tensor,
        fused: bool,
    ) -> Result<Tensor> {
        if !fused {
            let token_losses = cross_entropy(&self.logits()?, labels, &self.parallel.group)?;
            return Ok((token_losses * loss_mask).sum(Kind::Float));
        }
        fused_output_cross_entropy(
            &output_layer_input(&self.hidden, self.parallel)?,
            self.weight,
            self.bias,
            labels,
            loss_mask,
            &self.parallel.group,
            None,
        )
    }
}
