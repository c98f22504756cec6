//! Value parsers for numeric flags with an obvious range, so that `--lr inf`, `--clip-grad nan`
//! or `--hidden-dropout 1.5` stop at parsing (exit 2, clap's message naming the flag and the
//! value) instead of training into NaN. Flags taking them set `allow_hyphen_values`, or clap
//! would read `-1` or `-1e-5` as an unknown flag and say `unexpected argument '-1' found`.

fn number(text: &str) -> Result<f64, String> {
    text.trim()
        .parse::<f64>()
        .map_err(|_| format!("expected a number, got {text:?}"))
}

fn finite(text: &str, wanted: &str) -> Result<f64, String> {
    let value = number(text)?;
    if value.is_finite() {
        Ok(value)
    } else {
        Err(format!("must be {wanted}, got {text}"))
    }
}

fn within(text: &str, wanted: &str, accept: impl Fn(f64) -> bool) -> Result<f64, String> {
    let value = finite(text, wanted)?;
    if accept(value) {
        Ok(value)
    } else {
        Err(format!("must be {wanted}, got {text}"))
    }
}

/// A finite number ≥ 0: learning rates, weight decay, gradient clipping, init std.
pub fn non_negative(text: &str) -> Result<f64, String> {
    within(text, "a finite number ≥ 0", |v| v >= 0.0)
}

/// A finite number > 0: Adam's epsilon, loss scales, epsilons of norms.
pub fn positive(text: &str) -> Result<f64, String> {
    within(text, "a finite number > 0", |v| v > 0.0)
}

/// [`positive`] for `f32` flags.
pub fn positive_f32(text: &str) -> Result<f32, String> {
    positive(text).map(|v| v as f32)
}

/// A probability in [0, 1]: dropout rates, fractions.
pub fn probability(text: &str) -> Result<f64, String> {
    within(text, "a number in [0, 1]", |v| (0.0..=1.0).contains(&v))
}

/// A number in [0, 1): Adam's betas, momentum (1 would never forget).
pub fn below_one(text: &str) -> Result<f64, String> {
    within(text, "a number in [0, 1)", |v| (0.0..1.0).contains(&v))
}

/// A whole number ≥ 1: batch sizes.
pub fn at_least_one(text: &str) -> Result<u64, String> {
    let value: i128 = text
        .trim()
        .parse()
        .map_err(|_| format!("expected a whole number, got {text:?}"))?;
    u64::try_from(value)
        .ok()
        .filter(|&v| v >= 1)
        .ok_or_else(|| format!("must be a whole number ≥ 1, got {text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_range_names_what_it_wants() {
        assert_eq!(non_negative("1e-3"), Ok(1e-3));
        assert_eq!(non_negative("0"), Ok(0.0));
        assert_eq!(
            non_negative("-1").unwrap_err(),
            "must be a finite number ≥ 0, got -1"
        );
        assert_eq!(
            non_negative("inf").unwrap_err(),
            "must be a finite number ≥ 0, got inf"
        );
        assert_eq!(
            non_negative("nan").unwrap_err(),
            "must be a finite number ≥ 0, got nan"
        );
        assert_eq!(
            non_negative("fast").unwrap_err(),
            "expected a number, got \"fast\""
        );
        assert_eq!(positive("1e-8"), Ok(1e-8));
        assert_eq!(
            positive("0").unwrap_err(),
            "must be a finite number > 0, got 0"
        );
        assert_eq!(positive_f32("65536"), Ok(65536.0));
        assert_eq!(probability("1"), Ok(1.0));
        assert_eq!(
            probability("1.5").unwrap_err(),
            "must be a number in [0, 1], got 1.5"
        );
        assert_eq!(below_one("0.999"), Ok(0.999));
        assert_eq!(
            below_one("1").unwrap_err(),
            "must be a number in [0, 1), got 1"
        );
        assert_eq!(at_least_one("3"), Ok(3));
        assert_eq!(
            at_least_one("0").unwrap_err(),
            "must be a whole number ≥ 1, got 0"
        );
        assert_eq!(
            at_least_one("-2").unwrap_err(),
            "must be a whole number ≥ 1, got -2"
        );
    }
}
