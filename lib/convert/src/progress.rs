//! How far a conversion is, for `checkpoint_convert`'s progress bar: every saver streams its
//! tensors through [`LazyTensor::for_each_chunk`](crate::LazyTensor::for_each_chunk), which
//! reports each chunk here, so the savers need no progress parameter of their own.

use std::cell::RefCell;
use std::rc::Rc;

/// What a conversion reports as it goes.
pub trait ConversionProgress {
    /// The bytes of tensor data the conversion will write, once it knows them.
    fn total(&self, bytes: u64);
    /// Bytes of tensor data handed to a writer since the last report.
    fn written(&self, bytes: u64);
}

thread_local! {
    // Per thread: the savers produce their data on the thread that called them (only the
    // file writes run on threads of their own).
    static PROGRESS: RefCell<Option<Rc<dyn ConversionProgress>>> = const { RefCell::new(None) };
}

/// Puts back the reporter that was there before, however the conversion ends.
struct Restore(Option<Rc<dyn ConversionProgress>>);

impl Drop for Restore {
    fn drop(&mut self) {
        PROGRESS.set(self.0.take());
    }
}

/// Runs `convert` with its progress on this thread reported to `progress`.
pub fn reporting_progress<R>(
    progress: Rc<dyn ConversionProgress>,
    convert: impl FnOnce() -> R,
) -> R {
    let _restore = Restore(PROGRESS.replace(Some(progress)));
    convert()
}

pub(crate) fn report_total(bytes: u64) {
    PROGRESS.with_borrow(|progress| {
        if let Some(progress) = progress {
            progress.total(bytes);
        }
    });
}

pub(crate) fn report_written(bytes: u64) {
    PROGRESS.with_borrow(|progress| {
        if let Some(progress) = progress {
            progress.written(bytes);
        }
    });
}
