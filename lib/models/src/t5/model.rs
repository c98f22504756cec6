//! Megatron-core's T5 (spec §1.5): one shared embedding (word + learned absolute positions,
//! the decoder's positions restarting at 0), a pre-LN encoder under its padding mask with its
//! final norm, a decoder whose layers run causal self-attention, cross-attention over the
//! encoder's output and the MLP, with its own final norm, and the LM head: logits on the tied
//! word embeddings plus a vocab-parallel bias (an untied `output_layer` has no bias). T5 is not
//! split into pipeline stages: a `T5Model` is the whole model.

use std::sync::Arc;

use anyhow::{ensure, Result};
use tch::{Kind, Tensor};

use super::config::T5Config;
use crate::chunk::{impl_model_chunk, ChunkSpec};
use crate::config::TransformerConfig;
use crate::family::FamilyModel;
use crate::layers::{
    AttentionMask, KvCache, LayerCache, Memory, MemoryKeysValues, NamedParameter, NamedTensors,
    Norm, TensorParallel, TransformerLayer, VocabParallelEmbedding,
};
use crate::options::ModelOptions;
use crate::param::Param;
use crate::stack::{
    embedding_output, positions_from_zero, push_embeddings, push_layers, sharded, GateSlot,
    LayerStack, OutputHead, TrunkBuilder,
};
use megatron_parallel::{gather_from_tensor_parallel_region, Communicator, ParallelState};

/// One micro-batch as the model reads it.
pub struct T5Input<'a> {
    /// `[b, se]` encoder token ids.
    pub encoder_tokens: &'a Tensor,
    /// `[b, sd]` decoder token ids.
    pub decoder_tokens: &'a Tensor,
    /// `[b, se]` 1 on the encoder's real tokens, 0 on padding.
    pub encoder_mask: &'a Tensor,
}

enum OutputLayer {
    /// Tied to the word embeddings, with the LM head's vocab-parallel bias.
    Tied { bias: Param },
    /// `--untie-embeddings-and-output-weights`: its own weight, no bias (as Megatron core).
    Untied { weight: Param },
}

/// What incremental decoding keeps between steps: each decoder layer's self-attention keys
/// and values so far and its cross-attention keys and values of the encoder output, with the
/// encoder's padding mask.
pub struct T5DecoderState {
    cache: KvCache,
    memory: Vec<MemoryKeysValues>,
    mask: AttentionMask,
}

impl T5DecoderState {
    /// Decoder positions decoded so far.
    pub fn len(&self) -> i64 {
        self.cache.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }
}

pub struct T5Model {
    pub config: T5Config,
    spec: ChunkSpec,
    word_embeddings: VocabParallelEmbedding,
    position_embeddings: Param,
    encoder_layers: Vec<TransformerLayer>,
    encoder_final_layernorm: Norm,
    decoder_layers: Vec<TransformerLayer>,
    decoder_final_layernorm: Norm,
    output_layer: OutputLayer,
    options: ModelOptions,
    parallel: TensorParallel,
    gate: GateSlot,
}

impl T5Model {
    /// Builds and initialises the model; every weight is drawn from the seed and its global
    /// name, so any tensor-parallel layout holds the same weights.
    pub fn new(config: T5Config, options: ModelOptions, parallel: &ParallelState) -> Result<Self> {
        config.validate(parallel.tensor_parallel_size() as i64)?;
        let trunk_config = &config.transformer;
        let trunk = TrunkBuilder::new(trunk_config, &options, parallel);
        let word_embeddings = trunk.word_embeddings();
        let position_embeddings = trunk.position_embeddings();
        let encoder_layers = trunk.layers("encoder.layers", 0..config.encoder_num_layers, false);
        let encoder_final_layernorm = trunk.norm("encoder.final_layernorm");
        let decoder_layers = trunk.layers("decoder.layers", 0..config.decoder_num_layers, true);
        let decoder_final_layernorm = trunk.norm("decoder.final_layernorm");
        let head = trunk.init.scope("lm_head.output_layer");
        let padded_vocab = trunk.padded_vocab;
        let output_layer = if trunk_config.untie_embeddings_and_output_weights {
            OutputLayer::Untied {
                weight: head.normal_partitioned(
                    "weight",
                    &[padded_vocab, trunk_config.hidden_size],
                    trunk_config.init_method_std,
                    0,
                ),
            }
        } else {
            OutputLayer::Tied {
                bias: head.constant_partitioned(&[padded_vocab], 0.0),
            }
        };
        let tensor_parallel = trunk.parallel;
        Ok(T5Model {
            spec: ChunkSpec::whole(config.encoder_num_layers),
            config,
            word_embeddings,
            position_embeddings,
            encoder_layers,
            encoder_final_layernorm,
            decoder_layers,
            decoder_final_layernorm,
            output_layer,
            options,
            parallel: tensor_parallel,
            gate: GateSlot::default(),
        })
    }

    /// This rank's logits `[sd, b, V/t]` of every decoder position.
    pub fn forward(&self, input: &T5Input, train: bool) -> Result<Tensor> {
        self.forward_to_head(input, train)?.logits()
    }

    /// The model up to its output layer, over the final-normed decoder states (for the loss
    /// to apply).
    pub fn forward_to_head(&self, input: &T5Input, train: bool) -> Result<OutputHead<'_>> {
        let memory = self.encode(input.encoder_tokens, input.encoder_mask, train)?;
        self.decode_to_head(input.decoder_tokens, &memory, train)
    }

    /// The encoder's final-normed output `[se, b, h]` (a sequence-parallel slice when enabled)
    /// and the mask the decoder's cross-attention reads it under.
    pub fn encode(&self, tokens: &Tensor, padding_mask: &Tensor, train: bool) -> Result<Memory> {
        self.gate.before("embedding")?;
        let hidden = self.embed(tokens, train)?;
        let mask = AttentionMask::padding(padding_mask);
        let stack = LayerStack::new(
            &self.encoder_layers,
            "encoder.layers",
            &self.options,
            &self.parallel,
            &self.gate,
        );
        let hidden = stack.forward(hidden, &mask, None, train)?;
        self.gate.before("encoder.final_layernorm")?;
        Ok(Memory {
            states: self.encoder_final_layernorm.forward(&hidden),
            mask,
        })
    }

    /// The decoder over `tokens` `[b, sd]` attending to `memory`: logits `[sd, b, V/t]`.
    /// Self-attention is causal; the decoder's padding follows its real tokens, so the causal
    /// mask already keeps it from every real position (padded positions carry no loss).
    pub fn decode(&self, tokens: &Tensor, memory: &Memory, train: bool) -> Result<Tensor> {
        self.decode_to_head(tokens, memory, train)?.logits()
    }

    /// [`decode`](Self::decode) up to the output layer.
    fn decode_to_head(
        &self,
        tokens: &Tensor,
        memory: &Memory,
        train: bool,
    ) -> Result<OutputHead<'_>> {
        let hidden = self.embed(tokens, train)?;
        let stack = LayerStack::new(
            &self.decoder_layers,
            "decoder.layers",
            &self.options,
            &self.parallel,
            &self.gate,
        );
        let hidden =
            stack.forward_attending(hidden, &AttentionMask::Causal, None, Some(memory), train)?;
        self.gate.before("decoder.final_layernorm")?;
        let hidden = self.decoder_final_layernorm.forward(&hidden);
        self.gate.before("lm_head")?;
        Ok(self.head(hidden))
    }

    /// The output layer over the final-normed decoder states `hidden`.
    fn head(&self, hidden: Tensor) -> OutputHead<'_> {
        let (weight, bias) = match &self.output_layer {
            OutputLayer::Tied { bias } => (&self.word_embeddings.weight, Some(&**bias)),
            OutputLayer::Untied { weight } => (weight, None),
        };
        OutputHead {
            hidden,
            weight,
            bias,
            parallel: &self.parallel,
        }
    }

    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// The tensor-parallel group the model's layers are split over.
    pub fn tensor_group(&self) -> &Arc<dyn Communicator> {
        &self.parallel.group
    }

    /// Starts incremental decoding over the encoder's output `memory` for up to `capacity`
    /// decoder positions: every decoder layer's cross-attention keys and values are computed
    /// once here, and its self-attention keys and values are cached step by step.
    pub fn start_decoding(&self, memory: &Memory, capacity: i64) -> Result<T5DecoderState> {
        ensure!(
            !self.parallel.sequence_parallel,
            "incremental decoding runs without sequence parallelism"
        );
        let max_positions = self.config.transformer.max_position_embeddings;
        ensure!(
            (1..=max_positions).contains(&capacity),
            "{capacity} decoder positions: the model has {max_positions} (--max-position-embeddings)"
        );
        let trunk = &self.config.transformer;
        let batch = memory.states.size()[1];
        let heads = trunk.num_attention_heads / self.parallel.group.size() as i64;
        let (kind, device) = (self.options.params_dtype, self.options.device);
        let cache = KvCache {
            layers: self
                .decoder_layers
                .iter()
                .map(|_| LayerCache::new(batch, heads, capacity, trunk.kv_channels, kind, device))
                .collect(),
        };
        let memory_keys_values = self
            .decoder_layers
            .iter()
            .map(|layer| layer.memory_keys_values(&memory.states))
            .collect::<Result<Vec<_>>>()?;
        Ok(T5DecoderState {
            cache,
            memory: memory_keys_values,
            mask: memory.mask.clone(),
        })
    }

    /// The decoder over `tokens` `[b, s]` at the positions after those `state` holds, which
    /// they join: logits `[s, b, padded vocabulary]`, gathered from the tensor-parallel ranks.
    pub fn decode_cached(&self, tokens: &Tensor, state: &mut T5DecoderState) -> Result<Tensor> {
        let (batch, new) = tokens.size2()?;
        let start = state.cache.len();
        ensure!(
            start + new <= state.cache.capacity(),
            "decoding {} positions, more than the {} the decoder was started for",
            start + new,
            state.cache.capacity()
        );
        let positions = Tensor::arange_start(start, start + new, (Kind::Int64, tokens.device()))
            .unsqueeze(0)
            .expand([batch, new], true);
        let embedded = self.word_embeddings.forward(tokens)?
            + Tensor::embedding(&self.position_embeddings, &positions, -1, false, false);
        let mut hidden = embedding_output(embedded, 0.0, &self.parallel, false)?;
        let layers = self
            .decoder_layers
            .iter()
            .zip(&mut state.cache.layers)
            .zip(&state.memory);
        for ((layer, cache), memory) in layers {
            hidden = layer.forward_cached_attending(&hidden, cache, memory, &state.mask)?;
        }
        let logits = self
            .head(self.decoder_final_layernorm.forward(&hidden))
            .logits()?;
        gather_from_tensor_parallel_region(&logits, &self.parallel.group)
    }

    /// Word plus position embeddings of `tokens` `[b, s]`, positions counted from 0.
    fn embed(&self, tokens: &Tensor, train: bool) -> Result<Tensor> {
        let position_ids =
            positions_from_zero(tokens, self.config.transformer.max_position_embeddings)?;
        let embedded = self.word_embeddings.forward(tokens)?
            + Tensor::embedding(&self.position_embeddings, &position_ids, -1, false, false);
        embedding_output(
            embedded,
            self.config.transformer.hidden_dropout,
            &self.parallel,
            train,
        )
    }

    /// Runs the linears of the layers `plan` names in fp8; the encoder and the decoder are two
    /// stacks, each with its own first and last layers.
    pub fn enable_fp8(&mut self, plan: &crate::fp8::Fp8Plan) -> Result<()> {
        let (encoder, decoder) = (
            self.config.encoder_num_layers,
            self.config.decoder_num_layers,
        );
        crate::layers::enable_planned_fp8(plan, &mut self.encoder_layers, 0..encoder, encoder)?;
        crate::layers::enable_planned_fp8(plan, &mut self.decoder_layers, 0..decoder, decoder)
    }

    /// The MoE routers' expert biases under their checkpoint names (none: T5 has no MoE).
    pub fn expert_biases(&self) -> Vec<(String, crate::layers::moe::expert_bias::ExpertBias)> {
        let mut biases =
            crate::layers::scoped_expert_biases(&self.encoder_layers, "encoder.layers");
        biases.extend(crate::layers::scoped_expert_biases(
            &self.decoder_layers,
            "decoder.layers",
        ));
        biases
    }

    /// The fp8 linears under their checkpoint names.
    pub fn fp8_linears(&self) -> Vec<(String, std::sync::Arc<crate::layers::Fp8Linear>)> {
        let mut linears = crate::layers::scoped_fp8_linears(&self.encoder_layers, "encoder.layers");
        linears.extend(crate::layers::scoped_fp8_linears(
            &self.decoder_layers,
            "decoder.layers",
        ));
        linears
    }

    /// Every parameter under its Megatron-core T5 name, in construction order.
    pub fn named_parameters(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        let mut names = NamedTensors::new(&mut out);
        push_embeddings(
            &mut names,
            Some(&self.word_embeddings),
            Some(&self.position_embeddings),
            false,
        );
        push_layers(&mut names, "encoder.layers", &self.encoder_layers);
        self.encoder_final_layernorm
            .named_tensors(&mut names.scope("encoder.final_layernorm"));
        push_layers(&mut names, "decoder.layers", &self.decoder_layers);
        self.decoder_final_layernorm
            .named_tensors(&mut names.scope("decoder.final_layernorm"));
        match &self.output_layer {
            OutputLayer::Tied { bias } => {
                names.push("lm_head.output_layer.bias", bias, sharded());
            }
            OutputLayer::Untied { weight } => {
                names.push_fusable("lm_head.output_layer.weight", weight, sharded());
            }
        }
        out
    }
}

impl_model_chunk!(T5Model);

impl FamilyModel for T5Model {
    const MODEL_TYPE: &'static str = "T5";
    type Config = T5Config;

    fn trunk(config: &T5Config) -> &TransformerConfig {
        &config.transformer
    }

    fn build(config: T5Config, options: ModelOptions, parallel: &ParallelState) -> Result<Self> {
        T5Model::new(config, options, parallel)
    }
}
