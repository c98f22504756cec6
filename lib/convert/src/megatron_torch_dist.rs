//! Loading Megatron's `--ckpt-format torch_dist` checkpoints: the model's global tensors read
//! lazily from their `.distcp` chunks, and the distributed optimizer's state saved in
//! `fully_sharded_model_space` or `dp_zero_gather_scatter` ([`super::torch_dist_optimizer`]).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{Context, Result};
use megatron_checkpoint::{DistCheckpoint, Value};

use super::dist_tensors::{dist_chunks, Placement};
use super::megatron_args::params_dtype;
use super::megatron_torch::{
    check_experts, check_version, checkpoint_config, run_state, LoadOptions,
};
use super::sizes::{check_layers, layers_found};
use super::state::{is_expert_bias, ModelState};
use super::tensors::tensor_from_bytes;
use super::torch_dist_optimizer::{
    dp_zero_gather_scatter_state, optimizer_state, sharding_type, DP_ZERO_GATHER_SCATTER,
};

/// Loads a `torch_dist` iteration directory, with the distributed optimizer's state where
/// `options` ask for it. Tensors are read lazily from the `.distcp` files where their chunks
/// tile them by rows or column blocks (how Megatron's tensor and pipeline parallel ranks save
/// them).
pub fn load_torch_dist(directory: &Path, options: &LoadOptions) -> Result<ModelState> {
    let checkpoint = DistCheckpoint::open(directory)?;
    let root = &checkpoint.common.root;
    check_version(root, checkpoint.common.path())?;
    let args = root.get("args").context("common.pt has no args")?;
    let origin = checkpoint.common.path().display().to_string();
    let embedding = "embedding.word_embeddings.weight";
    let rows = checkpoint
        .tensors
        .get(embedding)
        .and_then(|t| t.shape.first())
        .map(|&rows| rows as i64)
        .with_context(|| format!("{}: no {embedding}", directory.display()))?;
    let config = checkpoint_config(&origin, args, embedding, rows, options)?;
    let stacked = checkpoint
        .tensors
        .iter()
        .filter(|(name, _)| {
            name.starts_with("decoder.layers.")
                && layers_found([name.as_str()], &["decoder.layers."]) == 0
        })
        .filter_map(|(_, t)| t.shape.first().copied())
        .max()
        .unwrap_or(0);
    let numbered = layers_found(
        checkpoint.tensors.keys().map(String::as_str),
        &["decoder.layers."],
    );
    check_layers(
        &origin,
        "args num_layers",
        config.num_layers,
        stacked.max(numbered),
    )?;
    let placement = Placement {
        directory,
        config: &config,
    };
    let mut inputs = HashMap::new();
    let mut weights = BTreeMap::new();
    for (name, tensor) in &checkpoint.tensors {
        if name.starts_with("optimizer.") || name.contains("_extra_state") {
            continue;
        }
        let chunks = dist_chunks(&checkpoint, name, &mut inputs)
            .with_context(|| format!("{}: tensor {name}", directory.display()))?;
        let eager = |rows: std::ops::Range<usize>| {
            let (dtype, shape, bytes) = checkpoint.read_rows(name, rows)?;
            tensor_from_bytes(dtype, &shape, &bytes)
        };
        placement.place(&mut weights, name, &tensor.shape, chunks, &eager)?;
    }
    // The routers' expert biases are buffers, stacked over the layers like the parameters.
    let (expert_biases, weights): (BTreeMap<_, _>, BTreeMap<_, _>) = weights
        .into_iter()
        .partition(|(name, _): &(String, _)| is_expert_bias(name));
    check_experts(&origin, &config, weights.keys().map(String::as_str))?;
    let dp_zero = options.optimizer && sharding_type(root) == Some(DP_ZERO_GATHER_SCATTER);
    let optimizer = if options.optimizer && !dp_zero {
        optimizer_state(&checkpoint, root, &placement, &mut inputs)?
    } else {
        None
    };
    let mut state = ModelState {
        config,
        params_dtype: params_dtype(args),
        weights,
        expert_biases,
        optimizer,
        run: run_state(root),
        source_parallel: (
            args.get("tensor_model_parallel_size")
                .and_then(Value::as_i64)
                .unwrap_or(1)
                .max(1) as usize,
            args.get("pipeline_model_parallel_size")
                .and_then(Value::as_i64)
                .unwrap_or(1)
                .max(1) as usize,
        ),
        source: format!("Megatron torch_dist checkpoint {}", directory.display()),
    };
    if dp_zero {
        // Its buffers are laid out by the model's parameters, which the state now describes.
        state.optimizer = Some(dp_zero_gather_scatter_state(
            &checkpoint,
            directory,
            root,
            &state,
        )?);
    }
    Ok(state)
}
