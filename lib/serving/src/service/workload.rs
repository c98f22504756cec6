//! What the scheduler shows of its work while it runs.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use megatron_inference::CacheUse;

/// What the scheduler is doing, as of its last step: the KV cache's use and the requests it
/// serves, for `/metrics` and [`super::TextGenerationService::cache_use`].
#[derive(Default)]
pub(crate) struct Workload {
    pub(super) cache: Mutex<CacheUse>,
    /// Requests taken from the queue and not yet answered.
    pub(super) serving: AtomicUsize,
}

impl Workload {
    pub fn cache_use(&self) -> CacheUse {
        *self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn serving(&self) -> usize {
        self.serving.load(Ordering::SeqCst)
    }
}
