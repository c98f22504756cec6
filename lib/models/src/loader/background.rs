//! A thread that reads samples ahead of training.

use std::ops::Range;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};
use tch::{Device, Tensor};

/// A split of a model family's dataset: samples by index, collated into host batches.
pub trait SampleSource: Send + Sync {
    type Batch: Send + 'static;
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The samples `indices` as one batch.
    fn collate(&self, indices: Range<u64>) -> Result<Self::Batch>;
}

/// A batch of tensors that can move to the training device.
pub trait DeviceBatch: Send + 'static {
    /// The same batch with every tensor replaced by `f` of it.
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> Self;
    /// Every tensor of the batch, in a fixed order (absent optional ones left out).
    fn tensors(&self) -> Vec<&Tensor>;

    /// The batch on `device`. Host tensors bound for a GPU go through pinned memory: a copy from
    /// pageable memory would first wait for everything queued on the stream (the previous
    /// step's optimizer), so the host could not queue the next step meanwhile.
    fn to_device(&self, device: Device) -> Self
    where
        Self: Sized,
    {
        self.map_tensors(&mut |t| {
            let source = match (device, t.device()) {
                // Without pinned memory (none left) the copy is only slower.
                (Device::Cuda(_), Device::Cpu) => {
                    megatron_kernels::runtime::pinned(t).unwrap_or_else(|_| t.shallow_clone())
                }
                _ => t.shallow_clone(),
            };
            source.to_device_(device, t.kind(), true, false)
        })
    }
}

/// A family's train, validation and test splits; a split is absent when empty.
pub struct Splits<B> {
    pub train: Option<Arc<dyn SampleSource<Batch = B>>>,
    pub valid: Option<Arc<dyn SampleSource<Batch = B>>>,
    pub test: Option<Arc<dyn SampleSource<Batch = B>>>,
}

/// Yields the micro-batches of one split in Megatron's order, prepared on a background thread.
pub struct BatchLoader<B> {
    receiver: Receiver<Result<B>>,
    worker: Option<JoinHandle<()>>,
}

/// Which samples a rank reads: global batches of `micro_batch_size · data_parallel_size`
/// consecutive samples from `start`, of which rank r takes the r-th micro-batch.
#[derive(Debug, Clone, Copy)]
pub struct SamplerPosition {
    pub start: u64,
    pub micro_batch_size: u64,
    pub data_parallel_rank: u64,
    pub data_parallel_size: u64,
}

impl<B: Send + 'static> BatchLoader<B> {
    /// `prefetch` micro-batches are kept ready. Reading past the end of the dataset is an
    /// error naming the split (the datasets are sized for the whole run, as in Megatron).
    pub fn spawn(
        dataset: Arc<dyn SampleSource<Batch = B>>,
        split_name: &'static str,
        position: SamplerPosition,
        prefetch: usize,
    ) -> Self {
        let (sender, receiver) = sync_channel(prefetch.max(1));
        let worker = std::thread::Builder::new()
            .name(format!("{split_name}-loader"))
            .spawn(move || {
                let mut next = position.start;
                let global = position.micro_batch_size * position.data_parallel_size;
                loop {
                    let first = next + position.data_parallel_rank * position.micro_batch_size;
                    let end = first + position.micro_batch_size;
                    let batch = if end > dataset.len() {
                        Err(anyhow!(
                            "the {split_name} dataset has {} samples; sample {} was requested",
                            dataset.len(),
                            end - 1
                        ))
                    } else {
                        dataset.collate(first..end)
                    };
                    let failed = batch.is_err();
                    if sender.send(batch).is_err() || failed {
                        return;
                    }
                    next += global;
                }
            })
            .expect("spawning the data loader thread");
        BatchLoader {
            receiver,
            worker: Some(worker),
        }
    }

    pub fn next_batch(&mut self) -> Result<B> {
        self.receiver
            .recv()
            .map_err(|_| anyhow!("the data loader stopped"))?
    }
}

impl<B> Drop for BatchLoader<B> {
    fn drop(&mut self) {
        // Unblock the worker (its send fails once the receiver is gone), then join it.
        let (_, receiver) = sync_channel(1);
        drop(std::mem::replace(&mut self.receiver, receiver));
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
