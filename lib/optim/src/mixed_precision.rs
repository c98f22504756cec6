//! The optimizer step with float32 main parameters and gradients over the flat buffers of
//! [`BufferLayout`], including what Megatron's `finalize_model_grads` does first: data-parallel
//! gradient reduction (all-reduce, or reduce-scatter for the distributed optimizer), the tied
//! embedding gradients over the first and last stage, and the sequence-parallel norm gradients
//! over the tensor-parallel group.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{ensure, Context, Result};
use tch::{Device, Kind, Tensor};

use super::buffer::{BufferLayout, ParamShape, Segment, ShardGroup};
use super::grad_sync::{BucketReducer, OverlappedGradSync};
use super::groups::{is_embedding_or_output, ParamGroup};
use super::memory::{main_is_params, StateBuffers, StateBytes};
use super::param_gather::ParamGather;
use megatron_kernels::ops::optimizer_kernels::{
    self, AdamwBuffers, AdamwSegment, AdamwTable, SquaresTable,
};
use megatron_kernels::ops::{self, AdamwHyper};
use megatron_kernels::runtime::CudaStream;
use megatron_models::{NamedParameter, ParamGate};
use megatron_parallel::{Communicator, ParallelState, ReduceOp};

/// Megatron's default `--ddp-bucket-size`: 40M elements.
pub const DEFAULT_BUCKET_SIZE: usize = 40_000_000;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    /// `--optimizer adam`: AdamW (decoupled weight decay), as Megatron's fused Adam.
    Adam { beta1: f64, beta2: f64, eps: f64 },
    /// `--optimizer sgd`: momentum SGD with L2-style weight decay, as `torch.optim.SGD`.
    Sgd { momentum: f64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSettings {
    pub kind: OptimizerKind,
    /// `--clip-grad`; 0 disables clipping.
    pub clip_grad: f64,
    /// `--use-distributed-optimizer`: main parameters and optimizer state sharded over the
    /// data-parallel group.
    pub distributed: bool,
    /// Elements per data-parallel communication bucket (`--ddp-bucket-size`).
    pub bucket_size: usize,
    /// `--overlap-grad-reduce`: reduce each bucket from inside the last backward pass.
    pub overlap_grad_reduce: bool,
    /// `--overlap-param-gather`: with the distributed optimizer, gather the updated parameters
    /// on a side stream while the next forward pass runs (see [`Self::param_gates`]).
    pub overlap_param_gather: bool,
    /// `--gradient-accumulation-fusion`: layers that can add their parameters' gradients
    /// straight into the float32 buffer get views of it (see
    /// [`MainGradSlot`](megatron_models::param::MainGradSlot)); unused with overlapped reduction,
    /// whose hooks fire on per-parameter gradients.
    pub gradient_accumulation_fusion: bool,
    /// `--decoupled-lr`: the input word embeddings and the output layer
    /// ([`is_embedding_or_output`]) step with [`LearningRates::embedding_or_output`].
    pub decoupled_lr: bool,
}

impl OptimizerSettings {
    /// Whether the main parameters and moments are sharded over a data-parallel group of
    /// `data_size`.
    fn shards_state(&self, data_size: usize) -> bool {
        self.distributed && data_size > 1
    }

    /// What [`MixedPrecisionOptimizer::new`] will allocate on data-parallel rank `data_rank` of
    /// `data_size` for `params` of `dtype` (see [`StateBytes::predicted`]).
    pub fn predicted_state_bytes(
        &self,
        params: &[ParamShape],
        dtype: Kind,
        data_rank: usize,
        data_size: usize,
    ) -> StateBytes {
        let state = match self.kind {
            OptimizerKind::Adam { .. } => StateBuffers::Adam,
            OptimizerKind::Sgd { momentum } if momentum != 0.0 => StateBuffers::Momentum,
            OptimizerKind::Sgd { .. } => StateBuffers::None,
        };
        StateBytes::predicted(
            params,
            self.bucket_size,
            self.shards_state(data_size),
            state,
            dtype,
            data_rank,
            data_size,
        )
    }
}

/// The learning rates of one step: Megatron's parameter groups with their own `max_lr`/`min_lr`
/// on one schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LearningRates {
    pub lr: f64,
    /// With [`OptimizerSettings::decoupled_lr`], the rate of the embeddings and output layer.
    pub embedding_or_output: f64,
}

impl LearningRates {
    /// One rate for every parameter.
    pub fn uniform(lr: f64) -> Self {
        LearningRates {
            lr,
            embedding_or_output: lr,
        }
    }
}

/// How gradients reach the data-parallel average.
enum GradSync {
    /// One data-parallel rank: nothing to do.
    Local,
    /// Bucket by bucket after backward.
    AfterBackward(BucketReducer),
    Overlapped(OverlappedGradSync),
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// The fp16 loss scaler found an inf/NaN gradient; parameters were left untouched.
    pub skipped: bool,
    /// Global L2 norm of the (unscaled) gradients before clipping; `None` when skipped.
    pub grad_norm: Option<f64>,
    /// Zeros in the reduced gradients before clipping, when counted
    /// ([`MixedPrecisionOptimizer::counting_zeros`]); `None` otherwise or when skipped.
    pub num_zeros: Option<u64>,
}

/// Views of the flat buffers that every step passes to the multi-tensor kernels, made once:
/// building them per step cost thousands of `narrow`s on the host, which the GPU waited for.
#[derive(Default)]
struct StepViews {
    /// Each segment's gradient, in segment order.
    grads: Vec<Tensor>,
    /// The gradients that count in the norm: the routed experts' apart from the others, since
    /// their parts are summed over different groups.
    counted: Vec<Tensor>,
    expert_counted: Vec<Tensor>,
    /// Per parameter group (decayed, not decayed) with Adam: main shards, gradients, moments
    /// and step counters.
    adam: Vec<AdamViews>,
    /// Model-parameter targets and main-parameter sources of the copy after a step.
    publish: (Vec<Tensor>, Vec<Tensor>),
}

struct AdamViews {
    group: ParamGroup,
    /// Steps with [`LearningRates::embedding_or_output`].
    decoupled: bool,
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
    steps: Vec<Tensor>,
}

fn refs(tensors: &[Tensor]) -> Vec<&Tensor> {
    tensors.iter().collect()
}

enum Moments {
    Adam {
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
        /// One step count per segment (all equal), float32 as ATen's fused AdamW takes them.
        step_counts: Tensor,
        /// Views of `step_counts`, one per segment, for ATen's fused AdamW.
        steps: Vec<Tensor>,
    },
    Sgd {
        momentum: Option<Tensor>,
    },
}

pub struct MixedPrecisionOptimizer {
    settings: OptimizerSettings,
    parallel: ParallelState,
    layout: BufferLayout,
    /// Whether the shards are slices of the data-parallel group (distributed optimizer).
    sharded: bool,
    /// The model's parameters in slot order; each is a view into `param_buffer`.
    params: Vec<Tensor>,
    param_buffer: Tensor,
    grad_buffer: Tensor,
    /// Float32 main parameters of this rank's shards; `param_buffer` itself for float32 models
    /// without sharding.
    main: Tensor,
    main_is_params: bool,
    moments: Moments,
    views: StepViews,
    /// Slots whose gradients are summed over the embedding group (the tied word embeddings on
    /// the first and last stage).
    embedding_slots: Vec<usize>,
    grad_sync: GradSync,
    /// The distributed optimizer's all-gather of updated parameters (overlapped on GPUs with
    /// `--overlap-param-gather` over several ranks).
    param_gather: Option<Arc<ParamGather>>,
    /// The step's own kernels, where they apply and passed their self-check.
    kernels: Option<StepKernels>,
    /// `--clip-grad` as a float32 scalar on the device, when clipping.
    clip: Option<Tensor>,
    /// Whether each step counts the zeros in the gradients ([`Self::counting_zeros`]).
    count_zeros: bool,
}

/// The tables of [`optimizer_kernels`] for this rank's layout: Adam(W) with half-precision model
/// parameters and float32 main parameters on a CUDA device.
struct StepKernels {
    /// The gradients that count in the norm, apart from the routed experts'.
    squares: SquaresTable,
    /// The routed experts' gradients, when there are any.
    expert_squares: Option<SquaresTable>,
    /// Every segment of the shards.
    adamw: AdamwTable,
}

impl MixedPrecisionOptimizer {
    /// Takes the model's parameters (all of one dtype and device) and moves them into one flat
    /// buffer, each parameter becoming a view of it.
    pub fn new(
        parameters: Vec<NamedParameter>,
        settings: OptimizerSettings,
        parallel: &ParallelState,
    ) -> Result<Self> {
        let first = parameters
            .first()
            .context("the optimizer has no parameters")?;
        let (dtype, device) = (first.tensor.kind(), first.tensor.device());
        ensure!(
            parameters
                .iter()
                .all(|p| p.tensor.kind() == dtype && p.tensor.device() == device),
            "all parameters must share one dtype and device"
        );
        // Context-parallel ranks hold parts of the same samples' gradients: they reduce, and
        // the distributed optimizer shards, over data × context.
        let parallel = &parallel.for_gradients();
        let data = &parallel.data;
        let sharded = settings.shards_state(data.size());
        let shapes = ParamShape::of_all(&parameters);
        let group = |comm: &Arc<dyn Communicator>| ShardGroup {
            rank: comm.rank(),
            size: comm.size(),
        };
        let layout = BufferLayout::with_experts(
            &shapes,
            settings.bucket_size.max(1),
            group(data),
            group(&parallel.expert_data),
            sharded,
        );
        let by_name: HashMap<&str, &NamedParameter> =
            parameters.iter().map(|p| (p.name.as_str(), p)).collect();
        let param_buffer = Tensor::zeros([layout.len as i64], (dtype, device));
        let mut params = Vec::with_capacity(layout.slots.len());
        tch::no_grad(|| {
            for slot in &layout.slots {
                let mut param = by_name[slot.name.as_str()].tensor.shallow_clone();
                let view = param_buffer
                    .narrow(0, slot.range.start as i64, slot.range.len() as i64)
                    .view(slot.shape.as_slice());
                view.shallow_clone().copy_(&param);
                param.set_data(&view);
                params.push(param);
            }
        });
        let grad_buffer = Tensor::zeros([layout.len as i64], (Kind::Float, device));
        let main_is_params = main_is_params(dtype, sharded);
        let main = if main_is_params {
            param_buffer.shallow_clone()
        } else {
            let shards: Vec<Tensor> = layout
                .buckets
                .iter()
                .map(|b| param_buffer.narrow(0, b.shard.start as i64, b.shard.len() as i64))
                .collect();
            Tensor::cat(&shards, 0).to_kind(Kind::Float)
        };
        let moments = match settings.kind {
            OptimizerKind::Adam { .. } => {
                let segments = layout.segments.len() as i64;
                let step_counts = Tensor::zeros([segments], (Kind::Float, device));
                Moments::Adam {
                    exp_avg: main.zeros_like(),
                    exp_avg_sq: main.zeros_like(),
                    steps: (0..segments).map(|i| step_counts.select(0, i)).collect(),
                    step_counts,
                }
            }
            OptimizerKind::Sgd { .. } => Moments::Sgd { momentum: None },
        };
        let embedding_slots = layout
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.attributes.tied_across_stages)
            .map(|(i, _)| i)
            .collect();
        let grad_sync = if data.size() == 1 && parallel.expert_data.size() == 1 {
            GradSync::Local
        } else {
            let reducer = BucketReducer {
                data: data.clone(),
                expert_data: parallel.expert_data.clone(),
                sharded,
                grad_buffer: grad_buffer.shallow_clone(),
                buckets: layout.buckets.clone(),
            };
            if settings.overlap_grad_reduce {
                GradSync::Overlapped(OverlappedGradSync::install(
                    reducer, &layout, &params, device,
                )?)
            } else {
                GradSync::AfterBackward(reducer)
            }
        };
        let fuse = settings.gradient_accumulation_fusion;
        for (index, slot) in layout.slots.iter().enumerate() {
            let Some(main_grad) = &by_name[slot.name.as_str()].main_grad else {
                continue;
            };
            if !fuse {
                main_grad.set(None);
                continue;
            }
            let view = grad_buffer
                .narrow(0, slot.range.start as i64, slot.range.len() as i64)
                .view(slot.shape.as_slice());
            match &grad_sync {
                GradSync::Overlapped(sync) => main_grad.set_notifying(view, sync.notifier(index)),
                _ => main_grad.set(Some(view)),
            }
        }
        let param_gather = if sharded {
            let side = match device {
                Device::Cuda(index) if settings.overlap_param_gather && data.size() > 1 => {
                    Some(CudaStream::from_pool(index)?)
                }
                _ => None,
            };
            Some(Arc::new(ParamGather::new(
                data.clone(),
                parallel.expert_data.clone(),
                param_buffer.shallow_clone(),
                layout.clone(),
                side,
            )))
        } else {
            None
        };
        let mut optimizer = MixedPrecisionOptimizer {
            views: StepViews::default(),
            kernels: None,
            count_zeros: false,
            clip: (settings.clip_grad > 0.0)
                .then(|| Tensor::from(settings.clip_grad as f32).to_device(device)),
            param_gather,
            grad_sync,
            settings,
            parallel: parallel.clone(),
            layout,
            sharded,
            params,
            param_buffer,
            grad_buffer,
            main,
            main_is_params,
            moments,
            embedding_slots,
        };
        optimizer.views = optimizer.step_views();
        optimizer.kernels = optimizer.step_kernels()?;
        Ok(optimizer)
    }

    /// The step's own kernels, for Adam with bf16/fp16 parameters on a CUDA device, unless
    /// [`optimizer_kernels::usable_on`] says no (ATen's kernels are used then).
    fn step_kernels(&self) -> Result<Option<StepKernels>> {
        let kind = self.param_buffer.kind();
        let Device::Cuda(index) = self.grad_buffer.device() else {
            return Ok(None);
        };
        // The kernels take one learning rate for every segment.
        if !matches!(self.settings.kind, OptimizerKind::Adam { .. })
            || self.main_is_params
            || (0..self.layout.slots.len()).any(|slot| self.decoupled(slot))
            || !optimizer_kernels::usable_on(index, kind)
        {
            return Ok(None);
        }
        let segments = &self.layout.segments;
        let device = self.grad_buffer.device();
        let counted = |expert: bool| -> Vec<std::ops::Range<usize>> {
            segments
                .iter()
                .filter(|s| self.counted(s) && self.is_expert(s) == expert)
                .map(|s| s.buffer.clone())
                .collect()
        };
        let expert_counted = counted(true);
        let adamw: Vec<AdamwSegment> = segments
            .iter()
            .map(|s| AdamwSegment {
                buffer_start: s.buffer.start,
                shard_start: s.shard.start,
                len: s.buffer.len(),
                decayed: self.layout.slots[s.slot].group == ParamGroup::Decayed,
            })
            .collect();
        Ok(Some(StepKernels {
            squares: SquaresTable::new(&counted(false), device),
            expert_squares: (!expert_counted.is_empty())
                .then(|| SquaresTable::new(&expert_counted, device)),
            adamw: AdamwTable::new(&adamw, device)?,
        }))
    }

    /// Whether the step runs on [`optimizer_kernels`] (see [`Self::without_step_kernels`]).
    pub fn uses_step_kernels(&self) -> bool {
        self.kernels.is_some()
    }

    /// Makes every step count the zeros in the reduced gradients (`--log-num-zeros-in-grad`),
    /// in [`StepOutcome::num_zeros`]; a pass over the gradients and a reduction more.
    pub fn counting_zeros(mut self) -> Self {
        self.count_zeros = true;
        self
    }

    /// Keeps the step on ATen's multi-tensor kernels (to compare the two).
    pub fn without_step_kernels(mut self) -> Self {
        self.kernels = None;
        self
    }

    /// The views of [`StepViews`]; the buffers they view are only ever updated in place
    /// (checkpoint loads copy into them), so they stay valid.
    fn step_views(&self) -> StepViews {
        let segments = &self.layout.segments;
        let grads: Vec<Tensor> = segments.iter().map(|s| self.grad_view(&s.buffer)).collect();
        let counted = |expert: bool| -> Vec<Tensor> {
            segments
                .iter()
                .zip(&grads)
                .filter(|(s, _)| self.counted(s) && self.is_expert(s) == expert)
                .map(|(_, g)| g.shallow_clone())
                .collect()
        };
        let (counted, expert_counted) = (counted(false), counted(true));
        let adam = match &self.moments {
            Moments::Adam {
                exp_avg,
                exp_avg_sq,
                steps,
                ..
            } => [
                (ParamGroup::Decayed, false),
                (ParamGroup::NotDecayed, false),
                (ParamGroup::Decayed, true),
                (ParamGroup::NotDecayed, true),
            ]
            .into_iter()
            .filter_map(|(group, decoupled)| {
                let chosen: Vec<usize> = (0..segments.len())
                    .filter(|&i| {
                        let slot = segments[i].slot;
                        self.layout.slots[slot].group == group && self.decoupled(slot) == decoupled
                    })
                    .collect();
                // The two groups without a rate of their own are kept even when empty, as
                // before decoupled rates existed.
                (!decoupled || !chosen.is_empty()).then_some((group, decoupled, chosen))
            })
            .map(|(group, decoupled, chosen)| {
                let shard = |t: &Tensor, i: usize| {
                    let s = &segments[i].shard;
                    t.narrow(0, s.start as i64, s.len() as i64)
                };
                AdamViews {
                    group,
                    decoupled,
                    params: chosen
                        .iter()
                        .map(|&i| self.main_view(&segments[i]))
                        .collect(),
                    grads: chosen.iter().map(|&i| grads[i].shallow_clone()).collect(),
                    exp_avgs: chosen.iter().map(|&i| shard(exp_avg, i)).collect(),
                    exp_avg_sqs: chosen.iter().map(|&i| shard(exp_avg_sq, i)).collect(),
                    steps: chosen.iter().map(|&i| steps[i].shallow_clone()).collect(),
                }
            })
            .collect(),
            Moments::Sgd { .. } => Vec::new(),
        };
        let publish = if self.main_is_params {
            (Vec::new(), Vec::new())
        } else {
            segments
                .iter()
                .map(|s| {
                    (
                        self.param_buffer
                            .narrow(0, s.buffer.start as i64, s.buffer.len() as i64),
                        self.main_view(s),
                    )
                })
                .unzip()
        };
        StepViews {
            grads,
            counted,
            expert_counted,
            adam,
            publish,
        }
    }

    /// Whether the parameter of `slot` steps with the decoupled learning rate.
    fn decoupled(&self, slot: usize) -> bool {
        self.settings.decoupled_lr && is_embedding_or_output(&self.layout.slots[slot].name)
    }

    /// The bytes this rank's buffers hold now (SGD's momentum once the first step made it).
    pub fn state_bytes(&self) -> StateBytes {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let main = if self.main_is_params {
            0
        } else {
            bytes(&self.main)
        };
        let moments = match &self.moments {
            Moments::Adam {
                exp_avg,
                exp_avg_sq,
                step_counts,
                ..
            } => bytes(exp_avg) + bytes(exp_avg_sq) + bytes(step_counts),
            Moments::Sgd { momentum } => momentum.as_ref().map_or(0, bytes),
        };
        StateBytes {
            weights: bytes(&self.param_buffer),
            gradients: bytes(&self.grad_buffer),
            optimizer: main + moments,
        }
    }

    /// Bytes this rank holds per model parameter for parameters, gradients and optimizer state
    /// (the spec's table: 18 for bf16 params with float32 gradients, 6 + 12/d with the
    /// distributed optimizer over d ranks; bucket padding adds a little).
    pub fn bytes_per_parameter(&self) -> f64 {
        let parameters: usize = self.layout.slots.iter().map(|s| s.range.len()).sum();
        self.state_bytes().total() as f64 / parameters as f64
    }

    /// Starts accumulating a step of `microbatches` backward passes.
    pub fn begin_step(&self, microbatches: usize) {
        if let GradSync::Overlapped(sync) = &self.grad_sync {
            sync.begin_step(microbatches);
        }
    }

    fn grad_view(&self, range: &std::ops::Range<usize>) -> Tensor {
        self.grad_buffer
            .narrow(0, range.start as i64, range.len() as i64)
    }

    fn main_view(&self, segment: &Segment) -> Tensor {
        self.main
            .narrow(0, segment.shard.start as i64, segment.shard.len() as i64)
    }

    /// After a micro-batch's backward: adds the parameters' gradients into the float32 buffer
    /// and clears them, so accumulation over micro-batches happens in float32 whatever the
    /// parameter dtype (Megatron's `main_grad`). With `--overlap-grad-reduce` the hooks have
    /// already moved the last pass's gradients, and their buckets may be being reduced on the
    /// side stream: those slots are left alone (adding their zeroed gradients would race).
    pub fn accumulate_grads(&mut self) -> Result<()> {
        let moved = match &self.grad_sync {
            GradSync::Overlapped(sync) => sync.moved(),
            _ => vec![false; self.params.len()],
        };
        let mut targets = Vec::new();
        let mut grads = Vec::new();
        for ((slot, param), moved) in self.layout.slots.iter().zip(&self.params).zip(moved) {
            let grad = param.grad();
            if grad.defined() && !moved {
                targets.push(self.grad_view(&slot.range).view(slot.shape.as_slice()));
                grads.push(grad);
            }
        }
        let target_refs: Vec<&Tensor> = targets.iter().collect();
        let grad_refs: Vec<&Tensor> = grads.iter().collect();
        ops::foreach_add_(&target_refs, &grad_refs)?;
        ops::foreach_zero_(&grad_refs)?;
        Ok(())
    }

    /// Megatron's `finalize_model_grads`: data-parallel reduction, then the tied embeddings'
    /// gradients over the embedding group and the sequence-parallel ones over the tensor group.
    fn finalize_grads(&self) -> Result<()> {
        match &self.grad_sync {
            GradSync::Local => {}
            GradSync::AfterBackward(reducer) => {
                for bucket in 0..self.layout.buckets.len() {
                    reducer.reduce(bucket)?;
                }
            }
            GradSync::Overlapped(sync) => sync.finish()?,
        }
        let embedding: Vec<Tensor> = self
            .embedding_slots
            .iter()
            .map(|&i| self.grad_view(&self.layout.slots[i].range))
            .collect();
        all_reduce_coalesced(&self.parallel.embedding, &embedding)
            .context("all-reduce of tied embedding gradients")?;
        // Replicated parameters whose gradient each tensor-parallel rank holds a part of: the
        // norms under sequence parallelism, and `--qk-layernorm`'s per-head norms always (as
        // Megatron's `_allreduce_layernorm_grads`). Every rank of the group has the same slots.
        let partial: Vec<Tensor> = self
            .layout
            .slots
            .iter()
            .filter(|s| s.attributes.sequence_parallel)
            .map(|s| self.grad_view(&s.range))
            .collect();
        if !partial.is_empty() {
            all_reduce_coalesced(&self.parallel.tensor, &partial)
                .context("all-reduce of sequence-parallel gradients")?;
        }
        Ok(())
    }

    /// Groups that hold pieces of one gradient: the model-parallel ranks, and with the
    /// distributed optimizer the data-parallel ones.
    fn reduce_over_replica(&self, value: &Tensor, op: ReduceOp) -> Result<()> {
        self.parallel.model.all_reduce(value, op)?;
        if self.sharded {
            self.parallel.data.all_reduce(value, op)?;
        }
        Ok(())
    }

    /// Groups that hold pieces of the routed experts' gradients: the expert-parallel and
    /// pipeline ranks, and with the distributed optimizer the expert-data-parallel ones.
    fn reduce_over_expert_replica(&self, value: &Tensor, op: ReduceOp) -> Result<()> {
        self.parallel.expert_model.all_reduce(value, op)?;
        if self.sharded {
            self.parallel.expert_data.all_reduce(value, op)?;
        }
        Ok(())
    }

    /// Whether a segment's elements count once in norms: replicated parameters are counted on
    /// tensor-parallel rank 0 only, and the last stage's copy of the embeddings never. A
    /// routed expert is whole on its rank and counted there, in the experts' part.
    fn counted(&self, segment: &Segment) -> bool {
        let attributes = self.layout.slots[segment.slot].attributes;
        attributes.expert
            || !attributes.shared_embedding
                && (attributes.tensor_parallel || self.parallel.tensor_parallel_rank() == 0)
    }

    fn is_expert(&self, segment: &Segment) -> bool {
        self.layout.slots[segment.slot].attributes.expert
    }

    /// The norm of `views` and `expert_views` (the routed experts') over the whole model.
    fn global_norm(&self, views: &[Tensor], expert_views: &[Tensor]) -> Result<Tensor> {
        let device = self.grad_buffer.device();
        let squares = |views: &[Tensor]| -> Result<Tensor> {
            let refs: Vec<&Tensor> = views.iter().collect();
            Ok(ops::total_norm(&refs)?.to_device(device).square())
        };
        let experts = if expert_views.is_empty() {
            None
        } else {
            Some(squares(expert_views)?)
        };
        self.replica_norm(squares(views)?, experts)
    }

    /// The square root of this rank's sums of squares, `squared` summed over the replica and
    /// the routed experts' `expert_squared` over theirs (Megatron's chained optimizer adds
    /// the squared norms of its dense and expert parts).
    fn replica_norm(&self, squared: Tensor, expert_squared: Option<Tensor>) -> Result<Tensor> {
        self.reduce_over_replica(&squared, ReduceOp::Sum)?;
        Ok(match expert_squared {
            Some(experts) => {
                self.reduce_over_expert_replica(&experts, ReduceOp::Sum)?;
                (squared + experts).sqrt()
            }
            None => squared.sqrt(),
        })
    }

    /// The zeros in the gradients that count, over the whole replica (Megatron's
    /// `--log-num-zeros-in-grad`).
    fn grad_zeros(&self) -> Result<u64> {
        let device = self.grad_buffer.device();
        let count = |views: &[Tensor]| {
            let mut zeros = Tensor::zeros([], (Kind::Double, device));
            for view in views {
                zeros += view.eq(0.0).sum(Kind::Double);
            }
            zeros
        };
        let (zeros, expert_zeros) = (
            count(&self.views.counted),
            count(&self.views.expert_counted),
        );
        self.reduce_over_replica(&zeros, ReduceOp::Sum)?;
        self.reduce_over_expert_replica(&expert_zeros, ReduceOp::Sum)?;
        Ok((zeros + expert_zeros).double_value(&[]) as u64)
    }

    /// The global norm of the gradients that count.
    fn grad_norm(&self) -> Result<Tensor> {
        match &self.kernels {
            Some(kernels) => self.replica_norm(
                optimizer_kernels::sum_of_squares(&self.grad_buffer, &kernels.squares)?,
                kernels
                    .expert_squares
                    .as_ref()
                    .map(|table| optimizer_kernels::sum_of_squares(&self.grad_buffer, table))
                    .transpose()?,
            ),
            None => self.global_norm(&self.views.counted, &self.views.expert_counted),
        }
    }

    /// Reduces, unscales (fp16), checks, clips and applies the accumulated gradients, then
    /// clears them. `loss_scale` is the fp16 scaler's current scale (`None` for bf16/fp32).
    pub fn step(
        &mut self,
        lrs: LearningRates,
        weight_decay: f64,
        loss_scale: Option<f32>,
    ) -> Result<StepOutcome> {
        self.finalize_grads()?;
        let device = self.grad_buffer.device();
        let grad_refs = refs(&self.views.grads);
        if let Some(scale) = loss_scale {
            let found_inf = Tensor::zeros([], (Kind::Float, device));
            let inverse = Tensor::from(1.0 / scale).to_device(device);
            ops::unscale_and_check_finite(&grad_refs, &found_inf, &inverse)?;
            self.reduce_over_replica(&found_inf, ReduceOp::Max)?;
            if found_inf.double_value(&[]) > 0.0 {
                self.zero_grads()?;
                return Ok(StepOutcome {
                    skipped: true,
                    grad_norm: None,
                    num_zeros: None,
                });
            }
        }
        let norm = self.grad_norm()?;
        let num_zeros = if self.count_zeros {
            Some(self.grad_zeros()?)
        } else {
            None
        };
        // Megatron scales by clip / (norm + 1e-6) only when that is below one; dividing by
        // the clamped inverse is the identity otherwise, with no branch on the host. Adam
        // divides inside its own kernel, so clipping costs no pass over the gradients.
        let clip_divisor = self
            .clip
            .as_ref()
            .map(|clip| ((&norm + 1e-6) / clip).clamp_min(1.0));
        if let (Some(kernels), OptimizerKind::Adam { beta1, beta2, eps }) =
            (&self.kernels, self.settings.kind)
        {
            self.kernel_step(
                kernels,
                lrs.lr,
                weight_decay,
                (beta1, beta2, eps),
                clip_divisor,
            )?;
            // Read once the update is queued: the device runs it while the host waits.
            return Ok(StepOutcome {
                skipped: false,
                grad_norm: Some(norm.double_value(&[])),
                num_zeros,
            });
        }
        match self.settings.kind {
            OptimizerKind::Adam { beta1, beta2, eps } => {
                for views in &self.views.adam {
                    let decay = if views.group == ParamGroup::Decayed {
                        weight_decay
                    } else {
                        0.0
                    };
                    let hyper = AdamwHyper {
                        lr: if views.decoupled {
                            lrs.embedding_or_output
                        } else {
                            lrs.lr
                        },
                        beta1,
                        beta2,
                        eps,
                        weight_decay: decay,
                    };
                    tch::no_grad(|| {
                        ops::fused_adamw(
                            &refs(&views.params),
                            &refs(&views.grads),
                            &refs(&views.exp_avgs),
                            &refs(&views.exp_avg_sqs),
                            &refs(&views.steps),
                            hyper,
                            clip_divisor.as_ref(),
                        )
                    })?;
                }
            }
            OptimizerKind::Sgd { momentum } => {
                if let Some(divisor) = &clip_divisor {
                    ops::foreach_mul_(&grad_refs, &divisor.reciprocal())?;
                }
                let segments = self.layout.segments.clone();
                self.sgd_step(&segments, lrs, weight_decay, momentum)
            }
        }
        self.publish_main_params()?;
        self.zero_grads()?;
        // Read once the update is queued: the device runs it while the host waits.
        Ok(StepOutcome {
            skipped: false,
            grad_norm: Some(norm.double_value(&[])),
            num_zeros,
        })
    }

    /// The Adam step on [`optimizer_kernels`]: one launch updates the main parameters and
    /// moments, writes the model parameters and (unless sharded) zeroes the gradients; with the
    /// distributed optimizer the rest of the gradient buffer, reduced to other ranks' shards,
    /// still needs its fill.
    fn kernel_step(
        &self,
        kernels: &StepKernels,
        lr: f64,
        weight_decay: f64,
        (beta1, beta2, eps): (f64, f64, f64),
        clip_divisor: Option<Tensor>,
    ) -> Result<()> {
        let Moments::Adam {
            exp_avg,
            exp_avg_sq,
            step_counts,
            ..
        } = &self.moments
        else {
            anyhow::bail!("the optimizer kernels run Adam only");
        };
        tch::no_grad(|| -> Result<()> {
            let _ = step_counts.shallow_clone().g_add_scalar_(1.0);
            let buffers = AdamwBuffers {
                main: &self.main,
                exp_avg,
                exp_avg_sq,
                grads: &self.grad_buffer,
                model: &self.param_buffer,
            };
            let hyper = AdamwHyper {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            };
            optimizer_kernels::adamw(
                &buffers,
                &kernels.adamw,
                hyper,
                step_counts,
                clip_divisor.as_ref(),
                !self.sharded,
            )
        })?;
        self.gather_params()?;
        if self.sharded {
            self.zero_grads()?;
        }
        Ok(())
    }

    fn sgd_step(
        &mut self,
        segments: &[Segment],
        lrs: LearningRates,
        weight_decay: f64,
        momentum: f64,
    ) {
        let mut buffer = match &mut self.moments {
            Moments::Sgd { momentum: buffer } => buffer.take(),
            Moments::Adam { .. } => None,
        };
        if momentum != 0.0 && buffer.is_none() {
            buffer = Some(self.main.zeros_like());
        }
        tch::no_grad(|| {
            for segment in segments {
                let decay = if self.layout.slots[segment.slot].group == ParamGroup::Decayed {
                    weight_decay
                } else {
                    0.0
                };
                let main = self.main_view(segment);
                let grad = self.grad_view(&segment.buffer);
                let mut direction = if decay != 0.0 {
                    &grad + &main * decay
                } else {
                    grad.copy()
                };
                if let Some(buffer) = &buffer {
                    // From a zero velocity the first step takes the gradient itself, as
                    // torch.optim.SGD does.
                    let velocity =
                        buffer.narrow(0, segment.shard.start as i64, segment.shard.len() as i64);
                    let updated = &velocity * momentum + &direction;
                    velocity.shallow_clone().copy_(&updated);
                    direction = updated;
                }
                let lr = if self.decoupled(segment.slot) {
                    lrs.embedding_or_output
                } else {
                    lrs.lr
                };
                let _ = main.shallow_clone().g_sub_(&(direction * lr));
            }
        });
        self.moments = Moments::Sgd { momentum: buffer };
    }

    /// Writes the updated main parameters into the model's buffer and, with the distributed
    /// optimizer, all-gathers every rank's shard.
    fn publish_main_params(&self) -> Result<()> {
        if !self.main_is_params {
            let (targets, sources) = &self.views.publish;
            tch::no_grad(|| ops::foreach_copy_(&refs(targets), &refs(sources)))?;
        }
        self.gather_params()
    }

    /// With the distributed optimizer, all-gathers every rank's updated shard of the model
    /// parameters.
    fn gather_params(&self) -> Result<()> {
        match &self.param_gather {
            Some(gather) => gather.launch(),
            None => Ok(()),
        }
    }

    /// With `--overlap-param-gather`, one gate per model chunk for
    /// [`GptModel::set_param_gate`](megatron_models::GptModel::set_param_gate); `prefixes` are the
    /// chunks' parameter-name prefixes here. Empty otherwise.
    pub fn param_gates(&self, prefixes: &[String]) -> Vec<Arc<dyn ParamGate>> {
        match &self.param_gather {
            Some(gather) if gather.overlapped() => {
                prefixes.iter().map(|p| gather.gate(p.clone())).collect()
            }
            _ => Vec::new(),
        }
    }

    /// Makes the current stream wait for parameter gathers still in flight, before the
    /// parameters are read outside a forward pass (checkpoints).
    pub fn wait_for_params(&self) -> Result<()> {
        match &self.param_gather {
            Some(gather) => gather.wait_all(),
            None => Ok(()),
        }
    }

    fn zero_grads(&self) -> Result<()> {
        tch::no_grad(|| {
            let _ = self.grad_buffer.shallow_clone().zero_();
        });
        Ok(())
    }

    /// The L2 norm of the parameters over the whole model (`--log-params-norm`).
    pub fn params_norm(&self) -> Result<f64> {
        let views = |expert: bool| -> Vec<Tensor> {
            self.layout
                .segments
                .iter()
                .filter(|s| self.counted(s) && self.is_expert(s) == expert)
                .map(|s| self.main_view(s))
                .collect()
        };
        Ok(self
            .global_norm(&views(false), &views(true))?
            .double_value(&[]))
    }

    /// This rank's optimizer state for checkpoints: the float32 main parameters and moments of
    /// its shards (the whole buffer without the distributed optimizer).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("main".to_string(), self.main.shallow_clone())];
        match &self.moments {
            Moments::Adam {
                exp_avg,
                exp_avg_sq,
                steps,
                ..
            } => {
                out.push(("exp_avg".to_string(), exp_avg.shallow_clone()));
                out.push(("exp_avg_sq".to_string(), exp_avg_sq.shallow_clone()));
                if let Some(step) = steps.first() {
                    // A tensor of its own, not a view into every segment's count.
                    out.push(("step".to_string(), step.copy()));
                }
            }
            Moments::Sgd {
                momentum: Some(buffer),
            } => out.push(("momentum".to_string(), buffer.shallow_clone())),
            Moments::Sgd { momentum: None } => {}
        }
        out
    }

    /// Restores [`state_tensors`](Self::state_tensors) and re-derives the model parameters from
    /// the main parameters, so a half-precision model resumes from the exact float32 values.
    pub fn load_state_tensors(&mut self, tensors: &HashMap<String, Tensor>) -> Result<()> {
        let get = |key: &str| -> Result<&Tensor> {
            tensors
                .get(key)
                .with_context(|| format!("optimizer state has no tensor {key}"))
        };
        let expected = self.main.size();
        let main = get("main")?;
        ensure!(
            main.size() == expected,
            "optimizer state holds {:?} elements but this model and layout need {:?} (was it saved with other parallel sizes?)",
            main.size(),
            expected
        );
        tch::no_grad(|| -> Result<()> {
            self.main.shallow_clone().copy_(main);
            match &mut self.moments {
                Moments::Adam {
                    exp_avg,
                    exp_avg_sq,
                    step_counts,
                    ..
                } => {
                    exp_avg.copy_(get("exp_avg")?);
                    exp_avg_sq.copy_(get("exp_avg_sq")?);
                    // Every segment's count, through the views ATen's fused AdamW reads.
                    step_counts.copy_(&get("step")?.reshape([-1]).expand_as(step_counts));
                }
                Moments::Sgd { momentum } => {
                    *momentum = tensors
                        .get("momentum")
                        .map(|t| t.to_kind(Kind::Float).to_device(self.main.device()));
                }
            }
            Ok(())
        })?;
        self.publish_main_params()
    }
}

/// Sums `tensors` over `group` with one collective (they are flattened into one buffer).
fn all_reduce_coalesced(
    group: &std::sync::Arc<dyn Communicator>,
    tensors: &[Tensor],
) -> Result<()> {
    if group.size() == 1 || tensors.is_empty() {
        return Ok(());
    }
    let flat = Tensor::cat(
        &tensors.iter().map(|t| t.reshape([-1])).collect::<Vec<_>>(),
        0,
    );
    group.all_reduce(&flat, ReduceOp::Sum)?;
    let mut offset = 0;
    for tensor in tensors {
        let n = tensor.numel() as i64;
        tensor
            .shallow_clone()
            .copy_(&flat.narrow(0, offset, n).view_as(tensor));
        offset += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use megatron_models::ParamAttributes;
    use megatron_parallel::{ParallelLayout, ThreadWorld};
    use std::time::Duration;
    use tch::Device;

    fn bytes_per_parameter(kind: Kind, data_parallel: usize, distributed: bool) -> f64 {
        let world = ThreadWorld::new(data_parallel, Duration::from_secs(20));
        let layout = ParallelLayout::new(data_parallel, 1, 1).unwrap();
        let settings = OptimizerSettings {
            kind: OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
            clip_grad: 1.0,
            distributed,
            bucket_size: DEFAULT_BUCKET_SIZE,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            gradient_accumulation_fusion: true,
            decoupled_lr: false,
        };
        let sizes = world
            .run(|rank| {
                let parallel = ParallelState::threads(&world, layout, rank, false)?;
                let parameters = vec![NamedParameter {
                    name: "w".into(),
                    tensor: Tensor::zeros([1 << 16], (kind, Device::Cpu)),
                    attributes: ParamAttributes::default(),
                    main_grad: None,
                }];
                Ok(
                    MixedPrecisionOptimizer::new(parameters, settings, &parallel)?
                        .bytes_per_parameter(),
                )
            })
            .unwrap();
        // Adam's float32 step counter (one per segment) adds a few bytes to the 2^16 parameters.
        (sizes[0] * 1000.0).round() / 1000.0
    }

    /// One step of `kind` with `--decoupled-lr` on four float32 parameters whose gradients are
    /// all ones; returns each parameter's change.
    fn decoupled_step_changes(kind: OptimizerKind, lrs: LearningRates) -> Vec<(String, f64)> {
        let settings = OptimizerSettings {
            kind,
            clip_grad: 0.0,
            distributed: false,
            bucket_size: DEFAULT_BUCKET_SIZE,
            overlap_grad_reduce: false,
            overlap_param_gather: false,
            gradient_accumulation_fusion: false,
            decoupled_lr: true,
        };
        let names = [
            "embedding.word_embeddings.weight",
            "embedding.position_embeddings.weight",
            "decoder.layers.0.mlp.linear_fc1.weight",
            "output_layer.weight",
        ];
        let parameters: Vec<NamedParameter> = names
            .iter()
            .map(|name| NamedParameter {
                name: name.to_string(),
                tensor: Tensor::ones([3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true),
                attributes: ParamAttributes::default(),
                main_grad: None,
            })
            .collect();
        let handles: Vec<Tensor> = parameters
            .iter()
            .map(|p| p.tensor.shallow_clone())
            .collect();
        let mut optimizer =
            MixedPrecisionOptimizer::new(parameters, settings, &ParallelState::single()).unwrap();
        optimizer.begin_step(1);
        let loss = handles
            .iter()
            .map(|p| p.sum(Kind::Float))
            .reduce(|a, b| a + b)
            .unwrap();
        loss.backward();
        optimizer.accumulate_grads().unwrap();
        let outcome = optimizer.step(lrs, 0.0, None).unwrap();
        assert!(!outcome.skipped);
        names
            .iter()
            .zip(&handles)
            .map(|(name, p)| {
                (
                    name.to_string(),
                    1.0 - p.mean(Kind::Float).double_value(&[]),
                )
            })
            .collect()
    }

    #[test]
    fn decoupled_rate_steps_only_the_word_embeddings_and_output_layer() {
        let lrs = LearningRates {
            lr: 0.01,
            embedding_or_output: 0.25,
        };
        // SGD without momentum moves each parameter by its rate times the unit gradient; Adam's
        // first step moves it by its rate (m̂/√v̂ = 1 up to eps).
        for (kind, tolerance) in [
            (OptimizerKind::Sgd { momentum: 0.0 }, 1e-7),
            (
                OptimizerKind::Adam {
                    beta1: 0.9,
                    beta2: 0.95,
                    eps: 1e-8,
                },
                1e-6,
            ),
        ] {
            for (name, change) in decoupled_step_changes(kind, lrs) {
                let expected =
                    if name.starts_with("embedding.word") || name == "output_layer.weight" {
                        0.25
                    } else {
                        0.01
                    };
                assert!(
                    (change - expected).abs() <= tolerance,
                    "{kind:?} {name}: moved by {change}, expected {expected}"
                );
            }
        }
    }

    #[test]
    fn memory_per_parameter_follows_the_spec_table() {
        assert_eq!(bytes_per_parameter(Kind::BFloat16, 1, false), 18.0);
        assert_eq!(
            bytes_per_parameter(Kind::BFloat16, 4, true),
            6.0 + 12.0 / 4.0
        );
        assert_eq!(bytes_per_parameter(Kind::Float, 1, false), 16.0);
        // Megatron steps float32 parameters in place; we keep a float32 copy of the shard.
        assert_eq!(bytes_per_parameter(Kind::Float, 4, true), 8.0 + 12.0 / 4.0);
    }
}
