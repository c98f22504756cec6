//! Which checkpoint to trust after a NaN. Training usually diverges over a few iterations
//! before the loss turns NaN, and a checkpoint saved in between holds weights that are already
//! ruined. Like Megatron's `--check-for-spiky-loss`, a loss is out of its recent range when it
//! is not finite or exceeds [`SPIKE_FACTOR`] times the largest of the last [`WINDOW`] losses.
//! The weights saved at iteration `k` are first measured by the loss of iteration `k + 1`, so a
//! checkpoint is trusted only if that loss, and every one before it, was in range.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};

/// Losses the range is taken over.
pub const WINDOW: usize = 10;
/// How far above the recent maximum a loss may go before it counts as a spike.
pub const SPIKE_FACTOR: f64 = 10.0;

/// Where the loss first left its range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spike {
    pub iteration: u64,
    pub loss: f64,
    /// The largest loss of the window before it (`None`: it was the first loss).
    pub recent_max: Option<f64>,
}

#[derive(Debug, Default)]
pub struct LossSpikeTracker {
    recent: VecDeque<f64>,
    spike: Option<Spike>,
    /// The newest checkpoint whose weights produced an in-range loss.
    trusted: Option<PathBuf>,
    /// Saved, but its weights not yet measured by a loss: `(iteration, directory)`.
    pending: Option<(u64, PathBuf)>,
}

impl LossSpikeTracker {
    /// The loss of `iteration` (computed with the weights after iteration `iteration - 1`).
    pub fn record_loss(&mut self, iteration: u64, loss: f64) {
        if self.spike.is_some() {
            return;
        }
        let recent_max = self.recent.iter().copied().reduce(f64::max);
        let spiking = !loss.is_finite() || recent_max.is_some_and(|m| loss > SPIKE_FACTOR * m);
        if spiking {
            self.spike = Some(Spike {
                iteration,
                loss,
                recent_max,
            });
            self.pending = None;
            return;
        }
        if let Some((saved, directory)) = self.pending.take() {
            if saved < iteration {
                self.trusted = Some(directory);
            } else {
                self.pending = Some((saved, directory));
            }
        }
        self.recent.push_back(loss);
        if self.recent.len() > WINDOW {
            self.recent.pop_front();
        }
    }

    /// A checkpoint of the weights after `iteration` was saved to `directory`.
    pub fn record_save(&mut self, iteration: u64, directory: &Path) {
        if self.spike.is_none() {
            self.pending = Some((iteration, directory.to_path_buf()));
        }
    }

    /// A checkpoint the run started from (`--load`): trusted, its weights were trained on.
    pub fn record_loaded(&mut self, directory: &Path) {
        self.trusted = Some(directory.to_path_buf());
    }

    /// What to tell the user after a NaN: the checkpoint to resume from and why.
    pub fn advice(&self) -> String {
        let Some(spike) = self.spike else {
            return match &self.trusted {
                Some(dir) => format!("the last good checkpoint is {}", dir.display()),
                None => "no checkpoint was saved before it".to_string(),
            };
        };
        let left = match spike.recent_max {
            Some(max) => format!(
                "the loss left its recent range at iteration {} ({} after at most {max} over the \
                 previous {WINDOW} iterations)",
                spike.iteration, spike.loss
            ),
            None => format!(
                "the loss was {} at iteration {}",
                spike.loss, spike.iteration
            ),
        };
        match &self.trusted {
            Some(dir) => format!(
                "{left}; the last checkpoint saved before that is {}, resume from it; later \
                 checkpoints hold weights that had already diverged",
                dir.display()
            ),
            None => format!(
                "{left}; no checkpoint was saved before that, so every checkpoint of this run \
                 holds weights that had already diverged"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_the_last_checkpoint_whose_weights_gave_an_in_range_loss() {
        let mut tracker = LossSpikeTracker::default();
        let dir = |i: u64| PathBuf::from(format!("ckpt/iter_{i:07}"));
        for (iteration, loss) in [(1, 8.3), (2, 7.9), (3, 7.5), (4, 7.6)] {
            tracker.record_loss(iteration, loss);
            tracker.record_save(iteration, &dir(iteration));
        }
        // Iteration 5's loss measures checkpoint 4's weights: a spike, so 4 is not trusted.
        tracker.record_loss(5, 2000.0);
        tracker.record_save(5, &dir(5));
        tracker.record_loss(6, f64::NAN);
        let advice = tracker.advice();
        assert!(
            advice.contains("left its recent range at iteration 5 (2000 after at most 8.3")
                && advice.contains("ckpt/iter_0000003, resume from it"),
            "{advice}"
        );
    }

    #[test]
    fn a_first_step_that_diverges_leaves_no_good_checkpoint() {
        let mut tracker = LossSpikeTracker::default();
        tracker.record_loss(1, 8.3);
        tracker.record_save(1, Path::new("ckpt/iter_0000001"));
        tracker.record_loss(2, 1e12);
        tracker.record_save(2, Path::new("ckpt/iter_0000002"));
        let advice = tracker.advice();
        assert!(
            advice.contains("no checkpoint was saved before that"),
            "{advice}"
        );
        let mut loaded = LossSpikeTracker::default();
        loaded.record_loaded(Path::new("old/iter_0000100"));
        loaded.record_loss(101, f64::NAN);
        assert!(loaded.advice().contains("old/iter_0000100, resume"));
    }
}
