//! Data-parallel gradient reduction, bucket by bucket: after backward, or with
//! `--overlap-grad-reduce` from inside backward, as soon as the last micro-batch has produced
//! every gradient of a bucket (Megatron's DDP hooks, which gradient-accumulation fusion keeps). On GPUs the overlapped reductions run on
//! a side stream that waits for the gradients; the optimizer's stream waits for it in turn.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, Context, Result};
use tch::{Device, Tensor};

use super::buffer::{Bucket, BufferLayout};
use megatron_kernels::autograd::set_post_accumulate_grad_hook;
use megatron_kernels::ops;
use megatron_kernels::runtime::CudaStream;
use megatron_parallel::{Communicator, ReduceOp};

/// Averages the float32 gradient buffer over the data-parallel group: all-reduced, or with the
/// distributed optimizer reduce-scattered into each rank's shard. Experts' buckets are summed
/// over the expert-data-parallel group instead, divided by the data-parallel size as well
/// (Megatron's `expert_gradient_scaling_factor`): an expert's gradient already holds the
/// tokens of every expert-parallel rank.
pub(crate) struct BucketReducer {
    pub data: Arc<dyn Communicator>,
    pub expert_data: Arc<dyn Communicator>,
    pub sharded: bool,
    pub grad_buffer: Tensor,
    pub buckets: Vec<Bucket>,
}

impl BucketReducer {
    fn view(&self, range: &Range<usize>) -> Tensor {
        self.grad_buffer
            .narrow(0, range.start as i64, range.len() as i64)
    }

    pub fn reduce(&self, index: usize) -> Result<()> {
        let bucket = &self.buckets[index];
        let view = self.view(&bucket.range);
        let _ = view
            .shallow_clone()
            .g_mul_scalar_(1.0 / self.data.size() as f64);
        let group = if bucket.expert {
            &self.expert_data
        } else {
            &self.data
        };
        if self.sharded {
            let reduced = group
                .reduce_scatter(&view, 0)
                .context("reduce-scatter of gradients")?;
            self.view(&bucket.shard).copy_(&reduced);
        } else {
            group
                .all_reduce(&view, ReduceOp::Sum)
                .context("all-reduce of gradients")?;
        }
        Ok(())
    }
}

/// Where a parameter's gradient goes.
struct SlotTarget {
    range: Range<usize>,
    shape: Vec<i64>,
    bucket: usize,
}

/// How many times a slot hears of its gradient in one micro-batch's backward, learned from the
/// first step: the autograd hook fires at most once per backward, while a layer that adds
/// straight into the float32 buffer (gradient-accumulation fusion) says so once per use, and a
/// tied weight (embedding and output layer) has two uses.
#[derive(Clone, Copy, PartialEq)]
struct PerMicrobatch {
    hooks: usize,
    notices: usize,
}

struct OverlapState {
    reducer: BucketReducer,
    slots: Vec<SlotTarget>,
    /// Autograd hooks that fired for each slot in this step.
    passes: Vec<usize>,
    /// Fused accumulations into each slot's buffer range in this step.
    notices: Vec<usize>,
    /// Learned once a step has run; `None` for a slot whose counts did not divide evenly (or
    /// that got no gradient): its bucket is reduced when the step finishes.
    per_microbatch: Option<Vec<Option<PerMicrobatch>>>,
    /// Slots of each bucket still waiting for their last gradient.
    pending: Vec<usize>,
    launched: Vec<bool>,
    microbatches: usize,
    /// The side stream of overlapped reductions (GPUs).
    side: Option<CudaStream>,
    /// The first failure inside a hook, reported when the step finishes.
    error: Option<String>,
}

impl OverlapState {
    /// Earlier passes leave the gradient to the optimizer's batched accumulation after
    /// backward; on the last one the hook moves it into the buffer itself, so that its bucket
    /// can be reduced before backward ends.
    fn gradient_ready(&mut self, slot: usize, parameter: &Tensor) -> Result<()> {
        self.passes[slot] += 1;
        if self.passes[slot] != self.microbatches {
            return Ok(());
        }
        let grad = parameter.grad();
        if grad.defined() {
            let target = &self.slots[slot];
            let view = self
                .reducer
                .view(&target.range)
                .view(target.shape.as_slice());
            ops::foreach_add_(&[&view], &[&grad])?;
            ops::foreach_zero_(&[&grad])?;
        }
        self.maybe_complete(slot)
    }

    /// A layer added this slot's gradient into the buffer itself.
    fn accumulated(&mut self, slot: usize) -> Result<()> {
        self.notices[slot] += 1;
        self.maybe_complete(slot)
    }

    /// Counts the slot as complete when it has heard of every gradient the step brings, and
    /// launches its bucket's reduction when it was the bucket's last.
    fn maybe_complete(&mut self, slot: usize) -> Result<()> {
        let Some(Some(expected)) = self.per_microbatch.as_ref().map(|p| p[slot]) else {
            return Ok(());
        };
        let heard = PerMicrobatch {
            hooks: self.passes[slot],
            notices: self.notices[slot],
        };
        let due = PerMicrobatch {
            hooks: expected.hooks * self.microbatches,
            notices: expected.notices * self.microbatches,
        };
        if heard != due {
            return Ok(());
        }
        let bucket = self.slots[slot].bucket;
        self.pending[bucket] -= 1;
        if self.pending[bucket] == 0 {
            self.launch(bucket)?;
        }
        Ok(())
    }

    fn launch(&mut self, bucket: usize) -> Result<()> {
        self.launched[bucket] = true;
        match self.side {
            Some(side) => {
                side.wait_for(&CudaStream::current(side.device)?)?;
                side.run(|| self.reducer.reduce(bucket))?
            }
            None => self.reducer.reduce(bucket),
        }
    }

    /// After the first step: what each slot hears per micro-batch.
    fn learn(&self) -> Vec<Option<PerMicrobatch>> {
        let microbatches = self.microbatches;
        self.passes
            .iter()
            .zip(&self.notices)
            .map(|(&hooks, &notices)| {
                let even = hooks % microbatches == 0 && notices % microbatches == 0;
                (even && hooks + notices > 0).then_some(PerMicrobatch {
                    hooks: hooks / microbatches,
                    notices: notices / microbatches,
                })
            })
            .collect()
    }
}

/// `--overlap-grad-reduce`: hooks on every parameter, and the layers that accumulate straight
/// into the buffer, count the step's gradients and launch a bucket's reduction once the last
/// pass has produced all of its gradients. The first step learns how many to expect and reduces
/// after its backward.
pub(crate) struct OverlappedGradSync {
    state: Arc<Mutex<OverlapState>>,
}

impl OverlappedGradSync {
    /// Installs the hooks on `params` (in the layout's slot order).
    pub fn install(
        reducer: BucketReducer,
        layout: &BufferLayout,
        params: &[Tensor],
        device: Device,
    ) -> Result<Self> {
        let slots: Vec<SlotTarget> = layout
            .slots
            .iter()
            .map(|s| SlotTarget {
                range: s.range.clone(),
                shape: s.shape.clone(),
                bucket: s.bucket,
            })
            .collect();
        let mut pending = vec![0; layout.buckets.len()];
        slots.iter().for_each(|s| pending[s.bucket] += 1);
        let side = match device {
            Device::Cuda(index) => Some(CudaStream::from_pool(index)?),
            _ => None,
        };
        let state = Arc::new(Mutex::new(OverlapState {
            reducer,
            passes: vec![0; slots.len()],
            notices: vec![0; slots.len()],
            per_microbatch: None,
            launched: vec![false; pending.len()],
            pending,
            slots,
            microbatches: 1,
            side,
            error: None,
        }));
        for (slot, param) in params.iter().enumerate() {
            let state = state.clone();
            set_post_accumulate_grad_hook(param, move |parameter| {
                let mut state = state.lock().unwrap();
                if state.error.is_none() {
                    if let Err(e) = state.gradient_ready(slot, parameter) {
                        state.error = Some(format!("{e:#}"));
                    }
                }
            })?;
        }
        Ok(OverlappedGradSync { state })
    }

    /// What a layer that adds `slot`'s gradient straight into the buffer calls after each
    /// addition (see `MainGradSlot::set_notifying`).
    pub fn notifier(&self, slot: usize) -> Arc<dyn Fn() + Send + Sync> {
        let state = self.state.clone();
        Arc::new(move || {
            let mut state = state.lock().unwrap();
            if state.error.is_none() {
                if let Err(e) = state.accumulated(slot) {
                    state.error = Some(format!("{e:#}"));
                }
            }
        })
    }

    /// Starts a step of `microbatches` backward passes.
    pub fn begin_step(&self, microbatches: usize) {
        self.state.lock().unwrap().microbatches = microbatches.max(1);
    }

    /// Whether each slot's gradient was moved into the buffer by its hook this step: its
    /// bucket may be being reduced on the side stream, so nothing else may touch its range.
    pub fn moved(&self) -> Vec<bool> {
        let state = self.state.lock().unwrap();
        state
            .passes
            .iter()
            .map(|&p| p == state.microbatches)
            .collect()
    }

    /// Reduces the buckets no hook completed (parameters without a gradient this step), makes
    /// the current stream wait for the reductions, and resets the counters.
    pub fn finish(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        if let Some(error) = state.error.take() {
            return Err(anyhow!("overlapped gradient reduction failed: {error}"));
        }
        for bucket in 0..state.launched.len() {
            if !state.launched[bucket] {
                state.launch(bucket)?;
            }
        }
        if let Some(side) = state.side {
            CudaStream::current(side.device)?.wait_for(&side)?;
        }
        if state.per_microbatch.is_none() {
            state.per_microbatch = Some(state.learn());
        }
        let OverlapState {
            passes,
            notices,
            pending,
            launched,
            slots,
            ..
        } = &mut *state;
        passes.iter_mut().for_each(|p| *p = 0);
        notices.iter_mut().for_each(|n| *n = 0);
        launched.iter_mut().for_each(|l| *l = false);
        pending.iter_mut().for_each(|p| *p = 0);
        slots.iter().for_each(|s| pending[s.bucket] += 1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use anyhow::bail;

    use super::*;
    use crate::buffer::ParamShape;
    use megatron_models::ParamAttributes;
    use megatron_parallel::P2pOp;

    /// Rank 0 of two that counts its all-reduces (the non-distributed optimizer's reduction).
    #[derive(Default)]
    struct CountingRank {
        all_reduces: AtomicUsize,
    }

    impl Communicator for CountingRank {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn all_reduce(&self, _tensor: &Tensor, _op: ReduceOp) -> Result<()> {
            self.all_reduces.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn all_gather(&self, _tensor: &Tensor, _dim: i64) -> Result<Tensor> {
            bail!("not used")
        }
        fn reduce_scatter(&self, _tensor: &Tensor, _dim: i64) -> Result<Tensor> {
            bail!("not used")
        }
        fn broadcast(&self, _tensor: &Tensor, _root: usize) -> Result<()> {
            bail!("not used")
        }
        fn barrier(&self) -> Result<()> {
            bail!("not used")
        }
        fn exchange(&self, _ops: &[P2pOp]) -> Result<()> {
            bail!("not used")
        }
    }

    /// Two parameters in buckets of their own, both accumulated by their layers into the
    /// buffer (gradient-accumulation fusion); the second is tied, so it hears of two gradients
    /// per micro-batch. After the first step, which learns the counts, each bucket is reduced
    /// the moment its last gradient of the step's last micro-batch is in, not before.
    #[test]
    fn fused_accumulations_launch_each_bucket_at_its_last_gradient() {
        let shapes: Vec<ParamShape> = ["plain", "tied"]
            .into_iter()
            .map(|name| ParamShape {
                name,
                shape: vec![4],
                attributes: ParamAttributes::default(),
            })
            .collect();
        let layout = BufferLayout::new(&shapes, 1, 0, 2, false);
        assert_eq!(layout.buckets.len(), 2);
        let slot_of = |name: &str| layout.slots.iter().position(|s| s.name == name).unwrap();
        let (plain, tied) = (slot_of("plain"), slot_of("tied"));
        let params: Vec<Tensor> = (0..2)
            .map(|_| Tensor::zeros([4], (tch::Kind::Float, Device::Cpu)).set_requires_grad(true))
            .collect();
        let rank = Arc::new(CountingRank::default());
        let reducer = BucketReducer {
            data: rank.clone(),
            expert_data: rank.clone(),
            sharded: false,
            grad_buffer: Tensor::zeros([layout.len as i64], (tch::Kind::Float, Device::Cpu)),
            buckets: layout.buckets.clone(),
        };
        let sync = OverlappedGradSync::install(reducer, &layout, &params, Device::Cpu).unwrap();
        let (plain_done, tied_done) = (sync.notifier(plain), sync.notifier(tied));
        let reductions = || rank.all_reduces.load(Ordering::SeqCst);

        // The first step learns: nothing is reduced before it finishes.
        sync.begin_step(2);
        for _ in 0..2 {
            plain_done();
            tied_done();
            tied_done();
        }
        assert_eq!(reductions(), 0);
        sync.finish().unwrap();
        assert_eq!(reductions(), 2);

        sync.begin_step(2);
        plain_done();
        tied_done();
        tied_done();
        assert_eq!(reductions(), 2, "the first micro-batch launches nothing");
        tied_done();
        assert_eq!(
            reductions(),
            2,
            "the tied weight has one more gradient to come"
        );
        plain_done();
        assert_eq!(reductions(), 3, "the plain bucket is complete");
        tied_done();
        assert_eq!(reductions(), 4, "the tied bucket is complete");
        sync.finish().unwrap();
        assert_eq!(reductions(), 4, "nothing is reduced twice");
    }
}
