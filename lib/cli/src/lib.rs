//! Conventions every megatron-rs binary follows, so that scripts can rely on them:
//!
//! * exit code 0 on success, 1 on a runtime error, 2 on a usage error (clap's own code for bad
//!   flags, which every binary parses with clap; checks of the flags made after parsing return a
//!   [`UsageError`] for the same code);
//! * a runtime error prints one `error: ...` line to stderr with its whole context chain, e.g.
//!   `error: reading corpus.jsonl: line 12: missing key "text"`;
//! * writing into a closed pipe (`| head`) ends the program quietly, like other Unix tools;
//! * long work draws an indicatif progress bar on stderr (only when stderr is a terminal) and ends
//!   with a one-line summary on stdout.

pub mod progress;
pub mod python_format;
pub mod ranges;
pub mod signals;
mod usage;

pub use indicatif::ProgressBar;
pub use progress::{byte_progress_bar, progress_bar, spinner};
pub use usage::{is_usage_error, usage_error, UsageError};

use std::process::ExitCode;

/// Exit code of a runtime error.
pub const EXIT_RUNTIME_ERROR: u8 = 1;
/// Exit code of a usage error: clap's own, so a bad command line exits alike whether clap or a
/// later check of the flags found it.
pub const EXIT_USAGE_ERROR: u8 = 2;

/// Runs a binary's body and turns its outcome into the exit code and message convention: a
/// [`UsageError`] anywhere in the error's chain exits 2 with clap's closing hint, anything else 1.
pub fn run(body: impl FnOnce() -> anyhow::Result<()>) -> ExitCode {
    restore_default_sigpipe();
    match body() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if is_usage_error(&error) => {
            eprintln!(
                "error: {}\n\nFor more information, try '--help'.",
                error_text(&error)
            );
            ExitCode::from(EXIT_USAGE_ERROR)
        }
        Err(error) => {
            eprintln!("error: {}", error_text(&error));
            ExitCode::from(EXIT_RUNTIME_ERROR)
        }
    }
}

/// An error and its causes joined by `: ` for people. A cause whose text its parent already
/// shows (an error type that prints its source and also returns it from `source()`) is not
/// repeated, so `a.bin: No such file or directory (os error 2)` is not followed by the same
/// reason again.
pub fn error_text(error: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut shown: Vec<String> = Vec::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if part.is_empty() || shown.iter().any(|s| s.contains(&part)) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
        shown.push(part);
    }
    text
}

/// Rust ignores SIGPIPE, which turns `tool | head` into a panic on the next print; the default
/// action ends the process quietly as shell pipelines expect.
fn restore_default_sigpipe() {
    // SAFETY: setting a signal disposition to its default has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_errors_exit_with_one() {
        assert_eq!(run(|| Ok(())), ExitCode::SUCCESS);
        assert_eq!(run(|| anyhow::bail!("disk full")), ExitCode::from(1));
        let io = std::io::Error::from_raw_os_error(2);
        assert_eq!(
            run(|| Err(anyhow::Error::new(io).context("opening ckpt"))),
            ExitCode::from(1)
        );
    }

    #[test]
    fn causes_are_not_repeated() {
        #[derive(Debug, thiserror::Error)]
        #[error("{path}: {source}")]
        struct Opening {
            path: String,
            source: std::io::Error,
        }
        let io = std::io::Error::from_raw_os_error(2);
        let error = anyhow::Error::new(Opening {
            path: "a.bin".into(),
            source: io,
        })
        .context("opening the dataset");
        assert_eq!(
            error_text(&error),
            "opening the dataset: a.bin: No such file or directory (os error 2)"
        );
        let plain = anyhow::anyhow!("disk full").context("writing b.bin");
        assert_eq!(error_text(&plain), "writing b.bin: disk full");
    }

    #[test]
    fn usage_errors_exit_with_two_even_under_context() {
        assert_eq!(
            run(|| Err(usage_error("--saver hf: T5 has no HuggingFace form"))),
            ExitCode::from(2)
        );
        let wrapped = Err(usage_error("--load is required"))
            .map_err(|e: anyhow::Error| e.context("starting the server"));
        assert_eq!(run(|| wrapped), ExitCode::from(2));
    }
}
