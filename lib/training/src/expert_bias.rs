//! Megatron's `_update_router_expert_bias` (`--moe-router-enable-expert-bias`): after a step's
//! backward, the tokens each MoE router sent to each expert over the step are summed over the
//! ranks that route the step's tokens, and move the routers' biases. The biases are model
//! state outside the parameters: checkpoints carry them in a file of their own.

use std::collections::HashMap;

use anyhow::{ensure, Result};
use tch::Tensor;

use megatron_models::ModelChunk;
use megatron_parallel::{ParallelState, ReduceOp};

/// Updates every router's bias from its count of the step, summed over tensor × data ×
/// context parallelism (Megatron's `tensor_and_data_parallel` group with context; expert
/// parallelism is folded into the data-parallel ranks). Nothing without expert biases.
pub fn update_expert_biases<C: ModelChunk>(chunks: &[C], parallel: &ParallelState) -> Result<()> {
    let biases: Vec<_> = chunks
        .iter()
        .flat_map(|chunk| chunk.expert_biases())
        .map(|(_, bias)| bias)
        .collect();
    if biases.is_empty() {
        return Ok(());
    }
    let tokens = Tensor::stack(
        &biases.iter().map(|bias| &bias.tokens).collect::<Vec<_>>(),
        0,
    );
    parallel.tensor.all_reduce(&tokens, ReduceOp::Sum)?;
    parallel
        .data_with_context
        .all_reduce(&tokens, ReduceOp::Sum)?;
    for (bias, tokens) in biases.iter().zip(tokens.unbind(0)) {
        bias.update(&tokens);
    }
    Ok(())
}

/// The biases of this rank's chunks under their checkpoint names (chunk prefix included).
pub fn expert_bias_tensors<C: ModelChunk>(
    chunks: &[C],
    prefix: impl Fn(usize) -> String,
) -> Vec<(String, Tensor)> {
    chunks
        .iter()
        .enumerate()
        .flat_map(|(c, chunk)| {
            let prefix = prefix(c);
            chunk
                .expert_biases()
                .into_iter()
                .map(move |(name, bias)| (format!("{prefix}{name}"), bias.bias.detach()))
        })
        .collect()
}

/// Restores the biases [`expert_bias_tensors`] saved; a checkpoint without them (saved before
/// the flag was given) leaves them at zero, which a note says.
pub fn load_expert_biases<C: ModelChunk>(
    chunks: &[C],
    prefix: impl Fn(usize) -> String,
    tensors: Option<&HashMap<String, Tensor>>,
) -> Result<()> {
    let mut missing = 0;
    for (c, chunk) in chunks.iter().enumerate() {
        let prefix = prefix(c);
        for (name, bias) in chunk.expert_biases() {
            let name = format!("{prefix}{name}");
            let Some(saved) = tensors.and_then(|tensors| tensors.get(&name)) else {
                missing += 1;
                continue;
            };
            ensure!(
                saved.size() == bias.bias.size(),
                "{name}: shape {:?} but the model has {:?} experts",
                saved.size(),
                bias.bias.size()
            );
            tch::no_grad(|| bias.bias.shallow_clone().copy_(saved));
        }
    }
    if missing > 0 {
        eprintln!(
            "note: the checkpoint has no expert bias for {missing} MoE routers; they start at zero"
        );
    }
    Ok(())
}
