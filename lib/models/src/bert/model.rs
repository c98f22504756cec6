//! Megatron-core's BERT (spec §1.4): word, position and (with the binary head) token-type
//! embeddings, a pre-LN encoder under the padding mask, the final norm, the LM head (dense → GeLU
//! → LayerNorm → logits on the tied word embeddings plus a vocab-parallel bias), and with the
//! binary head the pooler (tanh over position 0) and the sentence-order classifier. For
//! finetuning (`eval_tasks --task RACE|MNLI|QQP`, spec §7.4–7.5) a [`TaskHead`] replaces the LM
//! and binary heads: pooler → dropout → linear. A `BertModel` is one pipeline chunk, like
//! [`GptModel`](crate::GptModel).

use anyhow::{bail, Result};
use tch::Tensor;

use super::config::{BertConfig, TaskHead};
use crate::chunk::{impl_model_chunk, ChunkSpec};
use crate::config::{Activation, TransformerConfig};
use crate::family::FamilyModel;
use crate::layers::{
    AttentionMask, NamedParameter, NamedTensors, Norm, ParamAttributes, TensorParallel,
    TransformerLayer, VocabParallelEmbedding,
};
use crate::options::ModelOptions;
use crate::param::{Initializer, Param};
use crate::stack::{
    embedding_output, positions_from_zero, push_embeddings, push_layers, sharded, GateSlot,
    LayerStack, OutputHead, OutputWeight, TrunkBuilder,
};
use megatron_parallel::{gather_from_sequence_parallel_region, ParallelState};

/// A bias-carrying replicated linear (pooler, LM-head dense, binary head).
#[derive(Clone)]
struct Dense {
    weight: Param,
    bias: Param,
}

impl Dense {
    fn new(init: &Initializer, input: i64, output: i64, std: f64) -> Self {
        Dense {
            weight: init.normal("weight", &[output, input], std),
            bias: init.constant(&[output], 0.0),
        }
    }

    fn forward(&self, input: &Tensor) -> Tensor {
        input.linear(&*self.weight, Some(&*self.bias))
    }

    fn named_tensors(&self, out: &mut NamedTensors, attributes: ParamAttributes) {
        out.push("weight", &self.weight, attributes);
        out.push("bias", &self.bias, attributes);
    }
}

/// What a post-process chunk returns: the MLM head up to its output layer (whose logits are
/// this rank's `[s, b, V/t]`) and, with the binary head, the sentence-order logits `[b, 2]`.
pub struct BertOutput<'a> {
    pub lm: OutputHead<'a>,
    pub binary_logits: Option<Tensor>,
}

/// What a chunk consumes: token ids (and token types with the binary head) on the first stage,
/// the previous stage's hidden states elsewhere.
pub enum BertInput<'a> {
    Tokens {
        tokens: &'a Tensor,
        tokentypes: Option<&'a Tensor>,
    },
    Hidden(&'a Tensor),
}

/// One chunk's result: hidden states for the next stage, the pretraining heads' outputs, or the
/// task head's logits (`[b, num_classes]`, or `[b·choices, 1]` for multiple choice).
pub enum BertChunkOutput<'a> {
    Hidden(Tensor),
    Heads(BertOutput<'a>),
    Task(Tensor),
}

struct LmHead {
    dense: Dense,
    layer_norm: Norm,
    activation: Activation,
}

pub struct BertModel {
    pub config: BertConfig,
    pub spec: ChunkSpec,
    word_embeddings: Option<VocabParallelEmbedding>,
    position_embeddings: Option<Param>,
    tokentype_embeddings: Option<Param>,
    layers: Vec<TransformerLayer>,
    final_layernorm: Option<Norm>,
    pooler: Option<Dense>,
    lm_head: Option<LmHead>,
    output_weight: Option<OutputWeight>,
    output_bias: Option<Param>,
    binary_head: Option<Dense>,
    task_head: Option<Dense>,
    options: ModelOptions,
    parallel: TensorParallel,
    gate: GateSlot,
}

impl BertModel {
    /// The whole model on one pipeline stage.
    pub fn new(
        config: BertConfig,
        options: ModelOptions,
        parallel: &ParallelState,
    ) -> Result<Self> {
        let spec = ChunkSpec::whole(config.transformer.num_layers);
        Self::new_chunk(config, options, parallel, spec)
    }

    /// Builds and initialises one chunk; every weight is drawn from the seed and its global name,
    /// so any layout of the same model holds the same weights.
    pub fn new_chunk(
        config: BertConfig,
        options: ModelOptions,
        parallel: &ParallelState,
        spec: ChunkSpec,
    ) -> Result<Self> {
        config.validate(parallel.tensor_parallel_size() as i64)?;
        let trunk_config = &config.transformer;
        spec.check_layers(trunk_config.num_layers)?;
        let trunk = TrunkBuilder::new(trunk_config, &options, parallel);
        let init = &trunk.init;
        let (h, std) = (trunk_config.hidden_size, trunk_config.init_method_std);
        let embedding = init.scope("embedding");
        let pre = spec.pre_process;
        let post = spec.post_process;
        let word_embeddings = pre.then(|| trunk.word_embeddings());
        let position_embeddings = pre.then(|| trunk.position_embeddings());
        let tokentype_embeddings = (pre && config.num_tokentypes() > 0).then(|| {
            embedding.scope("tokentype_embeddings").normal(
                "weight",
                &[config.num_tokentypes(), h],
                std,
            )
        });
        let layers = trunk.layers("encoder.layers", spec.layers.clone(), false);
        let final_layernorm = post.then(|| trunk.norm("encoder.final_layernorm"));
        let task_head = config.task_head.filter(|_| post);
        let pooler = (post && (config.binary_head || task_head.is_some()))
            .then(|| Dense::new(&init.scope("pooler.dense"), h, h, std));
        let pretraining = post && task_head.is_none();
        let lm_head = pretraining.then(|| LmHead {
            dense: Dense::new(&init.scope("lm_head.dense"), h, h, std),
            layer_norm: trunk.norm("lm_head.layer_norm"),
            activation: config.lm_head_activation,
        });
        let output_weight = pretraining.then(|| trunk.tied_output(pre));
        let output_bias =
            pretraining.then(|| init.constant_partitioned(&[trunk.padded_vocab], 0.0));
        let binary_head = (pretraining && config.binary_head)
            .then(|| Dense::new(&init.scope("binary_head"), h, 2, std));
        let task_head = task_head
            .map(|head| Dense::new(&init.scope(head.tensor_prefix()), h, head.outputs(), std));
        let tensor_parallel = trunk.parallel;
        Ok(BertModel {
            config,
            spec,
            word_embeddings,
            position_embeddings,
            tokentype_embeddings,
            layers,
            final_layernorm,
            pooler,
            lm_head,
            output_weight,
            output_bias,
            binary_head,
            task_head,
            options,
            parallel: tensor_parallel,
            gate: GateSlot::default(),
        })
    }

    /// Runs this chunk under the padding mask (`[b, s]`, 1 for tokens, 0 for padding).
    pub fn forward_chunk(
        &self,
        input: BertInput,
        padding_mask: &Tensor,
        train: bool,
    ) -> Result<BertChunkOutput<'_>> {
        let hidden = match input {
            BertInput::Tokens { tokens, tokentypes } => {
                self.spec.check_input(true)?;
                self.gate.before("embedding")?;
                self.embed(tokens, tokentypes, train)?
            }
            BertInput::Hidden(hidden) => {
                self.spec.check_input(false)?;
                hidden.shallow_clone()
            }
        };
        let stack = LayerStack::new(
            &self.layers,
            "encoder.layers",
            &self.options,
            &self.parallel,
            &self.gate,
        );
        let mask = AttentionMask::padding(padding_mask);
        let hidden = stack.forward(hidden, &mask, None, train)?;
        let Some(norm) = &self.final_layernorm else {
            return Ok(BertChunkOutput::Hidden(hidden));
        };
        self.gate.before("encoder.final_layernorm")?;
        let hidden = norm.forward(&hidden);
        if let Some(head) = &self.task_head {
            let pooled = self.pooled(&hidden)?;
            self.gate.before(self.task_head_prefix())?;
            let dropped = pooled.dropout(self.config.transformer.hidden_dropout, train);
            return Ok(BertChunkOutput::Task(head.forward(&dropped)));
        }
        Ok(BertChunkOutput::Heads(self.heads(&hidden)?))
    }

    fn task_head_prefix(&self) -> &'static str {
        self.config
            .task_head
            .map_or("task_head", TaskHead::tensor_prefix)
    }

    /// The pooler (tanh of a dense layer) on position 0 of the whole sequence; every
    /// tensor-parallel rank computes it.
    fn pooled(&self, hidden: &Tensor) -> Result<Tensor> {
        let pooler = self.pooler.as_ref().expect("a chunk with a pooler");
        self.gate.before("pooler")?;
        let full = if self.parallel.sequence_parallel {
            gather_from_sequence_parallel_region(hidden, &self.parallel.group, false)?
        } else {
            hidden.shallow_clone()
        };
        Ok(pooler.forward(&full.get(0)).tanh())
    }

    /// The whole model on `tokens` `[b, s]`: MLM logits `[s, b, V/t]` and sentence-order logits.
    pub fn forward(
        &self,
        tokens: &Tensor,
        tokentypes: Option<&Tensor>,
        padding_mask: &Tensor,
        train: bool,
    ) -> Result<BertOutput<'_>> {
        self.spec.check_whole()?;
        match self.forward_chunk(
            BertInput::Tokens { tokens, tokentypes },
            padding_mask,
            train,
        )? {
            BertChunkOutput::Heads(output) => Ok(output),
            BertChunkOutput::Task(_) => {
                bail!("this BERT has a finetuning head, not the pretraining heads")
            }
            BertChunkOutput::Hidden(_) => unreachable!("a whole model ends in its heads"),
        }
    }

    fn embed(&self, tokens: &Tensor, tokentypes: Option<&Tensor>, train: bool) -> Result<Tensor> {
        let word = self
            .word_embeddings
            .as_ref()
            .expect("pre-process chunks have word embeddings");
        let positions = self
            .position_embeddings
            .as_ref()
            .expect("pre-process chunks have position embeddings");
        let position_ids =
            positions_from_zero(tokens, self.config.transformer.max_position_embeddings)?;
        let mut embedded =
            word.forward(tokens)? + Tensor::embedding(positions, &position_ids, -1, false, false);
        match (&self.tokentype_embeddings, tokentypes) {
            (Some(table), Some(types)) => {
                embedded = embedded + Tensor::embedding(table, types, -1, false, false);
            }
            (Some(_), None) => bail!("this BERT has a binary head and needs token types"),
            (None, Some(_)) => bail!("token types given to a BERT without token-type embeddings"),
            (None, None) => {}
        }
        embedding_output(
            embedded,
            self.config.transformer.hidden_dropout,
            &self.parallel,
            train,
        )
    }

    /// Pooler and binary head on position 0, LM head and logits on every position.
    fn heads(&self, hidden: &Tensor) -> Result<BertOutput<'_>> {
        let binary_logits = match &self.binary_head {
            Some(binary_head) => {
                let pooled = self.pooled(hidden)?;
                self.gate.before("binary_head")?;
                // Megatron-core's pretraining model has no dropout between pooler and head.
                Some(binary_head.forward(&pooled))
            }
            None => None,
        };
        let lm_head = self
            .lm_head
            .as_ref()
            .expect("post-process chunks have an LM head");
        self.gate.before("lm_head")?;
        let transformed = lm_head.dense.forward(hidden);
        let transformed = match lm_head.activation {
            Activation::GeluTanh => transformed.gelu("tanh"),
            _ => transformed.gelu("none"),
        };
        let transformed = lm_head.layer_norm.forward(&transformed);
        self.gate.before("output_layer")?;
        let weight = self
            .output_weight
            .as_ref()
            .expect("post-process chunk")
            .weight(self.word_embeddings.as_ref());
        Ok(BertOutput {
            lm: OutputHead {
                hidden: transformed,
                weight,
                bias: self.output_bias.as_deref(),
                parallel: &self.parallel,
            },
            binary_logits,
        })
    }

    /// Runs the linears of the layers `plan` names in fp8.
    pub fn enable_fp8(&mut self, plan: &crate::fp8::Fp8Plan) -> Result<()> {
        let num_layers = self.config.transformer.num_layers;
        crate::layers::enable_planned_fp8(
            plan,
            &mut self.layers,
            self.spec.layers.clone(),
            num_layers,
        )
    }

    /// The fp8 linears under their checkpoint names.
    pub fn fp8_linears(&self) -> Vec<(String, std::sync::Arc<crate::layers::Fp8Linear>)> {
        crate::layers::scoped_fp8_linears(&self.layers, "encoder.layers")
    }

    /// The MoE routers' expert biases under their checkpoint names (none: BERT has no MoE).
    pub fn expert_biases(&self) -> Vec<(String, crate::layers::moe::expert_bias::ExpertBias)> {
        crate::layers::scoped_expert_biases(&self.layers, "encoder.layers")
    }

    /// Every parameter of this chunk under its Megatron-core name, in construction order.
    pub fn named_parameters(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        let mut names = NamedTensors::new(&mut out);
        let tied_elsewhere = !(self.spec.pre_process && self.spec.post_process);
        push_embeddings(
            &mut names,
            self.word_embeddings.as_ref(),
            self.position_embeddings.as_ref(),
            tied_elsewhere,
        );
        if let Some(types) = &self.tokentype_embeddings {
            names.push(
                "embedding.tokentype_embeddings.weight",
                types,
                ParamAttributes::default(),
            );
        }
        push_layers(&mut names, "encoder.layers", &self.layers);
        if let Some(norm) = &self.final_layernorm {
            norm.named_tensors(&mut names.scope("encoder.final_layernorm"));
        }
        if let Some(pooler) = &self.pooler {
            pooler.named_tensors(&mut names.scope("pooler.dense"), ParamAttributes::default());
        }
        if let Some(head) = &self.lm_head {
            // The LM head runs on sequence-parallel slices: its gradients are partial sums.
            let attributes = ParamAttributes {
                sequence_parallel: self.parallel.sequence_parallel,
                ..Default::default()
            };
            head.dense
                .named_tensors(&mut names.scope("lm_head.dense"), attributes);
            head.layer_norm
                .named_tensors(&mut names.scope("lm_head.layer_norm"));
        }
        if let Some(output) = &self.output_weight {
            output.push(&mut names);
        }
        if let Some(bias) = &self.output_bias {
            names.push("output_layer.bias", bias, sharded());
        }
        if let Some(head) = &self.binary_head {
            head.named_tensors(&mut names.scope("binary_head"), ParamAttributes::default());
        }
        if let Some(head) = &self.task_head {
            head.named_tensors(
                &mut names.scope(self.task_head_prefix()),
                ParamAttributes::default(),
            );
        }
        out
    }
}

impl_model_chunk!(BertModel);

impl FamilyModel for BertModel {
    const MODEL_TYPE: &'static str = "BERT";
    type Config = BertConfig;

    fn trunk(config: &BertConfig) -> &TransformerConfig {
        &config.transformer
    }

    fn build(config: BertConfig, options: ModelOptions, parallel: &ParallelState) -> Result<Self> {
        BertModel::new(config, options, parallel)
    }
}
