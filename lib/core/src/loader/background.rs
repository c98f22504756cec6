//! A thread that reads samples ahead of training.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{anyhow, Result};
use megatron_data::blend::SplitDataset;

use super::gpt_batch::GptBatch;

/// Yields the micro-batches of one split in Megatron's order, prepared on a background thread.
pub struct BatchLoader {
    receiver: Receiver<Result<GptBatch>>,
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

impl BatchLoader {
    /// `prefetch` micro-batches are kept ready. Reading past the end of the dataset is an
    /// error naming the split (the datasets are sized for the whole run, as in Megatron).
    pub fn spawn(
        dataset: Arc<SplitDataset>,
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
                    let batch = if end > dataset.len() as u64 {
                        Err(anyhow!(
                            "the {split_name} dataset has {} samples; sample {} was requested",
                            dataset.len(),
                            end - 1
                        ))
                    } else {
                        let samples: Vec<_> =
                            (first..end).map(|i| dataset.get(i as usize).1).collect();
                        Ok(GptBatch::collate(&samples))
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

    pub fn next_batch(&mut self) -> Result<GptBatch> {
        self.receiver
            .recv()
            .map_err(|_| anyhow!("the data loader stopped"))?
    }
}

impl Drop for BatchLoader {
    fn drop(&mut self) {
        // Unblock the worker (its send fails once the receiver is gone), then join it.
        let (_, receiver) = sync_channel(1);
        drop(std::mem::replace(&mut self.receiver, receiver));
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
