//! Data-parallel gradient reduction, bucket by bucket: after backward, or with
//! `--overlap-grad-reduce` from inside backward, as soon as the last micro-batch has produced
//! every gradient of a bucket (Megatron's DDP hooks). On GPUs the overlapped reductions run on
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
/// distributed optimizer reduce-scattered into each rank's shard.
pub(crate) struct BucketReducer {
    pub data: Arc<dyn Communicator>,
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
        if self.sharded {
            let reduced = self
                .data
                .reduce_scatter(&view, 0)
                .context("reduce-scatter of gradients")?;
            self.view(&bucket.shard).copy_(&reduced);
        } else {
            self.data
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

struct OverlapState {
    reducer: BucketReducer,
    slots: Vec<SlotTarget>,
    /// Backward passes that reached each slot in this step.
    passes: Vec<usize>,
    /// Slots of each bucket still waiting for their last pass.
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
}

/// `--overlap-grad-reduce`: hooks on every parameter count the step's backward passes and
/// launch a bucket's reduction once the last pass has produced all of its gradients.
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
        let OverlapState {
            passes,
            pending,
            launched,
            slots,
            ..
        } = &mut *state;
        passes.iter_mut().for_each(|p| *p = 0);
        launched.iter_mut().for_each(|l| *l = false);
        pending.iter_mut().for_each(|p| *p = 0);
        slots.iter().for_each(|s| pending[s.bucket] += 1);
        Ok(())
    }
}
