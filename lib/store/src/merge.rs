//! Merging a tensor- and pipeline-parallel GPT, BERT or T5 checkpoint into the tensors of one
//! unsplit model: inference tools load any layout, and tests compare parallel runs with a
//! single one.

use std::collections::{BTreeMap, HashMap};

use anyhow::{bail, ensure, Context, Result};
use tch::{Device, Tensor};

use super::layout::rank_directory_name;
use super::store::{CheckpointDirectory, MODEL_FILE};
use megatron_models::{
    Activation, BertModel, FamilyModel, GptModel, PipelineSplit, T5Model, TransformerConfig,
};

/// How a GPT tensor is divided over the tensor-parallel ranks (spec §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorSplit {
    /// Every rank holds the whole tensor (norms, position embeddings, row-parallel biases).
    Replicated,
    /// Split along dim 0 in `stride` interleaved parts: column-parallel weights and biases,
    /// the vocabulary-parallel embedding and output layer; SwiGLU's `[gate; up]` has stride 2.
    Rows { stride: i64 },
    /// Split along dim 1: the row-parallel weights.
    Columns,
}

/// The split of the tensor named `name` (Megatron-core name, layer index included).
pub fn tensor_split(name: &str, config: &TransformerConfig) -> TensorSplit {
    let leaf = name
        .rsplit_once(".layers.")
        .map(|(_, rest)| rest.split_once('.').map_or(rest, |(_, leaf)| leaf))
        .unwrap_or(name);
    match leaf {
        "self_attention.linear_qkv.weight"
        | "self_attention.linear_qkv.bias"
        | "cross_attention.linear_q.weight"
        | "cross_attention.linear_q.bias"
        | "cross_attention.linear_kv.weight"
        | "cross_attention.linear_kv.bias" => TensorSplit::Rows { stride: 1 },
        "mlp.linear_fc1.weight" | "mlp.linear_fc1.bias" => TensorSplit::Rows {
            stride: if config.activation == Activation::Swiglu {
                2
            } else {
                1
            },
        },
        "embedding.word_embeddings.weight"
        | "output_layer.weight"
        | "output_layer.bias"
        | "lm_head.output_layer.weight"
        | "lm_head.output_layer.bias" => TensorSplit::Rows { stride: 1 },
        "self_attention.linear_proj.weight"
        | "cross_attention.linear_proj.weight"
        | "mlp.linear_fc2.weight" => TensorSplit::Columns,
        _ => TensorSplit::Replicated,
    }
}

/// Joins the tensor-parallel shards of one tensor, in rank order.
pub fn join_shards(shards: &[Tensor], split: TensorSplit) -> Tensor {
    match split {
        TensorSplit::Replicated => shards[0].shallow_clone(),
        TensorSplit::Columns => Tensor::cat(shards, 1),
        TensorSplit::Rows { stride } => {
            let parts: Vec<Vec<Tensor>> = shards.iter().map(|s| s.chunk(stride, 0)).collect();
            let ordered: Vec<Tensor> = (0..stride as usize)
                .flat_map(|p| parts.iter().map(move |r| r[p].shallow_clone()))
                .collect();
            Tensor::cat(&ordered, 0)
        }
    }
}

/// This rank's shard of one tensor (the inverse of [`join_shards`]).
pub fn take_shard(tensor: &Tensor, split: TensorSplit, rank: usize, size: usize) -> Tensor {
    let (rank, size) = (rank as i64, size as i64);
    match split {
        TensorSplit::Replicated => tensor.shallow_clone(),
        TensorSplit::Columns => tensor.chunk(size, 1)[rank as usize].contiguous(),
        TensorSplit::Rows { stride } => {
            let parts: Vec<Tensor> = tensor
                .chunk(stride, 0)
                .iter()
                .map(|p| p.chunk(size, 0)[rank as usize].shallow_clone())
                .collect();
            Tensor::cat(&parts, 0).contiguous()
        }
    }
}

/// Unsplit GPT tensors (as [`merge_model_parallel_ranks`] returns them) cut for tensor-parallel
/// rank `rank` of `size`, the vocabulary padded for `size` ranks.
pub fn split_for_tensor_parallel(
    merged: &HashMap<String, Tensor>,
    config: &TransformerConfig,
    rank: usize,
    size: usize,
) -> HashMap<String, Tensor> {
    let padded_vocab = config.padded_vocab_size(size as i64);
    merged
        .iter()
        .map(|(name, tensor)| {
            let mut tensor = tensor.shallow_clone();
            if has_vocab_rows(name) && tensor.size()[0] < padded_vocab {
                let mut rows = tensor.size();
                rows[0] = padded_vocab - rows[0];
                tensor = Tensor::cat(
                    &[
                        &tensor,
                        &tensor.new_zeros(rows.as_slice(), (tensor.kind(), tensor.device())),
                    ],
                    0,
                );
            }
            (
                name.clone(),
                take_shard(&tensor, tensor_split(name, config), rank, size),
            )
        })
        .collect()
}

/// Is `name` a tensor with a row per (padded) vocabulary entry: the word embeddings, and the
/// output layer's weight and bias (GPT's and BERT's `output_layer`, T5's `lm_head.output_layer`)?
/// Its padding grows with the tensor-parallel size.
pub fn has_vocab_rows(name: &str) -> bool {
    name == "embedding.word_embeddings.weight"
        || name.starts_with("output_layer.")
        || name.starts_with("lm_head.output_layer.")
}

/// Renames a chunk-local layer index (`decoder.layers.3.…`, BERT's `encoder.layers.3.…`) to
/// the global one.
fn globalize_layer(name: &str, first_layer: usize) -> Result<String> {
    let Some((prefix, rest)) = ["decoder.layers.", "encoder.layers."]
        .iter()
        .find_map(|prefix| Some((*prefix, name.strip_prefix(prefix)?)))
    else {
        return Ok(name.to_string());
    };
    let (index, leaf) = rest
        .split_once('.')
        .with_context(|| format!("malformed layer tensor name {name}"))?;
    let index: usize = index
        .parse()
        .with_context(|| format!("malformed layer index in {name}"))?;
    Ok(format!("{prefix}{}.{leaf}", first_layer + index))
}

/// The model tensors of every rank of `checkpoint`, merged into the names and shapes of a
/// TP=1, PP=1 model of the same architecture (the vocabulary padded for one rank). The last
/// stage's copy of tied embeddings is dropped: it equals the first stage's.
pub fn merge_model_parallel_ranks(
    checkpoint: &CheckpointDirectory,
    device: Device,
) -> Result<HashMap<String, Tensor>> {
    let metadata = &checkpoint.metadata;
    let families = [
        GptModel::MODEL_TYPE,
        BertModel::MODEL_TYPE,
        T5Model::MODEL_TYPE,
    ];
    if !families.contains(&metadata.model_type.as_str()) {
        bail!(
            "{}: merging {} checkpoints is not supported, only GPT, BERT and T5",
            checkpoint.directory.display(),
            metadata.model_type
        );
    }
    let config: TransformerConfig = serde_json::from_value(metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))?;
    let (tensor_size, pipeline_size) = (
        metadata.tensor_model_parallel_size,
        metadata.pipeline_model_parallel_size,
    );
    let split = PipelineSplit {
        num_layers: config.num_layers,
        stages: pipeline_size,
        chunks: metadata.virtual_pipeline_stages.max(1),
        first_stage_layers: metadata.decoder_first_pipeline_num_layers,
        last_stage_layers: metadata.decoder_last_pipeline_num_layers,
    };
    let tied = !config.untie_embeddings_and_output_weights;
    let mut shards: BTreeMap<String, Vec<Tensor>> = BTreeMap::new();
    for stage in 0..pipeline_size {
        let chunks = split.chunks_of(stage)?;
        for tensor_rank in 0..tensor_size {
            let rank_dir = rank_directory_name(tensor_rank, stage, pipeline_size);
            let tensors = checkpoint
                .read(&rank_dir, MODEL_FILE, device)?
                .with_context(|| {
                    format!(
                        "{}/{rank_dir} has no {MODEL_FILE}",
                        checkpoint.directory.display()
                    )
                })?;
            for (name, tensor) in tensors {
                let (chunk, local) = match (chunks.len(), name.strip_prefix("model")) {
                    (1, _) => (0, name.as_str()),
                    (_, Some(rest)) => {
                        let (index, local) = rest.split_once('.').with_context(|| format!("{rank_dir}: malformed chunk tensor {name}"))?;
                        (index.parse::<usize>().with_context(|| format!("{rank_dir}: malformed chunk tensor {name}"))?, local)
                    }
                    _ => bail!("{rank_dir}: tensor {name} has no model chunk prefix but the checkpoint has virtual stages"),
                };
                let spec = chunks.get(chunk).with_context(|| {
                    format!(
                        "{rank_dir}: tensor {name} names chunk {chunk} of {}",
                        chunks.len()
                    )
                })?;
                if tied && local == "output_layer.weight" {
                    continue;
                }
                shards
                    .entry(globalize_layer(local, spec.layers.start)?)
                    .or_default()
                    .push(tensor);
            }
        }
    }
    let padded_vocab = config.padded_vocab_size(1);
    let mut merged = HashMap::with_capacity(shards.len());
    for (name, parts) in shards {
        ensure!(
            parts.len() == tensor_size,
            "{}: tensor {name} found in {} of {tensor_size} tensor-parallel ranks",
            checkpoint.directory.display(),
            parts.len()
        );
        let mut tensor = join_shards(&parts, tensor_split(&name, &config));
        if has_vocab_rows(&name) {
            // Padding rows beyond one rank's padded vocabulary are never looked up.
            tensor = tensor.narrow(0, 0, padded_vocab);
        }
        merged.insert(name, tensor);
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_rows_interleave_gate_and_up_parts() {
        // Two ranks holding [gate_r; up_r] with one row each part.
        let rank0 = Tensor::from_slice(&[1.0f32, 10.0]).view([2, 1]);
        let rank1 = Tensor::from_slice(&[2.0f32, 20.0]).view([2, 1]);
        let joined = join_shards(&[rank0, rank1], TensorSplit::Rows { stride: 2 });
        assert_eq!(
            Vec::<f32>::try_from(joined.view([-1])).unwrap(),
            vec![1.0, 2.0, 10.0, 20.0]
        );
    }

    #[test]
    fn columns_concatenate_along_dim_one() {
        let a = Tensor::from_slice(&[1.0f32, 2.0]).view([2, 1]);
        let b = Tensor::from_slice(&[3.0f32, 4.0]).view([2, 1]);
        let joined = join_shards(&[a, b], TensorSplit::Columns);
        assert_eq!(joined.size(), vec![2, 2]);
        assert_eq!(
            Vec::<f32>::try_from(joined.view([-1])).unwrap(),
            vec![1.0, 3.0, 2.0, 4.0]
        );
    }

    #[test]
    fn layer_names_become_global() {
        assert_eq!(
            globalize_layer("decoder.layers.1.mlp.linear_fc1.weight", 4).unwrap(),
            "decoder.layers.5.mlp.linear_fc1.weight"
        );
        assert_eq!(
            globalize_layer("decoder.final_layernorm.weight", 4).unwrap(),
            "decoder.final_layernorm.weight"
        );
        assert!(globalize_layer("decoder.layers.x.mlp", 0).is_err());
        assert_eq!(
            globalize_layer("encoder.layers.0.self_attention.linear_qkv.bias", 2).unwrap(),
            "encoder.layers.2.self_attention.linear_qkv.bias"
        );
    }

    #[test]
    fn shards_join_back_into_the_tensor() {
        let tensor = Tensor::arange(24, (tch::Kind::Float, Device::Cpu)).view([4, 6]);
        for split in [
            TensorSplit::Rows { stride: 1 },
            TensorSplit::Rows { stride: 2 },
            TensorSplit::Columns,
        ] {
            let shards: Vec<Tensor> = (0..2).map(|r| take_shard(&tensor, split, r, 2)).collect();
            assert!(join_shards(&shards, split).equal(&tensor), "{split:?}");
        }
    }
}
