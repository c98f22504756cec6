//! The architecture of a Megatron BERT: the trunk's flags, the pretraining heads it has, and the
//! finetuning head that may replace them.

use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

use crate::config::{Activation, PositionEmbeddingType, TransformerConfig};

/// The architecture of a Megatron BERT: the transformer trunk's flags plus BERT's own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BertConfig {
    #[serde(flatten)]
    pub transformer: TransformerConfig,
    /// The pooler and the sentence-order (binary) head, and two token types
    /// (`--bert-binary-head`, Megatron's default; off with `--bert-no-binary-head`).
    pub binary_head: bool,
    /// The LM head's GeLU: exact erf unless `--openai-gelu` (spec §1.1).
    pub lm_head_activation: Activation,
    /// The finetuning head that replaces the LM and binary heads; `None` when pretraining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_head: Option<TaskHead>,
}

/// A finetuning head on the pooled output (Megatron's `Classification` and `MultipleChoice`
/// models): pooler → dropout (`--hidden-dropout`) → linear.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskHead {
    /// One logit per class (MNLI: 3, QQP: 2); the tensors are `classification_head.*`.
    Classification { num_classes: i64 },
    /// One score per encoded choice (RACE), compared across a question's choices; the tensors
    /// are `multichoice_head.*`.
    MultipleChoice,
}

impl TaskHead {
    pub(crate) fn outputs(self) -> i64 {
        match self {
            TaskHead::Classification { num_classes } => num_classes,
            TaskHead::MultipleChoice => 1,
        }
    }

    /// Megatron's name of the head's linear layer.
    pub fn tensor_prefix(self) -> &'static str {
        match self {
            TaskHead::Classification { .. } => "classification_head",
            TaskHead::MultipleChoice => "multichoice_head",
        }
    }
}

impl BertConfig {
    /// Token types in the embeddings: 2 with the binary head or a task head, none without.
    pub fn num_tokentypes(&self) -> i64 {
        if self.binary_head || self.task_head.is_some() {
            2
        } else {
            0
        }
    }

    /// Megatron's BERT checks on top of the trunk's.
    pub fn validate(&self, tensor_parallel_size: i64) -> Result<()> {
        self.transformer.validate(tensor_parallel_size)?;
        if self.transformer.untie_embeddings_and_output_weights {
            bail!("BERT ties its output layer to the word embeddings: --untie-embeddings-and-output-weights is not supported");
        }
        if self.transformer.position_embedding_type != PositionEmbeddingType::LearnedAbsolute {
            bail!("BERT uses learned absolute position embeddings (--position-embedding-type learned_absolute)");
        }
        if self.binary_head && self.task_head.is_some() {
            bail!("a finetuning head replaces the binary head: a BERT cannot have both");
        }
        if let Some(TaskHead::Classification { num_classes }) = self.task_head {
            ensure!(
                num_classes >= 2,
                "a classification head needs at least 2 classes, got {num_classes}"
            );
        }
        Ok(())
    }
}
