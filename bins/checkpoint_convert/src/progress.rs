//! The conversion's progress bar over its tensor bytes, drawn once the total is known: the
//! GPT path knows it from the loaded checkpoint, a T5 reshape only after reading its files.

use std::cell::OnceCell;
use std::rc::Rc;

use megatron_cli::ProgressBar;
use megatron_convert::ConversionProgress;

pub struct TensorBytesBar {
    /// What is being done, shown beside the bar.
    doing: String,
    bar: OnceCell<ProgressBar>,
}

impl TensorBytesBar {
    pub fn new(doing: String) -> Rc<Self> {
        Rc::new(TensorBytesBar {
            doing,
            bar: OnceCell::new(),
        })
    }

    /// Clears the bar: the summary line takes its place.
    pub fn finish(&self) {
        if let Some(bar) = self.bar.get() {
            bar.finish_and_clear();
        }
    }
}

impl ConversionProgress for TensorBytesBar {
    fn total(&self, bytes: u64) {
        let bar = self
            .bar
            .get_or_init(|| megatron_cli::byte_progress_bar(bytes));
        bar.set_length(bytes);
        bar.set_message(self.doing.clone());
    }

    fn written(&self, bytes: u64) {
        if let Some(bar) = self.bar.get() {
            bar.inc(bytes);
        }
    }
}
