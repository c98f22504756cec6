//! The distributed optimizer's all-gather of the updated parameters, bucket by bucket. Without a
//! side stream it runs in place after the step. With `--overlap-param-gather` it runs on a side
//! stream, in the order the next forward pass uses the buckets (they lie in reverse model order,
//! so the last bucket goes first), and the forward pass waits for a bucket just before the first
//! module whose parameters it holds, so the gathers overlap with the compute of the modules
//! before (Megatron's forward pre-hooks).

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{Context, Result};
use tch::Tensor;

use super::buffer::BufferLayout;
use megatron_kernels::runtime::{CudaEvent, CudaStream};
use megatron_models::ParamGate;
use megatron_parallel::Communicator;

pub struct ParamGather {
    data: Arc<dyn Communicator>,
    /// The experts' buckets' group.
    expert_data: Arc<dyn Communicator>,
    layout: BufferLayout,
    /// The stream of overlapped gathers; none gathers in place.
    side: Option<CudaStream>,
    state: Mutex<State>,
}

struct State {
    param_buffer: Tensor,
    /// Per bucket, the end of its overlapped gather while no forward pass has waited for it.
    pending: Vec<Option<CudaEvent>>,
}

impl ParamGather {
    pub fn new(
        data: Arc<dyn Communicator>,
        expert_data: Arc<dyn Communicator>,
        param_buffer: Tensor,
        layout: BufferLayout,
        side: Option<CudaStream>,
    ) -> Self {
        let pending = layout.buckets.iter().map(|_| None).collect();
        ParamGather {
            data,
            expert_data,
            layout,
            side,
            state: Mutex::new(State {
                param_buffer,
                pending,
            }),
        }
    }

    /// Whether the gathers run on a side stream, overlapped with the next forward pass.
    pub fn overlapped(&self) -> bool {
        self.side.is_some()
    }

    /// Gathers every rank's shard of every bucket into the parameter buffer, after the work
    /// enqueued so far (the step that wrote this rank's shard).
    pub fn launch(&self) -> Result<()> {
        self.wait_all()?;
        let mut state = self.lock();
        let buckets = (0..self.layout.buckets.len()).rev();
        let Some(side) = self.side else {
            return buckets
                .into_iter()
                .try_for_each(|bucket| self.gather(&state.param_buffer, bucket));
        };
        side.wait_for(&CudaStream::current(side.device)?)?;
        for bucket in buckets {
            side.run(|| self.gather(&state.param_buffer, bucket))??;
            state.pending[bucket] = Some(CudaEvent::record(&side)?);
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gather(&self, param_buffer: &Tensor, bucket: usize) -> Result<()> {
        let bucket = &self.layout.buckets[bucket];
        let view = |range: &std::ops::Range<usize>| {
            param_buffer.narrow(0, range.start as i64, range.len() as i64)
        };
        let group = if bucket.expert {
            &self.expert_data
        } else {
            &self.data
        };
        let gathered = group
            .all_gather(&view(&bucket.shard), 0)
            .context("all-gather of parameters")?;
        tch::no_grad(|| view(&bucket.range).copy_(&gathered));
        Ok(())
    }

    /// Makes the current stream wait for every gather still pending (before anything other than
    /// the forward pass reads the parameters: checkpoints, the next step).
    pub fn wait_all(&self) -> Result<()> {
        let Some(side) = self.side else {
            return Ok(());
        };
        let current = CudaStream::current(side.device)?;
        for event in self.lock().pending.iter_mut().filter_map(Option::take) {
            event.block(&current)?;
        }
        Ok(())
    }

    /// The gate of one model chunk, whose parameter names carry `prefix` in the optimizer
    /// (`model1.` for the second virtual pipeline stage, empty otherwise).
    pub fn gate(self: &Arc<Self>, prefix: String) -> Arc<dyn ParamGate> {
        Arc::new(ChunkGate {
            gather: self.clone(),
            prefix,
        })
    }
}

struct ChunkGate {
    gather: Arc<ParamGather>,
    prefix: String,
}

impl ParamGate for ChunkGate {
    fn before(&self, module: &str) -> Result<()> {
        let gather = &self.gather;
        let Some(side) = gather.side else {
            return Ok(());
        };
        let mut state = gather.lock();
        if state.pending.iter().all(Option::is_none) {
            return Ok(());
        }
        let scope = format!("{}{module}.", self.prefix);
        let current = CudaStream::current(side.device)?;
        for slot in gather
            .layout
            .slots
            .iter()
            .filter(|s| s.name.starts_with(&scope))
        {
            if let Some(event) = state.pending[slot.bucket].take() {
                event.block(&current)?;
            }
        }
        Ok(())
    }
}
