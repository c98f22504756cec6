//! The bytes one rank holds for the model's parameters, their float32 gradients and the
//! optimizer's state: predicted from the parameters' shapes before anything is allocated, and
//! measured on a built optimizer. Both go through the same [`BufferLayout`], so its padding is
//! counted alike; the prediction is the arithmetic of which buffers exist.

use tch::Kind;

use super::buffer::{BufferLayout, ParamShape};

/// The float32 buffers of the optimizer's own state beside the main parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateBuffers {
    /// Adam's two moments and a step counter per segment.
    Adam,
    /// SGD's momentum.
    Momentum,
    None,
}

/// Bytes on one rank, by what they hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StateBytes {
    /// The model's parameters in their dtype (the flat parameter buffer).
    pub weights: u64,
    /// Float32 gradient accumulators (Megatron's main grads) for every parameter.
    pub gradients: u64,
    /// Float32 main parameters where they are not the model's own, Adam's two moments or
    /// SGD's momentum, and the step counters: over this rank's shards only with the
    /// distributed optimizer.
    pub optimizer: u64,
}

impl StateBytes {
    pub fn total(&self) -> u64 {
        self.weights + self.gradients + self.optimizer
    }

    /// What [`MixedPrecisionOptimizer::new`](super::MixedPrecisionOptimizer::new) will
    /// allocate for `params` of `dtype` on data-parallel rank `data_rank` of `data_size` in
    /// buckets of `bucket_size` (`sharded` with the distributed optimizer over several ranks),
    /// and SGD's momentum from its first step on.
    pub fn predicted(
        params: &[ParamShape],
        bucket_size: usize,
        sharded: bool,
        state: StateBuffers,
        dtype: Kind,
        data_rank: usize,
        data_size: usize,
    ) -> Self {
        let layout = BufferLayout::new(params, bucket_size.max(1), data_rank, data_size, sharded);
        let (len, shard) = (layout.len as u64, layout.shard_len as u64);
        let float = Kind::Float.elt_size_in_bytes() as u64;
        let main = if main_is_params(dtype, sharded) {
            0
        } else {
            shard * float
        };
        let moments = match state {
            StateBuffers::Adam => 2 * shard * float + layout.segments.len() as u64 * float,
            StateBuffers::Momentum => shard * float,
            StateBuffers::None => 0,
        };
        StateBytes {
            weights: len * dtype.elt_size_in_bytes() as u64,
            gradients: len * float,
            optimizer: main + moments,
        }
    }
}

/// Whether the float32 main parameters are the model's own buffer (a float32 model whose state
/// is not sharded) rather than a copy.
pub(crate) fn main_is_params(dtype: Kind, sharded: bool) -> bool {
    dtype == Kind::Float && !sharded
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use megatron_models::{NamedParameter, ParamAttributes};
    use megatron_parallel::{ParallelLayout, ParallelState, ThreadWorld};
    use tch::{Device, Tensor};

    use super::*;
    use crate::{MixedPrecisionOptimizer, OptimizerKind, OptimizerSettings, DEFAULT_BUCKET_SIZE};

    /// Odd shapes (padding to 64 elements, to the shard alignment), a tied embedding (a bucket
    /// of its own when sharded), norms (not decayed: their own segments).
    const SHAPES: &[(&str, &[i64])] = &[
        ("embedding.word_embeddings.weight", &[97, 24]),
        ("decoder.layers.0.input_layernorm.weight", &[24]),
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            &[72, 24],
        ),
        ("decoder.layers.0.self_attention.linear_qkv.bias", &[72]),
        ("decoder.layers.0.mlp.linear_fc1.weight", &[51, 24]),
        ("decoder.final_layernorm.weight", &[24]),
    ];

    fn attributes(name: &str) -> ParamAttributes {
        ParamAttributes {
            tied_across_stages: name.starts_with("embedding"),
            ..ParamAttributes::default()
        }
    }

    fn settings(kind: OptimizerKind, distributed: bool, bucket_size: usize) -> OptimizerSettings {
        OptimizerSettings {
            kind,
            clip_grad: 1.0,
            distributed,
            bucket_size,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            gradient_accumulation_fusion: true,
            decoupled_lr: false,
        }
    }

    /// Predicted and allocated bytes of every rank of a `data`-rank group.
    fn predicted_and_allocated(
        dtype: Kind,
        data: usize,
        settings: OptimizerSettings,
    ) -> Vec<(StateBytes, StateBytes)> {
        let world = ThreadWorld::new(data, Duration::from_secs(20));
        let layout = ParallelLayout::new(data, 1, 1).unwrap();
        world
            .run(|rank| {
                let shapes: Vec<ParamShape> = SHAPES
                    .iter()
                    .map(|(name, shape)| ParamShape {
                        name,
                        shape: shape.to_vec(),
                        attributes: attributes(name),
                    })
                    .collect();
                let predicted = settings.predicted_state_bytes(&shapes, dtype, rank, data);
                let parallel = ParallelState::threads(&world, layout, rank, false)?;
                let parameters = SHAPES
                    .iter()
                    .map(|(name, shape)| NamedParameter {
                        name: name.to_string(),
                        tensor: Tensor::zeros(*shape, (dtype, Device::Cpu)),
                        attributes: attributes(name),
                        main_grad: None,
                    })
                    .collect();
                let optimizer = MixedPrecisionOptimizer::new(parameters, settings, &parallel)?;
                Ok((predicted, optimizer.state_bytes()))
            })
            .unwrap()
    }

    #[test]
    fn predicted_bytes_are_the_allocated_bytes() {
        let adam = OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
        };
        let plain_sgd = OptimizerKind::Sgd { momentum: 0.0 };
        for dtype in [Kind::Float, Kind::BFloat16] {
            for data in [1, 4] {
                for distributed in [false, true] {
                    for bucket_size in [DEFAULT_BUCKET_SIZE, 2000] {
                        for kind in [adam, plain_sgd] {
                            let settings = settings(kind, distributed, bucket_size);
                            for (rank, (predicted, allocated)) in
                                predicted_and_allocated(dtype, data, settings)
                                    .into_iter()
                                    .enumerate()
                            {
                                assert_eq!(
                                    predicted, allocated,
                                    "{dtype:?}, DP={data}, distributed {distributed}, \
                                     buckets of {bucket_size}, {kind:?}, rank {rank}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The figures themselves for one case: bf16 with the distributed optimizer over 4 ranks
    /// holds 2 + 4 bytes per (padded) element and 12 per element of its quarter.
    #[test]
    fn bf16_with_the_distributed_optimizer_over_four_ranks() {
        let adam = OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
        };
        let (predicted, _) =
            predicted_and_allocated(Kind::BFloat16, 4, settings(adam, true, DEFAULT_BUCKET_SIZE))
                [0];
        // Backward order: the rest (24, 51×24, 72, 72×24, 24, each from a 64-aligned start) in
        // a bucket padded to 4 × 64, then the tied embedding (2328) alone in another.
        let embedding = 2328usize.next_multiple_of(256);
        let rest_end = [24usize, 1224, 72, 1728, 24]
            .iter()
            .fold(0, |offset: usize, len| offset.next_multiple_of(64) + len);
        let len = (embedding + rest_end.next_multiple_of(256)) as u64;
        assert_eq!(predicted.weights, 2 * len);
        assert_eq!(predicted.gradients, 4 * len);
        // Rank 0's quarters: of the first bucket the final norm and fc1 (two segments), of
        // the second the embedding (one); a float32 step counter each.
        assert_eq!(predicted.optimizer, 12 * len / 4 + 3 * 4);
    }
}
