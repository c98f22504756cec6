//! `--verify`: both sides of a conversion run forward on the same sequences, in float32.

use std::collections::HashMap;

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::state::ModelState;
use megatron_models::{AttentionMask, GptModel, ModelOptions, Recompute};
use megatron_parallel::ParallelState;

/// The model of `state` in float32 on the CPU.
pub fn model_of(state: &ModelState) -> Result<GptModel> {
    let options = ModelOptions {
        params_dtype: Kind::Float,
        device: Device::Cpu,
        recompute: Recompute::None,
        seed: 0,
        bias_dropout_fusion: true,
        rope_fusion: false,
    };
    let model = GptModel::new(state.config.clone(), options, &ParallelState::single())?;
    let weights: HashMap<String, Tensor> = state
        .weights
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.read()?.to_kind(Kind::Float))))
        .collect::<Result<_>>()?;
    model
        .load_parameters(&weights)
        .with_context(|| format!("loading {} into our model", state.source))?;
    Ok(model)
}

/// Logits `[b, s, vocab]` over the true vocabulary for token ids `[b, s]`.
pub fn logits(model: &GptModel, tokens: &Tensor) -> Result<Tensor> {
    let (b, s) = tokens.size2()?;
    let positions = Tensor::arange(s, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([b, s], false);
    let logits =
        tch::no_grad(|| model.forward_full_logits(tokens, &positions, &AttentionMask::Causal))?;
    Ok(logits.transpose(0, 1).narrow(2, 0, model.config.vocab_size))
}

/// A few deterministic random sequences within the vocabulary and context of `state`.
pub fn sample_tokens(state: &ModelState, sequences: i64) -> Tensor {
    let length = state.config.max_position_embeddings.min(16);
    let generator_seed = 1234;
    tch::manual_seed(generator_seed);
    Tensor::randint(
        state.config.vocab_size,
        [sequences, length],
        (Kind::Int64, Device::Cpu),
    )
}

/// max |Δ logits| between the models of two states on the same sequences.
pub fn max_logit_difference(a: &ModelState, b: &ModelState) -> Result<f64> {
    let tokens = sample_tokens(a, 4);
    let left = logits(&model_of(a)?, &tokens)?;
    let right = logits(&model_of(b)?, &tokens)?;
    Ok((left - right).abs().max().double_value(&[]))
}
