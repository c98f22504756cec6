//! `--overlap-param-gather`: the distributed optimizer's all-gathers of the updated parameters,
//! launched bucket by bucket on a side stream after the step, in the order the next forward pass
//! uses them (buckets lie in reverse model order, so the last bucket goes first). The forward
//! pass waits for a bucket just before the first module whose parameters it holds, so the
//! gathers overlap with the forward compute of the modules before (Megatron's forward pre-hooks).
//! On the CPU there is no side stream and the gathers run in place.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use super::buffer::BufferLayout;
use crate::model::ParamGate;
use crate::parallel::Communicator;
use crate::runtime::{CudaEvent, CudaStream};

/// The launched gathers and what the forward pass must wait for.
pub struct ParamGather {
    data: Arc<dyn Communicator>,
    layout: BufferLayout,
    side: Option<CudaStream>,
    state: Mutex<State>,
}

struct State {
    param_buffer: Tensor,
    /// Per bucket, the end of its gather while no forward pass has waited for it yet.
    pending: Vec<Option<CudaEvent>>,
}

impl ParamGather {
    pub fn new(
        data: Arc<dyn Communicator>,
        param_buffer: Tensor,
        layout: BufferLayout,
        device: Device,
    ) -> Result<Self> {
        let side = match device {
            Device::Cuda(index) => Some(CudaStream::from_pool(index)?),
            _ => None,
        };
        let pending = layout.buckets.iter().map(|_| None).collect();
        Ok(ParamGather {
            data,
            layout,
            side,
            state: Mutex::new(State {
                param_buffer,
                pending,
            }),
        })
    }

    /// Gathers every rank's shard of every bucket into the parameter buffer: on the side stream
    /// after the work enqueued so far (the step that wrote this rank's shard), last bucket first.
    pub fn launch(&self) -> Result<()> {
        self.wait_all()?;
        let mut state = self.lock();
        let Some(side) = self.side else {
            return (0..self.layout.buckets.len())
                .rev()
                .try_for_each(|bucket| self.gather(&state.param_buffer, bucket));
        };
        side.wait_for(&CudaStream::current(side.device)?)?;
        for bucket in (0..self.layout.buckets.len()).rev() {
            side.run(|| self.gather(&state.param_buffer, bucket))??;
            state.pending[bucket] = Some(CudaEvent::record(&side)?);
        }
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn gather(&self, param_buffer: &Tensor, bucket: usize) -> Result<()> {
        let bucket = &self.layout.buckets[bucket];
        let view = |range: &std::ops::Range<usize>| {
            param_buffer.narrow(0, range.start as i64, range.len() as i64)
        };
        let gathered = self
            .data
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
        let pending = &mut state.pending;
        if pending.iter().all(Option::is_none) {
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
            let bucket = gather
                .layout
                .buckets
                .iter()
                .position(|b| b.range.contains(&slot.range.start))
                .expect("slots lie in buckets");
            if let Some(event) = pending[bucket].take() {
                event.block(&current)?;
            }
        }
        Ok(())
    }
}
