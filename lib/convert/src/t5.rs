//! T5 checkpoints through `checkpoint_convert --model-type T5`: ours reshaped to another
//! tensor-parallel size, with the optimizer state laid out for the new ranks as for GPT, read
//! lazily and written tensor by tensor through GPT's rank reader and writer. T5 runs
//! without pipeline parallelism, so every output has one stage; HuggingFace's T5 is another
//! architecture (relative position buckets instead of learned positions, no biases, no
//! embedding scaling of Megatron's kind), so T5 is not exported there.

use std::path::Path;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use super::lazy::LazyTensor;
use super::ours::{load_optimizer, read_model_files, write_rank, RankShard};
use super::progress::report_total;
use super::tensors::kind_named;
use megatron_models::{FamilyModel, ModelOptions, Recompute, T5Config, T5Input, T5Model};
use megatron_parallel::ParallelState;
use megatron_store::load_for_inference;
use megatron_store::{
    begin_save, finish_save, rank_directory_name, staging_directory, CheckpointDirectory,
};

/// What a reshape moved.
#[derive(Debug, Clone, PartialEq)]
pub struct T5Reshape {
    pub tensors: usize,
    pub bytes: i64,
    pub with_optimizer: bool,
}

/// Every parameter of `config`'s T5 in model order (the optimizer's buffer order), as
/// `(file name, global name)`: read from a one-layer-per-stack model of the same architecture,
/// so it follows the model's code.
fn parameter_names(config: &T5Config) -> Result<Vec<(String, String)>> {
    let probe = T5Config {
        transformer: megatron_models::TransformerConfig {
            num_layers: 1,
            vocab_size: 1,
            make_vocab_size_divisible_by: 1,
            ..config.transformer.clone()
        },
        encoder_num_layers: 1,
        decoder_num_layers: 1,
    };
    let options = ModelOptions {
        params_dtype: Kind::BFloat16,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 0,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = T5Model::new(probe, options, &ParallelState::single())?;
    let probe_names: Vec<String> = megatron_models::ModelChunk::named_parameters(&model)
        .into_iter()
        .map(|p| p.name)
        .collect();
    let stacks = [
        ("encoder.layers.", config.encoder_num_layers),
        ("decoder.layers.", config.decoder_num_layers),
    ];
    let mut names = Vec::new();
    for name in &probe_names {
        let Some(&(stack, count)) = stacks.iter().find(|(s, _)| name.starts_with(s)) else {
            names.push((name.clone(), name.clone()));
            continue;
        };
        // A stack's layers follow each other, each with the probe layer's parameters.
        let layer = format!("{stack}0.");
        if name.strip_prefix(&layer) != probe_names.iter().find_map(|n| n.strip_prefix(&layer)) {
            continue;
        }
        for index in 0..count {
            for leaf in probe_names.iter().filter_map(|n| n.strip_prefix(&layer)) {
                let full = format!("{stack}{index}.{leaf}");
                names.push((full.clone(), full));
            }
        }
    }
    Ok(names)
}

fn t5_config_of(checkpoint: &CheckpointDirectory) -> Result<T5Config> {
    let metadata = &checkpoint.metadata;
    if metadata.model_type != T5Model::MODEL_TYPE {
        bail!(
            "{} holds a {} model, not a T5 (--model-type {} converts it)",
            checkpoint.directory.display(),
            metadata.model_type,
            metadata.model_type
        );
    }
    serde_json::from_value(metadata.model.clone())
        .with_context(|| format!("{}: model metadata", checkpoint.directory.display()))
}

/// Writes our T5 checkpoint `checkpoint` (any tensor-parallel layout, distributed-optimizer
/// shards included) under `root` (which must not hold another checkpoint) with `tensor`
/// tensor-parallel ranks; with `optimizer`, the Adam state too, for one data-parallel rank.
/// Counters, scheduler and flags are kept.
pub fn reshape_t5(
    checkpoint: &CheckpointDirectory,
    root: &Path,
    tensor: usize,
    optimizer: bool,
) -> Result<T5Reshape> {
    let config = t5_config_of(checkpoint)?;
    config.validate(tensor as i64)?;
    let metadata = &checkpoint.metadata;
    let source = format!("megatron-rs checkpoint {}", checkpoint.directory.display());
    let params = parameter_names(&config)?;
    let trunk = &config.transformer;
    let (weights, files) = read_model_files(checkpoint, trunk, &|_| Ok(params.clone()))?;
    for (_, _, rank_dir, _, tensors) in &files {
        if let Some(name) = tensors
            .keys()
            .find(|k| !params.iter().any(|(n, _)| n == *k))
        {
            bail!("{source}/{rank_dir}: unexpected tensor {name} for this architecture");
        }
    }
    let with_optimizer = optimizer && metadata.optimizer.as_deref() == Some("adam");
    let state = if with_optimizer {
        Some(load_optimizer(checkpoint, trunk, &files)?)
    } else {
        None
    };
    let bytes = weights
        .values()
        .chain(
            state
                .iter()
                .flat_map(|o| [&o.main, &o.exp_avg, &o.exp_avg_sq])
                .flat_map(|m| m.values()),
        )
        .map(LazyTensor::bytes)
        .sum::<usize>();
    report_total(bytes as u64);
    let kind = kind_named(&metadata.params_dtype)?;
    begin_save(root, metadata.iteration)?;
    let staging = staging_directory(root, metadata.iteration);
    for rank in 0..tensor {
        write_rank(
            &staging,
            &rank_directory_name(rank, 0, 1),
            &params,
            &weights,
            state.as_ref(),
            RankShard {
                config: trunk,
                rank,
                size: tensor,
                kind,
            },
            None,
            false,
            &source,
        )?;
    }
    let mut written = metadata.clone();
    written.tensor_model_parallel_size = tensor;
    written.pipeline_model_parallel_size = 1;
    written.virtual_pipeline_stages = 1;
    written.data_parallel_size = 1;
    written.distributed_optimizer = false;
    written.optimizer = with_optimizer.then(|| "adam".to_string());
    written.has_rng_state = false;
    finish_save(root, &written)?;
    Ok(T5Reshape {
        tensors: weights.len(),
        bytes: bytes as i64,
        with_optimizer,
    })
}

/// max |Δ logits| (float32, CPU) between the T5 checkpoints under `a` and `b` on the same
/// padded encoder inputs and decoder inputs.
pub fn t5_max_logit_difference(a: &Path, b: &Path) -> Result<f64> {
    let single = ParallelState::single();
    let left: T5Model = load_for_inference(a, Device::Cpu, Kind::Float, &single)?;
    let right: T5Model = load_for_inference(b, Device::Cpu, Kind::Float, &single)?;
    let trunk = &left.config.transformer;
    let positions = trunk.max_position_embeddings;
    let (encoder, decoder) = (positions.min(16), positions.min(8));
    tch::manual_seed(1234);
    let encoder_tokens =
        Tensor::randint(trunk.vocab_size, [4, encoder], (Kind::Int64, Device::Cpu));
    let decoder_tokens =
        Tensor::randint(trunk.vocab_size, [4, decoder], (Kind::Int64, Device::Cpu));
    let encoder_mask = Tensor::ones([4, encoder], (Kind::Int64, Device::Cpu));
    // The last row's encoder input is padded.
    let _ = encoder_mask
        .get(3)
        .narrow(0, encoder / 2, encoder - encoder / 2)
        .fill_(0);
    let input = T5Input {
        encoder_tokens: &encoder_tokens,
        decoder_tokens: &decoder_tokens,
        encoder_mask: &encoder_mask,
    };
    let logits = |model: &T5Model| -> Result<Tensor> {
        Ok(tch::no_grad(|| model.forward(&input, false))?.narrow(2, 0, trunk.vocab_size))
    };
    Ok((logits(&left)? - logits(&right)?)
        .abs()
        .max()
        .double_value(&[]))
}
