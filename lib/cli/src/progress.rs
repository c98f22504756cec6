//! The progress bars long work draws on stderr, in one style for every binary: elapsed time, the
//! bar, the percentage done, position and total, the rate and the time left. indicatif hides them
//! when stderr is not a terminal (a log file, a pipe), so batch jobs keep clean logs.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

const TICK: Duration = Duration::from_millis(200);

/// A bar over `total` units of work, counted by `counts`: indicatif placeholders for the
/// position, the total and the rate, e.g. `{human_pos}/{human_len} docs ({per_sec}`.
fn bar(total: u64, counts: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} [{{wide_bar}}] {{percent:>3}}% {counts}, ETA {{eta}}) {{msg}}"
        ))
        .expect("static template is valid")
        .progress_chars("=> "),
    );
    bar.enable_steady_tick(TICK);
    bar
}

/// A progress bar over `total` units of work (`unit` names them, e.g. "docs").
pub fn progress_bar(total: u64, unit: &str) -> ProgressBar {
    bar(
        total,
        &format!("{{human_pos}}/{{human_len}} {unit} ({{per_sec}}"),
    )
}

/// A progress bar over `total` bytes (of input read, of tensors written), shown in KiB, MiB, GiB.
pub fn byte_progress_bar(total: u64) -> ProgressBar {
    bar(
        total,
        "{binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}",
    )
}

/// A spinner for work of unknown size (a stream from stdin, say), counting `unit`s with their rate.
pub fn spinner(unit: &str) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{{spinner}} {{elapsed_precise}} {{human_pos}} {unit} ({{per_sec}}) {{msg}}"
        ))
        .expect("static template is valid"),
    );
    bar.enable_steady_tick(TICK);
    bar
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::{ProgressDrawTarget, TermLike};
    use std::io;
    use std::sync::{Arc, Mutex};

    /// A terminal that keeps the last line drawn.
    #[derive(Debug, Clone, Default)]
    struct Screen(Arc<Mutex<String>>);

    impl Screen {
        fn line(&self) -> String {
            self.0.lock().unwrap().clone()
        }
    }

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> io::Result<()> {
            if !s.trim().is_empty() {
                *self.0.lock().unwrap() = s.to_string();
            }
            Ok(())
        }
        fn clear_line(&self) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    /// What `bar` shows once stopped where it is (`abandon` draws whatever the rate limit).
    fn drawn(bar: ProgressBar) -> String {
        let screen = Screen::default();
        bar.set_draw_target(ProgressDrawTarget::term_like(Box::new(screen.clone())));
        bar.abandon();
        screen.line()
    }

    #[test]
    fn bars_show_percentage_total_and_eta() {
        let docs = progress_bar(10, "docs");
        docs.inc(4);
        assert_eq!((docs.position(), docs.length()), (4, Some(10)));
        let line = drawn(docs);
        assert!(line.contains(" 40% 4/10 docs ("), "{line}");
        assert!(line.contains(", ETA "), "{line}");

        let bytes = byte_progress_bar(4 << 20);
        bytes.set_position(1 << 20);
        let line = drawn(bytes);
        assert!(line.contains(" 25% 1.00 MiB/4.00 MiB ("), "{line}");
        assert!(line.contains(", ETA "), "{line}");
    }

    #[test]
    fn spinners_count_without_a_total() {
        let spin = spinner("docs");
        spin.inc(3);
        assert_eq!((spin.position(), spin.length()), (3, None));
    }
}
