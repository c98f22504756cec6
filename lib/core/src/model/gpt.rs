//! Megatron's GPT (spec §1.3): embeddings, the transformer stack, the final norm and the
//! (tied or untied) output projection, with Megatron-core state-dict names.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::config::{GptConfig, PositionEmbeddingType};
use super::layers::{AttentionMask, NamedTensors, Norm, RotaryEmbedding, RotaryTables, TransformerLayer, VocabParallelEmbedding};
use super::param::{Initializer, Param};
use crate::autograd::checkpoint;
use crate::parallel::{copy_to_tensor_parallel_region, gather_from_tensor_parallel_region, Communicator, ParallelState};

/// `--recompute-granularity full --recompute-method ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// Checkpoint the input of every chunk of `num_layers` layers.
    Uniform,
    /// Checkpoint the first `num_layers` layers individually, run the rest normally.
    Block,
}

/// What to recompute in backward instead of keeping activations (spec §4.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    None,
    /// `--recompute-activations`: the attention core only.
    Selective,
    Full { method: RecomputeMethod, num_layers: usize },
}

/// How the model is materialised: parameter dtype, device and recompute policy.
#[derive(Debug, Clone, Copy)]
pub struct ModelOptions {
    pub params_dtype: Kind,
    pub device: Device,
    pub recompute: Recompute,
}

pub struct GptModel {
    pub config: GptConfig,
    pub word_embeddings: VocabParallelEmbedding,
    pub position_embeddings: Option<Param>,
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: Norm,
    /// The untied output projection `[V/t, h]`; `None` when tied to the word embeddings.
    pub output_layer: Option<Param>,
    rotary: Option<RotaryEmbedding>,
    options: ModelOptions,
    tensor_group: Arc<dyn Communicator>,
}

impl GptModel {
    /// Builds and initialises the model; draws follow Megatron's construction order, so the
    /// seed fixes the weights independently of device and tensor-parallel size.
    pub fn new(config: GptConfig, options: ModelOptions, parallel: &ParallelState) -> Result<Self> {
        let tp = parallel.tensor_parallel_size() as i64;
        config.validate(tp)?;
        let group = parallel.tensor.clone();
        let init = Initializer {
            dtype: options.params_dtype,
            device: options.device,
            tensor_parallel_rank: parallel.tensor_parallel_rank() as i64,
            tensor_parallel_size: tp,
        };
        let h = config.hidden_size;
        let std = config.init_method_std;
        let padded_vocab = config.padded_vocab_size(tp);
        let word_embeddings = VocabParallelEmbedding::new(&init, padded_vocab, h, std, group.clone());
        let position_embeddings = (config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute)
            .then(|| init.normal(&[config.max_position_embeddings, h], std));
        let layers = (0..config.num_layers).map(|_| TransformerLayer::new(&init, &config, group.clone())).collect();
        let final_layernorm = Norm::new(&init, config.normalization, h, config.norm_epsilon, config.apply_layernorm_1p);
        let output_layer = config
            .untie_embeddings_and_output_weights
            .then(|| init.normal_partitioned(&[padded_vocab, h], std, 0));
        let rotary = (config.position_embedding_type == PositionEmbeddingType::Rope)
            .then(|| RotaryEmbedding::new(config.rotary_dim(), config.rotary_base));
        Ok(GptModel {
            config,
            word_embeddings,
            position_embeddings,
            layers,
            final_layernorm,
            output_layer,
            rotary,
            options,
            tensor_group: group,
        })
    }

    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// `tokens`, `position_ids`: `[b, s]`. Returns this rank's logits `[s, b, V/t]`.
    pub fn forward(&self, tokens: &Tensor, position_ids: &Tensor, mask: &AttentionMask, train: bool) -> Result<Tensor> {
        let hidden = self.embed(tokens, position_ids, train)?;
        let rotary = self.rotary.as_ref().map(|r| r.tables(0, tokens.size()[1], tokens.device()));
        let hidden = self.run_layers(hidden, mask, rotary.as_ref(), train)?;
        let hidden = self.final_layernorm.forward(&hidden);
        self.logits(&hidden)
    }

    /// Like [`forward`](Self::forward) but with the full vocabulary gathered from every rank.
    pub fn forward_full_logits(&self, tokens: &Tensor, position_ids: &Tensor, mask: &AttentionMask) -> Result<Tensor> {
        let logits = self.forward(tokens, position_ids, mask, false)?;
        gather_from_tensor_parallel_region(&logits, &self.tensor_group)
    }

    fn embed(&self, tokens: &Tensor, position_ids: &Tensor, train: bool) -> Result<Tensor> {
        let mut embedded = self.word_embeddings.forward(tokens)?;
        if let Some(positions) = &self.position_embeddings {
            ensure!(
                tokens.size()[1] <= self.config.max_position_embeddings,
                "sequence length {} exceeds --max-position-embeddings {}",
                tokens.size()[1],
                self.config.max_position_embeddings
            );
            embedded = embedded + Tensor::embedding(positions, position_ids, -1, false, false);
        }
        Ok(embedded.transpose(0, 1).contiguous().dropout(self.config.hidden_dropout, train))
    }

    fn run_layers(&self, mut hidden: Tensor, mask: &AttentionMask, rotary: Option<&RotaryTables>, train: bool) -> Result<Tensor> {
        let selective = self.options.recompute == Recompute::Selective;
        let Recompute::Full { method, num_layers } = self.options.recompute else {
            for layer in &self.layers {
                hidden = layer.forward(&hidden, mask, rotary, train, selective && train)?;
            }
            return Ok(hidden);
        };
        if !train {
            for layer in &self.layers {
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

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let weight = self.output_layer.as_ref().unwrap_or(&self.word_embeddings.weight);
        let hidden = copy_to_tensor_parallel_region(hidden, &self.tensor_group)?;
        Ok(hidden.linear::<&Tensor>(weight, None))
    }

    /// Every parameter under its Megatron-core name, in construction order.
    pub fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        let mut names = NamedTensors::new(&mut out);
        names.push("embedding.word_embeddings.weight", &self.word_embeddings.weight);
        if let Some(positions) = &self.position_embeddings {
            names.push("embedding.position_embeddings.weight", positions);
        }
        for (i, layer) in self.layers.iter().enumerate() {
            layer.named_tensors(&mut names.scope(&format!("decoder.layers.{i}")));
        }
        self.final_layernorm.named_tensors(&mut names.scope("decoder.final_layernorm"));
        if let Some(output) = &self.output_layer {
            names.push("output_layer.weight", output);
        }
        out
    }

    /// Copies `tensors` (Megatron-core names, any float dtype) into the parameters. Every
    /// parameter must be present with its exact shape and no unknown name may remain, so a
    /// checkpoint of another architecture fails loudly instead of half-loading.
    pub fn load_parameters(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let parameters = self.named_parameters();
        let mut unknown: Vec<&String> = tensors.keys().filter(|k| !parameters.iter().any(|(n, _)| n == *k)).collect();
        if !unknown.is_empty() {
            unknown.sort();
            bail!("unexpected tensors for this model: {}", join_names(&unknown));
        }
        tch::no_grad(|| -> Result<()> {
            for (name, parameter) in &parameters {
                let source = tensors.get(name).with_context(|| format!("missing tensor {name}"))?;
                ensure!(
                    source.size() == parameter.size(),
                    "tensor {name}: shape {:?} but the model expects {:?}",
                    source.size(),
                    parameter.size()
                );
                parameter.shallow_clone().copy_(source);
            }
            Ok(())
        })
    }

    pub fn parameter_count(&self) -> i64 {
        self.named_parameters().iter().map(|(_, t)| t.numel() as i64).sum()
    }
}

fn join_names(names: &[&String]) -> String {
    const SHOWN: usize = 8;
    let mut text = names.iter().take(SHOWN).map(|s| s.as_str()).collect::<Vec<_>>().join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}
