//! How any family's model is materialised: parameter dtype, device, the recompute policy, the
//! seed and the fusions its training runs with.

use tch::{Device, Kind};

/// `--recompute-granularity full --recompute-method ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// Checkpoint the input of every chunk of `num_layers` layers.
    Uniform,
    /// Checkpoint the first `num_layers` layers individually, run the rest normally.
    Block,
}

/// What to recompute in backward instead of keeping activations (spec §4.7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    None,
    /// `--recompute-activations`: the attention core only.
    Selective,
    Full {
        method: RecomputeMethod,
        num_layers: usize,
    },
}

/// How the model is materialised: parameter dtype, device, recompute policy and the seed its
/// weights are drawn with.
#[derive(Debug, Clone, Copy)]
pub struct ModelOptions {
    pub params_dtype: Kind,
    pub device: Device,
    pub recompute: Recompute,
    pub seed: u64,
    /// Hidden dropout inside the next residual add + norm kernel in training on GPUs (Megatron's
    /// `--bias-dropout-fusion`, on by default); off, libtorch's dropout runs first.
    pub bias_dropout_fusion: bool,
    /// Rotary embeddings as one kernel each way on GPUs (Megatron's `apply_rope_fusion`, on by
    /// default in training); off, libtorch's ops. Inference keeps it off: its batched decode
    /// steps rotate rows at their own positions through libtorch's ops, and a request's tokens
    /// must not depend on whether it was batched.
    pub rope_fusion: bool,
}
