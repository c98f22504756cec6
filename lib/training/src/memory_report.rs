//! The predicted memory of one GPU before training, as Megatron's `report_theoretical_memory`
//! prints it: the parameters, gradients and optimizer state this rank will allocate (exact:
//! the optimizer's own buffer arithmetic, see [`StateBytes::predicted`]) and the activations
//! its pipeline stage keeps for the micro-batches in flight (a formula for our layers, to be
//! calibrated against measured peaks with `scripts/bench/memory_report.sh`).
//!
//! Activations of one transformer layer for one micro-batch, in bytes of 16-bit activations
//! (Korthikanti et al. 2022, table 2, with flash attention keeping no `s²` term, as our
//! `scaled_dot_product_attention` on GPUs), `s` the sequence, `b` the micro-batch, `h` the
//! hidden size, `f` the MLP width (×3/2 with SwiGLU: its first linear is twice as wide), `t` the
//! tensor-parallel size:
//!
//! - with sequence parallelism (or `t = 1`): `s·b·h·(18 + 4f/h) / t`;
//! - without: `s·b·h·(10 + (8 + 4f/h) / t)`, the norms, dropouts and residuals being whole
//!   on every tensor-parallel rank;
//! - `--recompute-granularity full` keeps only each recomputed group's input (`2·s·b·h`,
//!   split by `t` with sequence parallelism) and, during backward, one group's activations.
//!
//! Float32 activations (a float32 model) take twice these bytes. The first stage adds the
//! embedding output and its dropout mask, the last the output layer's input and float32 logits
//! (`4·s·b·h·(1 + V/h) / t`, V the padded vocabulary), for one micro-batch. A stage of the
//! 1F1B schedule keeps `min(p − stage, m)` micro-batches in flight (`m` per step); the
//! interleaved schedule `⌈(1 + (p − 1)/(p·v))·p⌉` at most, as Megatron counts it.

use anyhow::Result;
use megatron_models::{Activation, Recompute, RecomputeMethod, TransformerConfig};
use megatron_optim::StateBytes;
use megatron_parallel::{ParallelState, ReduceOp};
use tch::{Device, Tensor};

const MEGABYTE: f64 = 1024.0 * 1024.0;

/// What the activation formula needs to know about this rank's part of the model.
#[derive(Debug, Clone)]
pub struct ActivationShape {
    pub seq_length: u64,
    pub micro_batch_size: u64,
    pub hidden_size: u64,
    pub ffn_hidden_size: u64,
    pub swiglu: bool,
    /// The padded vocabulary (all tensor-parallel ranks together).
    pub padded_vocab_size: u64,
    pub tensor: u64,
    pub sequence_parallel: bool,
    /// Bytes of one activation element: 2 for bf16/fp16 models, 4 for float32.
    pub element_bytes: u64,
    pub recompute: Recompute,
    /// The transformer layers of each of this rank's (virtual) chunks.
    pub chunk_layers: Vec<u64>,
    /// This rank holds the embeddings / the output layer.
    pub pre_process: bool,
    pub post_process: bool,
    pub pipeline: u64,
    pub stage: u64,
    pub virtual_chunks: u64,
    pub microbatches: u64,
}

impl ActivationShape {
    /// The shape of `config` on a rank of `parallel` holding `chunk_layers`.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        config: &TransformerConfig,
        parallel: &ParallelState,
        seq_length: u64,
        micro_batch_size: u64,
        element_bytes: u64,
        recompute: Recompute,
        chunk_layers: Vec<u64>,
        ends: (bool, bool),
        microbatches: u64,
    ) -> Self {
        let layout = parallel.layout;
        let tensor = layout.tensor as u64;
        ActivationShape {
            seq_length,
            micro_batch_size,
            hidden_size: config.hidden_size as u64,
            ffn_hidden_size: config.ffn_hidden_size as u64,
            swiglu: config.activation == Activation::Swiglu,
            padded_vocab_size: config.padded_vocab_size(tensor as i64) as u64,
            tensor,
            sequence_parallel: parallel.sequence_parallel,
            element_bytes,
            recompute,
            virtual_chunks: chunk_layers.len() as u64,
            chunk_layers,
            pre_process: ends.0,
            post_process: ends.1,
            pipeline: layout.pipeline as u64,
            stage: parallel.coordinates().pipeline as u64,
            microbatches,
        }
    }

    /// `s·b·h` scaled to the element size (the formula counts 16-bit elements).
    fn sbh(&self) -> f64 {
        (self.seq_length * self.micro_batch_size * self.hidden_size) as f64
            * self.element_bytes as f64
            / 2.0
    }

    /// One transformer layer's activations for one micro-batch.
    pub fn layer_bytes(&self) -> f64 {
        let width = if self.swiglu { 1.5 } else { 1.0 } * self.ffn_hidden_size as f64;
        let mlp = 4.0 * width / self.hidden_size as f64;
        let t = self.tensor as f64;
        let per_sbh = if self.sequence_parallel || self.tensor == 1 {
            (18.0 + mlp) / t
        } else {
            10.0 + (8.0 + mlp) / t
        };
        self.sbh() * per_sbh
    }

    /// A layer input kept for recomputation.
    fn checkpoint_bytes(&self) -> f64 {
        let split = if self.sequence_parallel {
            self.tensor as f64
        } else {
            1.0
        };
        2.0 * self.sbh() / split
    }

    /// The transformer layers' activations of one micro-batch on this rank.
    fn layers_bytes(&self) -> f64 {
        let layer = self.layer_bytes();
        self.chunk_layers
            .iter()
            .map(|&layers| match self.recompute {
                Recompute::None | Recompute::Selective => layers as f64 * layer,
                Recompute::Full {
                    method: RecomputeMethod::Uniform,
                    num_layers,
                } => {
                    let group = (num_layers as u64).min(layers).max(1);
                    layers.div_ceil(group) as f64 * self.checkpoint_bytes()
                }
                Recompute::Full {
                    method: RecomputeMethod::Block,
                    num_layers,
                } => {
                    let recomputed = (num_layers as u64).min(layers);
                    recomputed as f64 * self.checkpoint_bytes()
                        + (layers - recomputed) as f64 * layer
                }
            })
            .sum()
    }

    /// Activations recomputed in backward, alive one group at a time.
    fn recompute_bytes(&self) -> f64 {
        match self.recompute {
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                num_layers,
            } => num_layers as f64 * self.layer_bytes(),
            Recompute::Full {
                method: RecomputeMethod::Block,
                ..
            } => self.layer_bytes(),
            _ => 0.0,
        }
    }

    /// Micro-batches whose activations this rank holds at once.
    pub fn in_flight(&self) -> u64 {
        let p = self.pipeline;
        if p == 1 {
            return 1;
        }
        if self.virtual_chunks > 1 {
            let penalty = 1.0 + (p - 1) as f64 / (p * self.virtual_chunks) as f64;
            return (penalty * p as f64).ceil() as u64;
        }
        (p - self.stage).min(self.microbatches.max(1))
    }

    /// The activation estimate of this rank.
    pub fn estimate(&self) -> ActivationBytes {
        let tokens = (self.seq_length * self.micro_batch_size) as f64;
        let mut per_microbatch = self.layers_bytes();
        if self.pre_process {
            // The token ids and positions (int64) and the embedding dropout's mask.
            per_microbatch += 8.0 * tokens + self.sbh() / 2.0;
        }
        let in_flight = self.in_flight();
        let mut total = per_microbatch * in_flight as f64;
        if self.post_process {
            let h = self.hidden_size as f64;
            total +=
                4.0 * self.sbh() * (1.0 + self.padded_vocab_size as f64 / h) / self.tensor as f64;
        }
        total += self.recompute_bytes();
        ActivationBytes {
            per_microbatch: per_microbatch as u64,
            in_flight,
            total: total as u64,
        }
    }
}

/// The activation estimate of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationBytes {
    /// One micro-batch through this rank's layers (and embeddings).
    pub per_microbatch: u64,
    pub in_flight: u64,
    /// Every micro-batch in flight, the output layer's and a recomputed group's.
    pub total: u64,
}

/// One rank's prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryReport {
    pub state: StateBytes,
    pub activations: ActivationBytes,
}

impl MemoryReport {
    pub fn total(&self) -> u64 {
        self.state.total() + self.activations.total
    }

    fn parts(&self) -> [u64; 6] {
        [
            self.state.weights,
            self.state.gradients,
            self.state.optimizer,
            self.activations.per_microbatch,
            self.activations.in_flight,
            self.activations.total,
        ]
    }

    /// Each part's largest value over all ranks of `parallel` (over the model-parallel group,
    /// then the data-parallel one): every GPU fits within it. All ranks must call it.
    pub fn largest_over_ranks(&self, parallel: &ParallelState, device: Device) -> Result<Self> {
        let parts: Vec<f64> = self.parts().iter().map(|&v| v as f64).collect();
        let parts = Tensor::from_slice(&parts).to_device(device);
        parallel.model.all_reduce(&parts, ReduceOp::Max)?;
        parallel.data.all_reduce(&parts, ReduceOp::Max)?;
        let value = |i: usize| parts.double_value(&[i as i64]) as u64;
        Ok(MemoryReport {
            state: StateBytes {
                weights: value(0),
                gradients: value(1),
                optimizer: value(2),
            },
            activations: ActivationBytes {
                per_microbatch: value(3),
                in_flight: value(4),
                total: value(5),
            },
        })
    }

    /// Megatron's line, then ours with the parts.
    pub fn lines(&self) -> [String; 2] {
        let mb = |bytes: u64| bytes as f64 / MEGABYTE;
        [
            format!(
                "Theoretical memory footprints: weight and optimizer={:.2} MB, activation={:.2} MB, total={:.2} MB",
                mb(self.state.total()),
                mb(self.activations.total),
                mb(self.total())
            ),
            format!(
                "> predicted memory per GPU (each part's largest over ranks): weights {:.2} MB, \
                 gradients {:.2} MB, optimizer state {:.2} MB, activations {:.2} MB \
                 ({:.2} MB per micro-batch, {} in flight), total {:.2} MB",
                mb(self.state.weights),
                mb(self.state.gradients),
                mb(self.state.optimizer),
                mb(self.activations.total),
                mb(self.activations.per_microbatch),
                self.activations.in_flight,
                mb(self.total())
            ),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-345M-like: s=1024, b=4, h=1024, f=4096, V=50304, bf16, 24 layers, one rank.
    fn gpt_345m() -> ActivationShape {
        ActivationShape {
            seq_length: 1024,
            micro_batch_size: 4,
            hidden_size: 1024,
            ffn_hidden_size: 4096,
            swiglu: false,
            padded_vocab_size: 50304,
            tensor: 1,
            sequence_parallel: false,
            element_bytes: 2,
            recompute: Recompute::None,
            chunk_layers: vec![24],
            pre_process: true,
            post_process: true,
            pipeline: 1,
            stage: 0,
            virtual_chunks: 1,
            microbatches: 8,
        }
    }

    const SBH: f64 = 1024.0 * 4.0 * 1024.0;

    #[test]
    fn one_layer_is_34_sbh_and_splits_by_tensor_parallelism() {
        let one = gpt_345m();
        assert_eq!(one.layer_bytes(), 34.0 * SBH);
        let tp4_sp = ActivationShape {
            tensor: 4,
            sequence_parallel: true,
            ..one.clone()
        };
        assert_eq!(tp4_sp.layer_bytes(), 34.0 * SBH / 4.0);
        let tp4 = ActivationShape {
            sequence_parallel: false,
            ..tp4_sp
        };
        assert_eq!(tp4.layer_bytes(), (10.0 + 24.0 / 4.0) * SBH);
        let swiglu = ActivationShape {
            swiglu: true,
            ..one.clone()
        };
        assert_eq!(swiglu.layer_bytes(), 42.0 * SBH);
        let float = ActivationShape {
            element_bytes: 4,
            ..one
        };
        assert_eq!(float.layer_bytes(), 68.0 * SBH);
    }

    #[test]
    fn a_whole_model_on_one_rank() {
        let estimate = gpt_345m().estimate();
        let embedding = 8.0 * 4096.0 + SBH / 2.0;
        assert_eq!(
            estimate.per_microbatch,
            (24.0 * 34.0 * SBH + embedding) as u64
        );
        assert_eq!(estimate.in_flight, 1);
        let output = 4.0 * SBH * (1.0 + 50304.0 / 1024.0);
        assert_eq!(
            estimate.total,
            (24.0 * 34.0 * SBH + embedding + output) as u64
        );
    }

    #[test]
    fn pipeline_stages_hold_their_micro_batches_in_flight() {
        let first = ActivationShape {
            pipeline: 4,
            stage: 0,
            chunk_layers: vec![6],
            post_process: false,
            ..gpt_345m()
        };
        assert_eq!(first.in_flight(), 4);
        let third = ActivationShape {
            stage: 2,
            pre_process: false,
            ..first.clone()
        };
        assert_eq!(third.in_flight(), 2);
        assert_eq!(third.estimate().total, (2.0 * 6.0 * 34.0 * SBH) as u64);
        let few = ActivationShape {
            microbatches: 2,
            ..first.clone()
        };
        assert_eq!(few.in_flight(), 2);
        // Interleaved, 2 chunks per stage: ⌈(1 + 3/8)·4⌉ = 6.
        let interleaved = ActivationShape {
            chunk_layers: vec![3, 3],
            virtual_chunks: 2,
            ..first
        };
        assert_eq!(interleaved.in_flight(), 6);
    }

    #[test]
    fn full_recompute_keeps_group_inputs() {
        let uniform = ActivationShape {
            recompute: Recompute::Full {
                method: RecomputeMethod::Uniform,
                num_layers: 4,
            },
            pre_process: false,
            post_process: false,
            ..gpt_345m()
        };
        // 6 group inputs of 2·sbh, and one group of 4 layers recomputed at a time.
        assert_eq!(
            uniform.estimate().total,
            (6.0 * 2.0 * SBH + 4.0 * 34.0 * SBH) as u64
        );
        let block = ActivationShape {
            recompute: Recompute::Full {
                method: RecomputeMethod::Block,
                num_layers: 20,
            },
            ..uniform
        };
        assert_eq!(
            block.estimate().total,
            (20.0 * 2.0 * SBH + 4.0 * 34.0 * SBH + 34.0 * SBH) as u64
        );
    }
}
