//! Python's `format()` of floats for the two presentation types Megatron's log lines use, so
//! that our lines compare byte-for-byte with Megatron's and its log parsers keep working.
//!
//! Rust's own `{:.Ne}` / `{:.N}` already round exactly like Python (correctly rounded, ties to
//! even on the exact binary value); they differ only in the exponent spelling (`e-5` against
//! Python's `E-05`) and in how non-finite values are written (`NaN` against `nan`).

/// Python's `'{:.<precision>E}'.format(value)`: `1.234568E+00`, `-3.000000E-05`, `INF`, `NAN`.
pub fn format_exp_upper(value: f64, precision: usize) -> String {
    if !value.is_finite() {
        return non_finite(value).to_uppercase();
    }
    let rust = format!("{value:.precision$e}");
    let (mantissa, exponent) = rust
        .split_once('e')
        .expect("Rust's {:e} always writes an exponent");
    let exponent: i32 = exponent
        .parse()
        .expect("Rust's {:e} exponent is an integer");
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}E{sign}{:02}", exponent.unsigned_abs())
}

/// Python's `'{:.<precision>f}'.format(value)`: `4294967296.0`, `-0.040`, `inf`, `nan`.
pub fn format_fixed(value: f64, precision: usize) -> String {
    if !value.is_finite() {
        return non_finite(value).to_string();
    }
    format!("{value:.precision$}")
}

/// Python's `str(value)` / `'{}'.format(value)` of a float: the shortest repr that round-trips,
/// `1.0` for integral values, exponent form (`1.5e-05`, `1e+16`) below 1e-4 and from 1e16 up.
pub fn format_repr(value: f64) -> String {
    if !value.is_finite() {
        return non_finite(value).to_string();
    }
    let magnitude = value.abs();
    if magnitude != 0.0 && !(1e-4..1e16).contains(&magnitude) {
        let rust = format!("{value:e}");
        let (mantissa, exponent) = rust
            .split_once('e')
            .expect("Rust's {:e} always writes an exponent");
        let exponent: i32 = exponent
            .parse()
            .expect("Rust's {:e} exponent is an integer");
        let sign = if exponent < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exponent.unsigned_abs());
    }
    let text = format!("{value}");
    if text.contains('.') {
        text
    } else {
        format!("{text}.0")
    }
}

/// Python drops the sign of a NaN when formatting it, but keeps the sign of an infinity.
fn non_finite(value: f64) -> &'static str {
    if value.is_nan() {
        "nan"
    } else if value > 0.0 {
        "inf"
    } else {
        "-inf"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Expected strings printed by python3 3.11: `'{:.6E}'.format(x)` for each x.
    #[test]
    fn exp_upper_matches_python() {
        let cases = [
            (1.2345678, "1.234568E+00"),
            (-3e-05, "-3.000000E-05"),
            (0.0, "0.000000E+00"),
            (-0.0, "-0.000000E+00"),
            (123456789.0, "1.234568E+08"),
            (1e100, "1.000000E+100"),
            (1e-300, "1.000000E-300"),
            (5e-324, "4.940656E-324"),
            (9.9999995, "9.999999E+00"),
            // Exact binary ties round to even, as in Python.
            (1234567.5, "1.234568E+06"),
            (1234568.5, "1.234568E+06"),
            (f64::INFINITY, "INF"),
            (f64::NEG_INFINITY, "-INF"),
            (f64::NAN, "NAN"),
            (-f64::NAN, "NAN"),
        ];
        for (value, expected) in cases {
            assert_eq!(format_exp_upper(value, 6), expected, "value {value:?}");
        }
    }

    // Expected strings printed by python3 3.11: `str(x)`.
    #[test]
    fn repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (1.1335986914, "1.1335986914"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1.5e-5, "1.5e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-0.0, "-0.0"),
            (f64::NAN, "nan"),
        ];
        for (value, expected) in cases {
            assert_eq!(format_repr(value), expected, "value {value:?}");
        }
    }

    // Expected strings printed by python3 3.11: `'{:.1f}'.format(x)` and `'{:.3f}'.format(x)`.
    #[test]
    fn fixed_matches_python() {
        let cases = [
            (0.25, "0.2", "0.250"),
            (0.35, "0.3", "0.350"),
            (2.675, "2.7", "2.675"),
            (4294967296.0, "4294967296.0", "4294967296.000"),
            (-0.04, "-0.0", "-0.040"),
            (
                1e22,
                "10000000000000000000000.0",
                "10000000000000000000000.000",
            ),
            (f64::INFINITY, "inf", "inf"),
            (f64::NEG_INFINITY, "-inf", "-inf"),
            (f64::NAN, "nan", "nan"),
        ];
        for (value, one, three) in cases {
            assert_eq!(format_fixed(value, 1), one, "value {value:?}");
            assert_eq!(format_fixed(value, 3), three, "value {value:?}");
        }
    }
}
