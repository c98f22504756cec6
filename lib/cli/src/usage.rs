//! Usage errors found after clap parsed the command line: a flag that only some other flag makes
//! necessary, a combination of flags that cannot work together, a value clap's declarations cannot
//! check. They exit 2 like clap's own errors ([`crate::run`]), so a script tells a wrong command
//! line from a failed run the same way for every binary and every check.

use std::fmt;

/// A mistake in the command line; its text names the flag (`--saver hf: ...`).
#[derive(Debug)]
pub struct UsageError(String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// A [`UsageError`] saying `message`, ready to return (`return Err(usage_error(...))`).
pub fn usage_error(message: impl fmt::Display) -> anyhow::Error {
    anyhow::Error::new(UsageError(message.to_string()))
}

/// Returns a [`UsageError`] from the enclosing function, as anyhow's `bail!` returns an error:
/// `bail_usage!("--saver {saver}: T5 checkpoints are written as megatron-rs only")`.
#[macro_export]
macro_rules! bail_usage {
    ($($message:tt)*) => {
        return Err($crate::usage_error(format!($($message)*)))
    };
}

/// Whether `error`, or any error it wraps, is a [`UsageError`].
pub fn is_usage_error(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| cause.is::<UsageError>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    fn refuse(saver: &str) -> anyhow::Result<()> {
        crate::bail_usage!("--saver {saver}: unknown")
    }

    #[test]
    fn bail_usage_returns_a_usage_error() {
        let error = refuse("foo").unwrap_err();
        assert!(is_usage_error(&error));
        assert_eq!(error.to_string(), "--saver foo: unknown");
    }

    #[test]
    fn found_under_context_and_only_there() {
        let error = Err::<(), _>(usage_error("--loader foo: unknown"))
            .context("converting")
            .unwrap_err();
        assert!(is_usage_error(&error));
        assert_eq!(
            crate::error_text(&error),
            "converting: --loader foo: unknown"
        );
        assert!(!is_usage_error(&anyhow::anyhow!("--loader foo: unknown")));
    }
}
