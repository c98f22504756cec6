//! Python's `json.dumps(obj, indent=4)` output, byte for byte. Megatron hashes that text to
//! name its cache files, so key order, float formatting and escaping must all match.

/// A JSON value that keeps insertion order and distinguishes Python ints from floats.
#[derive(Debug, Clone, PartialEq)]
pub enum PyJson {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<PyJson>),
    Map(Vec<(String, PyJson)>),
}

impl PyJson {
    pub fn str(s: impl Into<String>) -> PyJson {
        PyJson::Str(s.into())
    }

    /// `json.dumps(self, indent=4)`.
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out, 0);
        out
    }

    fn write(&self, out: &mut String, depth: usize) {
        match self {
            PyJson::Null => out.push_str("null"),
            PyJson::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            PyJson::Int(i) => out.push_str(&i.to_string()),
            PyJson::Float(f) => out.push_str(&python_float_repr(*f)),
            PyJson::Str(s) => write_string(out, s),
            PyJson::List(items) if items.is_empty() => out.push_str("[]"),
            PyJson::Map(entries) if entries.is_empty() => out.push_str("{}"),
            PyJson::List(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    separator(out, i, depth + 1);
                    item.write(out, depth + 1);
                }
                newline(out, depth);
                out.push(']');
            }
            PyJson::Map(entries) => {
                out.push('{');
                for (i, (key, value)) in entries.iter().enumerate() {
                    separator(out, i, depth + 1);
                    write_string(out, key);
                    out.push_str(": ");
                    value.write(out, depth + 1);
                }
                newline(out, depth);
                out.push('}');
            }
        }
    }
}

fn separator(out: &mut String, index: usize, depth: usize) {
    if index > 0 {
        out.push(',');
    }
    newline(out, depth);
}

fn newline(out: &mut String, depth: usize) {
    out.push('\n');
    out.push_str(&"    ".repeat(depth));
}

/// JSON string with `ensure_ascii=True` escaping.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if !(' '..='~').contains(&c) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional for decimal
/// exponents in `-4..16`, scientific (`1e-05`, `1.5e+16`) otherwise.
pub fn python_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "NaN".to_string();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("`{:e}` always has an exponent");
    let exponent: i32 = exponent.parse().expect("integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if !(-4..16).contains(&exponent) {
        let fraction = &digits[1..];
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        let dot = if fraction.is_empty() { "" } else { "." };
        return format!(
            "{sign}{}{dot}{fraction}e{exponent_sign}{:02}",
            &digits[..1],
            exponent.abs()
        );
    }
    if exponent < 0 {
        let zeros = "0".repeat((-exponent - 1) as usize);
        return format!("{sign}0.{zeros}{digits}");
    }
    let integer_len = exponent as usize + 1;
    if digits.len() <= integer_len {
        let zeros = "0".repeat(integer_len - digits.len());
        format!("{sign}{digits}{zeros}.0")
    } else {
        format!(
            "{sign}{}.{}",
            &digits[..integer_len],
            &digits[integer_len..]
        )
    }
}

/// Python's `str(list_of_strings)`, e.g. `['<unk>', "it's"]`: what Megatron records for a list
/// option of a tokenizer.
pub fn python_str_list_repr(items: &[String]) -> String {
    let items: Vec<String> = items.iter().map(|s| python_str_repr(s)).collect();
    format!("[{}]", items.join(", "))
}

/// Python's `str()` of a JSON value as Python would hold it: strings as they are, `True`,
/// `False`, `None`, ints, float reprs, and lists and dicts as their reprs (strings quoted).
pub fn python_str_of_json(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => python_repr_of_json(other),
    }
}

fn python_repr_of_json(value: &serde_json::Value) -> String {
    use serde_json::Value;
    match value {
        Value::Null => "None".into(),
        Value::Bool(true) => "True".into(),
        Value::Bool(false) => "False".into(),
        Value::Number(n) if n.is_f64() => python_float_repr(n.as_f64().unwrap_or(f64::NAN)),
        Value::Number(n) => n.to_string(),
        Value::String(s) => python_str_repr(s),
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_repr_of_json).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(entries) => {
            let entries: Vec<String> = entries
                .iter()
                .map(|(k, v)| format!("{}: {}", python_str_repr(k), python_repr_of_json(v)))
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a single quote and no double
/// quote; backslashes, the quote and control characters escaped.
fn python_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::from(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python_repr() {
        let cases = [
            (0.969, "0.969"),
            (1.0, "1.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e16, "1.5e+16"),
            (1e16, "1e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1e22, "1e+22"),
            (-2.5e-7, "-2.5e-07"),
            (100.0, "100.0"),
            (0.3 / 1.0000000000000002, "0.29999999999999993"),
        ];
        for (value, expected) in cases {
            assert_eq!(python_float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn nested_structures_use_four_space_indent_and_ascii_escapes() {
        let value = PyJson::Map(vec![
            (
                "a".into(),
                PyJson::List(vec![PyJson::Int(0), PyJson::Float(0.5)]),
            ),
            ("b".into(), PyJson::List(vec![])),
            ("c".into(), PyJson::str("é\"\u{1F600}\n")),
            ("d".into(), PyJson::Null),
        ]);
        assert_eq!(
            value.dumps(),
            "{\n    \"a\": [\n        0,\n        0.5\n    ],\n    \"b\": [],\n    \
             \"c\": \"\\u00e9\\\"\\ud83d\\ude00\\n\",\n    \"d\": null\n}"
        );
    }

    #[test]
    fn string_lists_print_like_python_str() {
        let list = |items: &[&str]| {
            python_str_list_repr(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(list(&[]), "[]");
        assert_eq!(list(&["<unk>", "<s>", "</s>"]), "['<unk>', '<s>', '</s>']");
        assert_eq!(
            list(&["it's", "a\\b", "say \"x\" 'y'", "tab\t"]),
            r#"["it's", 'a\\b', 'say "x" \'y\'', 'tab\t']"#
        );
    }

    #[test]
    fn json_values_print_like_python_str() {
        let str_of = |text: &str| python_str_of_json(&serde_json::from_str(text).unwrap());
        assert_eq!(str_of("true"), "True");
        assert_eq!(str_of("null"), "None");
        assert_eq!(str_of("1e-05"), "1e-05");
        assert_eq!(str_of("0.5"), "0.5");
        assert_eq!(str_of("1234"), "1234");
        assert_eq!(str_of(r#""cosine""#), "cosine");
        assert_eq!(str_of(r#"[0, "a", null, 2.0]"#), "[0, 'a', None, 2.0]");
        assert_eq!(str_of(r#"{"k": [true]}"#), "{'k': [True]}");
    }
}
