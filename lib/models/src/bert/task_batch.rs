//! Finetuning examples (`eval_tasks --task RACE|MNLI|QQP`) as batches: an example is one encoded
//! input per choice (one for classification, four for RACE) and a label. Training reads them in
//! a fresh permutation every epoch (Megatron's `DistributedSampler` with `set_epoch`), the
//! validation loss cycles through them, and accuracy reads each set once in file order.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context, Result};
use megatron_data::tasks::PairInput;
use tch::Tensor;

use crate::loader::{DeviceBatch, SampleSource, SplitMix};

/// One finetuning example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskExample {
    pub choices: Vec<PairInput>,
    pub label: i64,
}

pub struct TaskBatch {
    /// `[b·choices, s]` int64: the examples' choices one after the other.
    pub tokens: Tensor,
    pub types: Tensor,
    /// `[b·choices, s]` int64, 1 for tokens and 0 for padding.
    pub padding_mask: Tensor,
    /// `[b]` int64.
    pub labels: Tensor,
}

impl TaskBatch {
    pub fn collate<'a>(examples: impl IntoIterator<Item = &'a TaskExample>) -> Result<TaskBatch> {
        let examples: Vec<&TaskExample> = examples.into_iter().collect();
        let first = examples
            .first()
            .context("an empty batch of task examples")?;
        let (choices, s) = (first.choices.len(), first.choices[0].text.len());
        ensure!(
            examples
                .iter()
                .all(|e| e.choices.len() == choices && e.choices.iter().all(|c| c.text.len() == s)),
            "task examples of different shapes in one batch"
        );
        let rows = (examples.len() * choices) as i64;
        let stack = |get: fn(&PairInput) -> &Vec<i64>| {
            let flat: Vec<i64> = examples
                .iter()
                .flat_map(|e| e.choices.iter().flat_map(|c| get(c).iter().copied()))
                .collect();
            Tensor::from_slice(&flat).view([rows, s as i64])
        };
        let labels: Vec<i64> = examples.iter().map(|e| e.label).collect();
        Ok(TaskBatch {
            tokens: stack(|c| &c.text),
            types: stack(|c| &c.types),
            padding_mask: stack(|c| &c.padding_mask),
            labels: Tensor::from_slice(&labels),
        })
    }
}

impl DeviceBatch for TaskBatch {
    fn map_tensors(&self, f: &mut dyn FnMut(&Tensor) -> Tensor) -> TaskBatch {
        TaskBatch {
            tokens: f(&self.tokens),
            types: f(&self.types),
            padding_mask: f(&self.padding_mask),
            labels: f(&self.labels),
        }
    }

    fn tensors(&self) -> Vec<&Tensor> {
        vec![&self.tokens, &self.types, &self.padding_mask, &self.labels]
    }
}

/// A set read once, in order (accuracy).
pub struct TaskExamples(pub Arc<Vec<TaskExample>>);

impl SampleSource for TaskExamples {
    type Batch = TaskBatch;

    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn collate(&self, indices: Range<u64>) -> Result<TaskBatch> {
        TaskBatch::collate(indices.map(|i| &self.0[i as usize]))
    }
}

/// A set read round and round, `len` samples in all (the validation loss every
/// `--eval-interval`).
pub struct CycledExamples {
    pub examples: Arc<Vec<TaskExample>>,
    pub len: u64,
}

impl SampleSource for CycledExamples {
    type Batch = TaskBatch;

    fn len(&self) -> u64 {
        self.len
    }

    fn collate(&self, indices: Range<u64>) -> Result<TaskBatch> {
        let n = self.examples.len() as u64;
        TaskBatch::collate(indices.map(|i| &self.examples[(i % n) as usize]))
    }
}

/// The training order: `epochs` passes of `per_epoch` samples, each pass a permutation of the
/// examples drawn from `seed + epoch`. A pass longer than the set (`--keep-last`: the last batch
/// completed) repeats the start of its permutation, as `DistributedSampler` pads by repetition.
pub struct EpochOrder {
    pub examples: Arc<Vec<TaskExample>>,
    pub per_epoch: u64,
    pub epochs: u64,
    pub seed: u64,
    /// The permutation of the epoch read last.
    current: Mutex<Option<(u64, Arc<Vec<u32>>)>>,
}

impl EpochOrder {
    pub fn new(examples: Arc<Vec<TaskExample>>, per_epoch: u64, epochs: u64, seed: u64) -> Self {
        EpochOrder {
            examples,
            per_epoch,
            epochs,
            seed,
            current: Mutex::new(None),
        }
    }

    /// The order of the examples in `epoch`.
    pub fn permutation(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut current = self.current.lock().expect("epoch order lock");
        if let Some((cached, order)) = current.as_ref() {
            if *cached == epoch {
                return order.clone();
            }
        }
        let mut order: Vec<u32> = (0..self.examples.len() as u32).collect();
        let mut rng = SplitMix(
            self.seed
                .wrapping_add(epoch)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15),
        );
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let order = Arc::new(order);
        *current = Some((epoch, order.clone()));
        order
    }
}

impl SampleSource for EpochOrder {
    type Batch = TaskBatch;

    fn len(&self) -> u64 {
        self.per_epoch * self.epochs
    }

    fn collate(&self, indices: Range<u64>) -> Result<TaskBatch> {
        let n = self.examples.len() as u64;
        let mut picked = Vec::with_capacity((indices.end - indices.start) as usize);
        for i in indices {
            let order = self.permutation(i / self.per_epoch);
            picked.push(&self.examples[order[((i % self.per_epoch) % n) as usize] as usize]);
        }
        TaskBatch::collate(picked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(label: i64) -> TaskExample {
        TaskExample {
            choices: vec![PairInput {
                text: vec![label, 1],
                types: vec![0, 0],
                padding_mask: vec![1, 1],
            }],
            label,
        }
    }

    #[test]
    fn every_epoch_is_a_fresh_permutation_of_the_whole_set() {
        let examples = Arc::new((0..10).map(example).collect::<Vec<_>>());
        let order = EpochOrder::new(examples, 10, 3, 1234);
        let epoch = |e: u64| -> Vec<i64> {
            let batch = order.collate(e * 10..(e + 1) * 10).unwrap();
            Vec::<i64>::try_from(&batch.labels).unwrap()
        };
        let (first, second) = (epoch(0), epoch(1));
        for labels in [&first, &second] {
            let mut sorted = labels.clone();
            sorted.sort();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(first, second);
        assert_eq!(first, epoch(0), "an epoch's order depends only on the seed");
    }

    #[test]
    fn a_completed_last_batch_repeats_the_start_of_the_epoch() {
        let examples = Arc::new((0..5).map(example).collect::<Vec<_>>());
        let order = EpochOrder::new(examples, 6, 1, 7);
        let labels = Vec::<i64>::try_from(&order.collate(0..6).unwrap().labels).unwrap();
        assert_eq!(labels[5], labels[0]);
    }

    #[test]
    fn choices_become_consecutive_rows() {
        let mut e = example(3);
        e.choices.push(e.choices[0].clone());
        let batch = TaskBatch::collate([&e, &e]).unwrap();
        assert_eq!(batch.tokens.size(), [4, 2]);
        assert_eq!(batch.labels.size(), [2]);
    }
}
