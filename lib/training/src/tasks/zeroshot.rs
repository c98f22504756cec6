//! The zero-shot GPT metrics (Megatron's `tasks/zeroshot_gpt/evaluate.py`): one forward per
//! micro-batch of samples, teacher-forced, with a causal mask and positions 0..s.

use megatron_models::mask_extra_vocabulary;
use std::sync::Arc;

use anyhow::{ensure, Result};
use megatron_data::tasks::TaskSample;
use tch::{Device, Kind, Tensor};

use megatron_models::{cross_entropy, AttentionMask, GptModel};
use megatron_parallel::Communicator;

/// Inputs, labels and the scored-label mask of a micro-batch, on `device`, cut to `length`
/// positions. Positions past every sample's last token are padding, and with a causal mask
/// they do not change the earlier positions' outputs, so cutting them changes no result.
fn batch_tensors(
    samples: &[TaskSample],
    length: usize,
    device: Device,
) -> (Tensor, Tensor, Tensor) {
    let rows = samples.len() as i64;
    let text: Vec<i64> = samples
        .iter()
        .flat_map(|s| s.text[..=length].iter().map(|&t| i64::from(t)))
        .collect();
    let mask: Vec<f32> = samples
        .iter()
        .flat_map(|s| s.pad_mask[..length].iter().map(|&m| f32::from(m)))
        .collect();
    let text = Tensor::from_slice(&text)
        .view([rows, length as i64 + 1])
        .to(device);
    let inputs = text.narrow(1, 0, length as i64);
    let labels = text.narrow(1, 1, length as i64).contiguous();
    let mask = Tensor::from_slice(&mask)
        .view([rows, length as i64])
        .to(device);
    (inputs, labels, mask)
}

/// The vocabulary the model is scored over: the one-rank padded vocabulary the checkpoint holds.
/// Under tensor parallelism the vocabulary is padded further (to a multiple of 128·t) with
/// zero rows, which would add `exp(0)` terms to the softmax; they are masked out, so that any
/// tensor-parallel size gives the one-rank numbers.
fn scored_vocabulary(model: &GptModel) -> i64 {
    model.config.padded_vocab_size(1)
}

fn positions(inputs: &Tensor) -> Tensor {
    let (rows, length) = inputs.size2().expect("inputs are [b, s]");
    Tensor::arange(length, (Kind::Int64, inputs.device()))
        .unsqueeze(0)
        .expand([rows, length], false)
}

/// Σ masked token cross entropy over `samples` (float32 per token, summed in float64), from
/// the vocab-parallel logits. Every tensor-parallel rank calls it with the same samples.
pub fn score_windows(
    model: &GptModel,
    tensor_group: &Arc<dyn Communicator>,
    samples: &[TaskSample],
) -> Result<f64> {
    ensure!(!samples.is_empty(), "an empty micro-batch");
    let length = samples[0].pad_mask.len();
    let device = model.options().device;
    tch::no_grad(|| {
        let (inputs, labels, mask) = batch_tensors(samples, length, device);
        let logits = model.forward(&inputs, &positions(&inputs), &AttentionMask::Causal, false)?;
        let logits = mask_extra_vocabulary(logits, scored_vocabulary(model), tensor_group.rank());
        let losses = cross_entropy(&logits, &labels, tensor_group)?;
        Ok((losses.to_kind(Kind::Double) * mask.to_kind(Kind::Double))
            .sum(Kind::Double)
            .double_value(&[]))
    })
}

/// Per micro-batch: how many samples have every scored label as the argmax over the full
/// (padded) vocabulary, and each sample's summed log-probability of its scored labels.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LambadaScores {
    pub correct: Vec<bool>,
    pub target_logprobs: Vec<f64>,
}

pub fn score_lambada(model: &GptModel, samples: &[TaskSample]) -> Result<LambadaScores> {
    ensure!(!samples.is_empty(), "an empty micro-batch");
    let length = samples
        .iter()
        .map(|s| s.scored_positions().last().map_or(1, |p| p + 1))
        .max()
        .expect("a non-empty batch");
    let device = model.options().device;
    tch::no_grad(|| {
        let (inputs, labels, mask) = batch_tensors(samples, length, device);
        // [s, b, V] gathered over the tensor-parallel ranks → [b, s, V].
        let logits = model
            .forward_full_logits(&inputs, &positions(&inputs), &AttentionMask::Causal)?
            .narrow(2, 0, scored_vocabulary(model))
            .transpose(0, 1);
        let scored = mask.gt(0.5);
        let right = logits
            .argmax(-1, false)
            .eq_tensor(&labels)
            .logical_or(&scored.logical_not());
        let correct = right.all_dim(1, false).to_device(Device::Cpu);
        let logprobs = logits
            .log_softmax(-1, Kind::Float)
            .gather(-1, &labels.unsqueeze(-1), false)
            .squeeze_dim(-1)
            .to_kind(Kind::Double)
            * mask.to_kind(Kind::Double);
        let logprobs = logprobs
            .sum_dim_intlist(1, false, Kind::Double)
            .to_device(Device::Cpu);
        Ok(LambadaScores {
            correct: Vec::<bool>::try_from(&correct)?,
            target_logprobs: Vec::<f64>::try_from(&logprobs)?,
        })
    })
}
