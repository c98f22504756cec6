//! Megatron's GPT (spec §1.3): embeddings, the transformer stack, the final norm and the
//! (tied or untied) output projection, with Megatron-core state-dict names. A `GptModel` is one
//! pipeline chunk: the whole model without pipeline parallelism, else a block of layers with
//! the embeddings on the first stage and the head on the last.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Result};
use tch::{Kind, Tensor};

use crate::chunk::{impl_model_chunk, load_named, ChunkSpec};
use crate::config::{PositionEmbeddingType, TransformerConfig};
use crate::family::FamilyModel;
use crate::fp8::Fp8Plan;
use crate::layers::moe::expert_bias::ExpertBias;
use crate::layers::scoped_fp8_linears;
use crate::layers::{
    AttentionMask, Fp8Linear, KvCache, LayerCache, NamedParameter, NamedTensors, Norm,
    PagedKvCache, PagedStep, RotaryEmbedding, RotaryTables, TensorParallel, TransformerLayer,
    VocabParallelEmbedding,
};
use crate::options::ModelOptions;
use crate::param::Param;
use crate::stack::{
    embedding_output, push_embeddings, push_layers, GateSlot, LayerStack, OutputHead, OutputWeight,
    ParamGate, TrunkBuilder,
};
use megatron_kernels::ops::{decode_embedding, decode_gemv};
use megatron_parallel::{gather_from_tensor_parallel_region, ParallelState};

/// What a chunk consumes: token ids on the first stage, the previous stage's hidden states
/// (`[s, b, h]`, `[s/t, b, h]` with sequence parallelism) elsewhere.
pub enum ChunkInput<'a> {
    Tokens {
        tokens: &'a Tensor,
        position_ids: &'a Tensor,
    },
    Hidden(&'a Tensor),
}

/// What a chunk's forward pass ends in: hidden states for the next pipeline stage, or the
/// post-process chunk's output layer over its last hidden states.
pub enum ChunkOutput<'a> {
    Hidden(Tensor),
    Head(OutputHead<'a>),
}

pub struct GptModel {
    pub config: TransformerConfig,
    pub spec: ChunkSpec,
    pub word_embeddings: Option<VocabParallelEmbedding>,
    pub position_embeddings: Option<Param>,
    pub layers: Vec<TransformerLayer>,
    pub final_layernorm: Option<Norm>,
    output: Option<OutputWeight>,
    rotary: Option<RotaryEmbedding>,
    options: ModelOptions,
    parallel: TensorParallel,
    gate: GateSlot,
}

impl GptModel {
    /// The whole model on one pipeline stage.
    pub fn new(
        config: TransformerConfig,
        options: ModelOptions,
        parallel: &ParallelState,
    ) -> Result<Self> {
        let spec = ChunkSpec::whole(config.num_layers);
        Self::new_chunk(config, options, parallel, spec)
    }

    /// Builds and initialises one chunk. Every weight is drawn from the seed and its global name
    /// (see [`Initializer`]), so any layout of the same model holds the same weights.
    pub fn new_chunk(
        config: TransformerConfig,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<Self> {
        config.validate(parallel.tensor_parallel_size() as i64)?;
        spec.check_layers(config.num_layers)?;
        let trunk = TrunkBuilder::new(&config, &options, parallel);
        let word_embeddings = spec.pre_process.then(|| trunk.word_embeddings());
        let position_embeddings = (spec.pre_process
            && config.position_embedding_type == PositionEmbeddingType::LearnedAbsolute)
            .then(|| trunk.position_embeddings());
        let layers = trunk.layers("decoder.layers", spec.layers.clone(), false);
        let final_layernorm = spec
            .post_process
            .then(|| trunk.norm("decoder.final_layernorm"));
        let output = spec.post_process.then(|| {
            if config.untie_embeddings_and_output_weights {
                OutputWeight::Own {
                    weight: trunk.init.scope("output_layer").normal_partitioned(
                        "weight",
                        &[trunk.padded_vocab, config.hidden_size],
                        config.init_method_std,
                        0,
                    ),
                    shared_embedding: false,
                }
            } else {
                trunk.tied_output(spec.pre_process)
            }
        });
        let rotary = (config.position_embedding_type == PositionEmbeddingType::Rope).then(|| {
            RotaryEmbedding::new(
                config.rotary_dim(),
                config.rotary_base,
                config.rope_scaling,
                options.rope_fusion,
            )
        });
        let tensor_parallel = trunk.parallel;
        Ok(GptModel {
            config,
            spec,
            word_embeddings,
            position_embeddings,
            layers,
            final_layernorm,
            output,
            rotary,
            options,
            parallel: tensor_parallel,
            gate: GateSlot::default(),
        })
    }

    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// `tokens`, `position_ids`: `[b, s]`. Returns this rank's logits `[s, b, V/t]`; the chunk
    /// must hold the whole model.
    pub fn forward(
        &self,
        tokens: &Tensor,
        position_ids: &Tensor,
        mask: &AttentionMask,
        train: bool,
    ) -> Result<Tensor> {
        self.spec.check_whole()?;
        self.forward_chunk(
            ChunkInput::Tokens {
                tokens,
                position_ids,
            },
            mask,
            train,
        )
    }

    /// Runs this chunk: logits `[s, b, V/t]` from a post-process chunk, hidden states for the
    /// next stage otherwise.
    pub fn forward_chunk(
        &self,
        input: ChunkInput,
        mask: &AttentionMask,
        train: bool,
    ) -> Result<Tensor> {
        match self.forward_to_head(input, mask, train)? {
            ChunkOutput::Hidden(hidden) => Ok(hidden),
            ChunkOutput::Head(head) => head.logits(),
        }
    }

    /// Runs this chunk up to its output layer: the final-normed hidden states with the output
    /// layer from a post-process chunk (for the loss to apply), hidden states for the next
    /// stage otherwise.
    pub fn forward_to_head(
        &self,
        input: ChunkInput,
        mask: &AttentionMask,
        train: bool,
    ) -> Result<ChunkOutput<'_>> {
        let hidden = match input {
            ChunkInput::Tokens {
                tokens,
                position_ids,
            } => {
                self.spec.check_input(true)?;
                self.gate("embedding")?;
                self.embed(tokens, position_ids, train)?
            }
            ChunkInput::Hidden(hidden) => {
                self.spec.check_input(false)?;
                hidden.shallow_clone()
            }
        };
        let sequence = hidden.size()[0]
            * if self.parallel.sequence_parallel {
                self.parallel.group.size() as i64
            } else {
                1
            };
        // Under context parallelism the rank's positions are its two chunks' originals, or
        // with packed sequences their positions within their documents.
        let rotary = self.rotary.as_ref().map(|r| match mask {
            AttentionMask::ContextParallel(context) => match context.document_positions() {
                Some(positions) => r.tables_per_row(positions),
                None => r.tables_at(&context.context().positions(sequence, hidden.device())),
            },
            // Packed documents each start their rotary positions at 0.
            AttentionMask::Packed(packed) => r.tables_per_row(&packed.positions),
            _ => r.tables(0, sequence, hidden.device()),
        });
        let hidden = self.stack().forward(hidden, mask, rotary.as_ref(), train)?;
        match &self.final_layernorm {
            Some(norm) => {
                self.gate("decoder.final_layernorm")?;
                self.gate("output_layer")?;
                Ok(ChunkOutput::Head(self.head(norm.forward(&hidden))))
            }
            None => Ok(ChunkOutput::Hidden(hidden)),
        }
    }

    /// Installs the gate the forward pass consults before each module (`--overlap-param-gather`).
    pub fn set_param_gate(&mut self, gate: Arc<dyn ParamGate>) {
        self.gate.set(gate);
    }

    fn gate(&self, module: &str) -> Result<()> {
        self.gate.before(module)
    }

    fn stack(&self) -> LayerStack<'_> {
        LayerStack::new(
            &self.layers,
            "decoder.layers",
            &self.options,
            &self.parallel,
            &self.gate,
        )
    }

    /// Like [`forward`](Self::forward) but with the full vocabulary gathered from every rank.
    pub fn forward_full_logits(
        &self,
        tokens: &Tensor,
        position_ids: &Tensor,
        mask: &AttentionMask,
    ) -> Result<Tensor> {
        let logits = self.forward(tokens, position_ids, mask, false)?;
        gather_from_tensor_parallel_region(&logits, &self.parallel.group)
    }

    /// An empty KV cache for `batch` sequences of up to `capacity` positions.
    pub fn new_kv_cache(&self, batch: i64, capacity: i64) -> Result<KvCache> {
        ensure!(
            self.spec.pre_process && self.spec.post_process && !self.parallel.sequence_parallel,
            "cached inference runs on a whole model (no pipeline stages) without sequence parallelism"
        );
        // Each tensor-parallel rank caches its own query groups.
        let groups = self.config.num_query_groups / self.parallel.group.size() as i64;
        let (kind, device) = (self.options.params_dtype, self.options.device);
        let layers = self
            .layers
            .iter()
            .map(|_| {
                LayerCache::new(
                    batch,
                    groups,
                    capacity,
                    self.config.kv_channels,
                    kind,
                    device,
                )
            })
            .collect();
        Ok(KvCache { layers })
    }

    /// Inference on `tokens` (`[b, s]`) at the positions after those in `cache`, which they
    /// join: logits `[s, b, padded vocabulary]`, gathered from the tensor-parallel ranks.
    pub fn forward_cached(&self, tokens: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let new = tokens.size2()?.1;
        let start = cache.len();
        ensure!(
            start + new <= self.config.max_position_embeddings,
            "{} positions exceed --max-position-embeddings {}",
            start + new,
            self.config.max_position_embeddings
        );
        let positions = Tensor::arange_start(start, start + new, (Kind::Int64, tokens.device()));
        self.run_cached(
            tokens,
            &positions,
            cache,
            |layer, hidden, rotary, layer_cache| layer.forward_cached(hidden, rotary, layer_cache),
        )
    }

    /// Inference through the KV cache: `tokens` (`[b, s]`) at `positions` (`[s]`, on the
    /// device), each layer run by `layer_step`; logits `[s, b, padded vocabulary]` gathered from
    /// the tensor-parallel ranks.
    fn run_cached(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        cache: &mut KvCache,
        mut layer_step: impl FnMut(
            &TransformerLayer,
            &Tensor,
            Option<&RotaryTables>,
            &mut LayerCache,
        ) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let batch = tokens.size()[0];
        let position_ids = positions.unsqueeze(0).expand([batch, -1], true);
        let mut hidden = self.embed(tokens, &position_ids, false)?;
        let rotary = self.rotary.as_ref().map(|r| r.tables_at(positions));
        for (layer, layer_cache) in self.layers.iter().zip(&mut cache.layers) {
            hidden = layer_step(layer, &hidden, rotary.as_ref(), layer_cache)?;
        }
        self.inference_head(&hidden)
    }

    /// The final norm and the logits of a whole model's last hidden states, gathered from the
    /// tensor-parallel ranks.
    fn inference_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let norm = self
            .final_layernorm
            .as_ref()
            .expect("whole models have the final norm");
        gather_from_tensor_parallel_region(
            &self.head(norm.forward(hidden)).logits()?,
            &self.parallel.group,
        )
    }

    /// An empty paged KV cache of `blocks` blocks (see [`PagedKvCache`]).
    pub fn new_paged_kv_cache(&self, blocks: i64) -> Result<PagedKvCache> {
        let (groups, kind) = self.kv_cache_shape()?;
        PagedKvCache::new(
            self.layers.len(),
            blocks,
            groups,
            self.config.kv_channels,
            kind,
            self.options.device,
        )
    }

    /// Bytes one block of a paged KV cache of this model takes.
    pub fn kv_block_bytes(&self) -> Result<u64> {
        let (groups, kind) = self.kv_cache_shape()?;
        Ok(PagedKvCache::block_bytes(
            self.layers.len(),
            groups,
            self.config.kv_channels,
            kind,
        ))
    }

    /// Query groups of this rank and the dtype a KV cache holds.
    fn kv_cache_shape(&self) -> Result<(i64, Kind)> {
        ensure!(
            self.spec.pre_process && self.spec.post_process && !self.parallel.sequence_parallel,
            "cached inference runs on a whole model (no pipeline stages) without sequence parallelism"
        );
        let groups = self.config.num_query_groups / self.parallel.group.size() as i64;
        Ok((groups, self.options.params_dtype))
    }

    /// Inference of new positions of several sequences through a paged KV cache: `tokens`
    /// (`[b, s]`) at `positions` (`[b, s]`, int64, on the device), their keys and values
    /// stored and attended to as `step` says. Its kernels depend only on the shapes, so a
    /// decode step can be captured in a CUDA graph. Logits `[s, b, padded vocabulary]`,
    /// gathered from the tensor-parallel ranks.
    pub fn forward_paged(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        cache: &mut PagedKvCache,
        step: &PagedStep,
    ) -> Result<Tensor> {
        ensure!(
            cache.num_layers() == self.layers.len(),
            "a KV cache of {} layers for a model of {}",
            cache.num_layers(),
            self.layers.len()
        );
        let mut hidden = self.embed_paged(tokens, positions, step)?;
        let rotary = self.rotary.as_ref().map(|r| r.tables_per_row(positions));
        for (index, layer) in self.layers.iter().enumerate() {
            hidden = layer.forward_paged(&hidden, rotary.as_ref(), cache.layer_mut(index), step)?;
        }
        let (s, b, _) = hidden.size3()?;
        if step.fuses(s * b) && self.head_supports_decode_fusion(hidden.kind()) {
            return self.fused_inference_head(&hidden);
        }
        self.inference_head(&hidden)
    }

    /// Whether decode steps can run some of this model through the fused decode kernels
    /// ([`megatron_kernels::ops::decode_gemv`]): a layer (see
    /// [`TransformerLayer::supports_decode_fusion`]) or the final norm and output layer.
    pub fn supports_decode_fusion(&self) -> bool {
        let kind = self.options.params_dtype;
        self.options.device.is_cuda()
            && decode_gemv::supports(kind)
            && self.spec.post_process
            && (self.head_supports_decode_fusion(kind)
                || self.layers.iter().any(|l| l.supports_decode_fusion()))
    }

    /// Whether the final norm and the output layer of hidden states of `kind` can run as one
    /// fused decode kernel.
    fn head_supports_decode_fusion(&self, kind: Kind) -> bool {
        let (Some(output), Some(_)) = (&self.output, &self.final_layernorm) else {
            return false;
        };
        let weight = output.weight(self.word_embeddings.as_ref());
        weight.kind() == kind && decode_gemv::fits(1, weight) && !self.parallel.sequence_parallel
    }

    /// [`inference_head`](Self::inference_head) of few rows as one fused decode kernel.
    fn fused_inference_head(&self, hidden: &Tensor) -> Result<Tensor> {
        let norm = self
            .final_layernorm
            .as_ref()
            .expect("whole models have the final norm");
        let weight = self
            .output
            .as_ref()
            .expect("post-process chunks have an output layer")
            .weight(self.word_embeddings.as_ref());
        let (s, b, h) = hidden.size3()?;
        let logits = decode_gemv::decode_linear(
            &hidden.reshape([s * b, h]),
            weight,
            Some(&norm.as_input_norm()),
            &decode_gemv::Epilogue::default(),
        )?;
        gather_from_tensor_parallel_region(&logits.view([s, b, -1]), &self.parallel.group)
    }

    /// [`embed`](Self::embed) for inference through a paged cache: a decode step of few rows
    /// with the decode kernels on runs it as one kernel ([`decode_embedding`]) where the kernel
    /// serves the tables (whole on this rank, no sequence parallelism).
    fn embed_paged(&self, tokens: &Tensor, positions: &Tensor, step: &PagedStep) -> Result<Tensor> {
        let (rows, length) = tokens.size2()?;
        let tables = self
            .word_embeddings
            .as_ref()
            .and_then(|w| w.whole_table())
            .filter(|_| length == 1 && step.fuses(rows) && !self.parallel.sequence_parallel);
        if let Some(words) = tables {
            let places = self.position_embeddings.as_ref().map(Param::tensor);
            if decode_embedding::usable(words, places) {
                return decode_embedding::embed(words, places, tokens, positions);
            }
        }
        self.embed(tokens, positions, false)
    }

    fn embed(&self, tokens: &Tensor, position_ids: &Tensor, train: bool) -> Result<Tensor> {
        let word_embeddings = self
            .word_embeddings
            .as_ref()
            .expect("pre-process chunks have word embeddings");
        let mut embedded = word_embeddings.forward(tokens)?;
        if let Some(positions) = &self.position_embeddings {
            ensure!(
                tokens.size()[1] <= self.config.max_position_embeddings,
                "sequence length {} exceeds --max-position-embeddings {}",
                tokens.size()[1],
                self.config.max_position_embeddings
            );
            embedded = embedded + Tensor::embedding(positions, position_ids, -1, false, false);
        }
        embedding_output(embedded, self.config.hidden_dropout, &self.parallel, train)
    }

    /// The output layer over the final-normed `hidden`.
    fn head(&self, hidden: Tensor) -> OutputHead<'_> {
        let weight = self
            .output
            .as_ref()
            .expect("post-process chunks have an output layer")
            .weight(self.word_embeddings.as_ref());
        OutputHead {
            hidden,
            weight,
            bias: None,
            parallel: &self.parallel,
        }
    }

    /// Runs the linears of the layers `plan` names in fp8.
    pub fn enable_fp8(&mut self, plan: &Fp8Plan) -> Result<()> {
        crate::layers::enable_planned_fp8(
            plan,
            &mut self.layers,
            self.spec.layers.clone(),
            self.config.num_layers,
        )
    }

    /// The fp8 linears under their checkpoint names.
    pub fn fp8_linears(&self) -> Vec<(String, Arc<Fp8Linear>)> {
        scoped_fp8_linears(&self.layers, "decoder.layers")
    }

    /// The MoE routers' expert biases under their checkpoint names.
    pub fn expert_biases(&self) -> Vec<(String, ExpertBias)> {
        crate::layers::scoped_expert_biases(&self.layers, "decoder.layers")
    }

    /// Every parameter of this chunk under its Megatron-core name (layer indices local to the
    /// chunk, as in Megatron's checkpoints), in construction order.
    pub fn named_parameters(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        let mut names = NamedTensors::new(&mut out);
        // Tied embeddings split over two stages exist on both: the first stage's and the last
        // stage's copy get their gradients summed.
        let tied_elsewhere = !self.config.untie_embeddings_and_output_weights
            && !(self.spec.pre_process && self.spec.post_process);
        push_embeddings(
            &mut names,
            self.word_embeddings.as_ref(),
            self.position_embeddings.as_ref(),
            tied_elsewhere,
        );
        push_layers(&mut names, "decoder.layers", &self.layers);
        if let Some(norm) = &self.final_layernorm {
            norm.named_tensors(&mut names.scope("decoder.final_layernorm"));
        }
        if let Some(output) = &self.output {
            output.push(&mut names);
        }
        out
    }

    /// Copies `tensors` (Megatron-core names) into the parameters; see [`load_named`].
    pub fn load_parameters(&self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        load_named(&self.named_parameters(), tensors)
    }

    pub fn parameter_count(&self) -> i64 {
        self.named_parameters()
            .iter()
            .map(|p| p.tensor.numel() as i64)
            .sum()
    }
}

impl_model_chunk!(GptModel);

impl FamilyModel for GptModel {
    const MODEL_TYPE: &'static str = "GPT";
    type Config = TransformerConfig;

    fn trunk(config: &TransformerConfig) -> &TransformerConfig {
        config
    }

    fn build(
        config: TransformerConfig,
        options: ModelOptions,
        parallel: &ParallelState,
    ) -> Result<Self> {
        GptModel::new(config, options, parallel)
    }
}
