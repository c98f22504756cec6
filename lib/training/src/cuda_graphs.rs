//! `--enable-cuda-graph` (Megatron's flag): after `--cuda-graph-warmup-steps` eager iterations,
//! the forward and backward of one micro-batch — its loss, the loss's scaling and the
//! gradients' accumulation into the float32 buffers included — is captured into a CUDA graph.
//! Every later micro-batch copies its tensors into the graph's static inputs and replays it: one
//! launch instead of about a thousand, and no gap while the host queues kernels. The optimizer
//! step stays outside the graph: its learning rate and step count change every iteration, and
//! it is a handful of launches. Mixture-of-Experts layers are held when they keep their token
//! counts on the device ([`host_wait_reason`]); the auxiliary losses they track are the graph's
//! static outputs, tracked again after each replay, and their backward reads the step's scale
//! from a device scalar as the main loss does.

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::schedules::{backward_step, PipelineStage};
use super::stage::{FamilyStage, LossScaling};
use crate::args::PretrainArgs;
use crate::families::{LossTotals, ModelFamily};
use megatron_kernels::rng::{self, CudaGenerator};
use megatron_kernels::runtime::{
    cuda_empty_cache, cuda_free_memory, cuda_graphs_available, cuda_memory_stats, CudaGraph,
};
use megatron_models::layers::moe::aux_loss::{
    take_tracked_values, with_aux_loss_backward_scale_on_device, TrackedValues,
};
use megatron_models::layers::moe::host_wait_reason;
use megatron_models::loader::DeviceBatch;
use megatron_models::{Recompute, TransformerConfig};
use megatron_parallel::ParallelState;

/// Why this run (of a model of `transformer`'s architecture) cannot replay its micro-batches
/// from a CUDA graph, or `None` when it can.
pub fn unsupported_reason(
    args: &PretrainArgs,
    transformer: &TransformerConfig,
    device: Device,
    parallel: &ParallelState,
) -> Result<Option<&'static str>> {
    let moe_wait = || {
        host_wait_reason(
            transformer,
            args.precision.params_dtype(),
            device,
            parallel.layout.expert_size(),
        )
    };
    Ok(if !device.is_cuda() {
        Some("training runs on the CPU")
    } else if !cuda_graphs_available() {
        Some("this build has no CUDA graphs (its shim found no CUDA runtime headers)")
    } else if parallel.layout.context > 1 {
        Some("context parallelism copies the chunks' positions to the device at every step")
    } else if parallel.layout.pipeline > 1 {
        Some("pipeline stages exchange activations between a micro-batch's forward and backward")
    } else if args.data.reset_attention_mask {
        Some("packed sequences' documents change from one micro-batch to the next")
    } else if args.training.calculate_per_token_loss {
        Some("--calculate-per-token-loss scales each step by its token count, which the graph does not read")
    } else if args.recompute.recompute()? != Recompute::None {
        Some("activation recomputation swaps random-generator states on the host in the backward")
    } else {
        moe_wait()
    })
}

/// Whether the run asked for graphs (`--enable-cuda-graph`) or has them by default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphChoice {
    /// Asked for: a micro-batch the graph cannot take is an error.
    Asked,
    /// By default: the run stays eager where the graph cannot take a micro-batch, and when the
    /// capture would leave too little memory.
    Default,
}

/// The warm-up count and, once captured, the graph of one micro-batch's forward and backward.
pub struct MicrobatchGraph<B> {
    device: usize,
    choice: GraphChoice,
    warmup_left: u64,
    /// A default graph given up for lack of memory: the run stays eager.
    given_up: bool,
    captured: Option<Captured<B>>,
}

struct Captured<B> {
    graph: CudaGraph,
    /// The static batch the graph reads; each micro-batch is copied into it before a replay.
    inputs: B,
    inverse_microbatches: Tensor,
    loss_scale: Tensor,
    /// The auxiliary losses' gradient in backward (the loss scale over the micro-batches).
    aux_loss_scale: Tensor,
    /// The replayed micro-batch's losses (the graph zeroes them first).
    totals: LossTotals,
    /// The auxiliary losses the MoE layers track, as the graph writes them.
    aux_losses: TrackedValues,
}

impl<B: DeviceBatch> MicrobatchGraph<B> {
    /// At least one step runs eagerly, whatever `warmup_steps` says: the first compiles our
    /// kernels and runs their self-checks, which read results back to the host (not allowed
    /// while a graph captures).
    pub fn new(device: usize, choice: GraphChoice, warmup_steps: u64) -> Self {
        MicrobatchGraph {
            device,
            choice,
            warmup_left: warmup_steps.max(1),
            given_up: false,
            captured: None,
        }
    }

    /// Counts one training iteration: whether its micro-batches replay the graph (the warm-up
    /// is over).
    pub fn replays_this_step(&mut self) -> bool {
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            false
        } else {
            !self.given_up
        }
    }

    /// The forward and backward of every micro-batch of `stage` (no pipelining), through the
    /// graph, captured first on the first call; the losses go to `stage.totals` as the eager
    /// schedule would add them. `false` when a default graph leaves the step to the eager
    /// schedule: its micro-batches differ from the captured one, or there is too little memory
    /// to capture (`log` says that once).
    pub fn run<F: ModelFamily<Batch = B>>(
        &mut self,
        stage: &mut FamilyStage<'_, F>,
        loss_scale: f64,
        log: bool,
    ) -> Result<bool> {
        let batches = stage.batches;
        let Some(first) = batches.first() else {
            return Ok(true);
        };
        if self.captured.is_none() {
            // The activations of the eager steps stay cached in the allocator's general pool,
            // where nothing will use them once steps replay: returned before the free memory is
            // measured and the graph's pool comes on top.
            cuda_empty_cache()?;
            if self.choice == GraphChoice::Default && !self.memory_allows_capture()? {
                self.given_up = true;
                if log {
                    eprintln!(
                        "note: too little GPU memory is free to capture a CUDA graph; training \
                         without graphs (--enable-cuda-graph asks for them anyway)"
                    );
                }
                return Ok(false);
            }
            self.captured = Some(self.capture(stage, first).context(
                "capturing a micro-batch's forward and backward into a CUDA graph failed; \
                 run with --no-cuda-graph",
            )?);
        }
        let captured = self.captured.as_mut().expect("captured above");
        let fits = |batch: &B| {
            let (targets, sources) = (captured.inputs.tensors(), batch.tensors());
            targets.len() == sources.len()
                && targets
                    .iter()
                    .zip(&sources)
                    .all(|(t, s)| t.size() == s.size())
        };
        if !batches.iter().all(fits) {
            ensure!(
                self.choice == GraphChoice::Default,
                "--enable-cuda-graph: a micro-batch's tensors differ from those the graph was \
                 captured with"
            );
            return Ok(false);
        }
        let inverse = f64::from(1.0 / batches.len() as f32);
        let _ = captured.inverse_microbatches.fill_(inverse);
        let _ = captured.loss_scale.fill_(loss_scale);
        // The eager step's host value (the engine's), so that both give the same bits.
        let _ = captured
            .aux_loss_scale
            .fill_(loss_scale / batches.len() as f64);
        for batch in batches {
            for (target, source) in captured.inputs.tensors().into_iter().zip(batch.tensors()) {
                target.shallow_clone().copy_(source);
            }
            captured.graph.replay()?;
            stage.totals.absorb(&captured.totals);
            captured.aux_losses.track_copies();
        }
        Ok(true)
    }

    /// Whether the device has room for the graph's private pool beside what training holds:
    /// about one micro-batch's activations and gradients, which the eager steps' peak over what
    /// stays allocated between steps measures, with a quarter and 1 GiB to spare.
    fn memory_allows_capture(&self) -> Result<bool> {
        let stats = cuda_memory_stats(self.device)?;
        let Some(free) = cuda_free_memory(self.device) else {
            return Ok(false);
        };
        let transient = (stats.max_allocated_bytes - stats.allocated_bytes).max(0) as f64;
        Ok(free as f64 >= 1.25 * transient + f64::from(1u32 << 30))
    }

    fn capture<F: ModelFamily<Batch = B>>(
        &self,
        stage: &mut FamilyStage<'_, F>,
        first: &B,
    ) -> Result<Captured<B>> {
        let device = Device::Cuda(self.device);
        let inputs = first.map_tensors(&mut |t| t.copy());
        let scalar = || Tensor::ones([], (Kind::Float, device));
        let (inverse_microbatches, loss_scale, aux_loss_scale) = (scalar(), scalar(), scalar());
        let names = stage.family.loss_names();
        // Attention dropout forks to the model-parallel stream, whose state the graph advances.
        let stream = rng::model_parallel_generator();
        let generators: Vec<&CudaGenerator> = stream.as_deref().into_iter().collect();
        // What the MoE layers track while the graph captures are its outputs, not values:
        // kept apart from what this step tracked before.
        let before = take_tracked_values();
        let capture = with_aux_loss_backward_scale_on_device(&aux_loss_scale, || {
            CudaGraph::capture(self.device, None, &generators, || {
                let mut captured = FamilyStage {
                    family: stage.family,
                    chunks: stage.chunks,
                    batches: std::slice::from_ref(&inputs),
                    parallel: stage.parallel,
                    optimizer: stage.optimizer.as_deref_mut(),
                    loss_scaling: LossScaling::Device {
                        inverse_microbatches: inverse_microbatches.shallow_clone(),
                        loss_scale: loss_scale.shallow_clone(),
                    },
                    totals: LossTotals::new(names, device),
                    scoring: stage.scoring,
                };
                let loss = captured.forward(0, 0, None)?;
                backward_step(&mut captured, None, loss, None)?;
                Ok(captured.totals)
            })
        });
        let aux_losses = take_tracked_values();
        before.restore();
        let (graph, totals) = capture?;
        Ok(Captured {
            graph,
            inputs,
            inverse_microbatches,
            loss_scale,
            aux_loss_scale,
            totals,
            aux_losses,
        })
    }
}
