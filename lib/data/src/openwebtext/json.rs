//! Loose-JSON documents as Megatron's scripts see them: objects that keep their key order,
//! written back the way Python's `json.dumps(obj, ensure_ascii=False)` writes them
//! (`", "` and `": "` separators, non-ASCII kept as is, floats in `repr` form), so our
//! outputs are byte-identical to the originals' for the same documents.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use std::fmt::{self, Write as _};

/// One JSON value; objects keep their keys in input order.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonValue {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<JsonValue>),
    Object(JsonObject),
}

/// A JSON object with Python `dict` semantics: insertion order, a repeated key keeps its
/// first position and takes the last value.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonObject {
    entries: Vec<(String, JsonValue)>,
}

impl JsonObject {
    /// Parses one line of loose JSON; the top level must be an object.
    pub fn parse(line: &str) -> Result<Self, String> {
        match serde_json::from_str::<JsonValue>(line) {
            Ok(JsonValue::Object(obj)) => Ok(obj),
            Ok(_) => Err("expected a JSON object".to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    pub fn get(&self, key: &str) -> Option<&JsonValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// The string value of `key`, or a message saying what is wrong with it.
    pub fn get_str(&self, key: &str) -> Result<&str, String> {
        match self.get(key) {
            Some(JsonValue::String(s)) => Ok(s),
            Some(_) => Err(format!("field \"{key}\" is not a string")),
            None => Err(format!("missing field \"{key}\"")),
        }
    }

    /// Sets `key` like a Python dict assignment: replaced in place if present, else appended.
    pub fn insert(&mut self, key: &str, value: JsonValue) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.entries.push((key.to_string(), value)),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &JsonValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The object as Python's `json.dumps(obj, ensure_ascii=False)` prints it.
    pub fn to_python_json(&self) -> String {
        let mut out = String::new();
        write_object(self, &mut out);
        out
    }
}

pub use crate::cache::python_json::python_float_repr;

fn write_value(value: &JsonValue, out: &mut String) {
    match value {
        JsonValue::Null => out.push_str("null"),
        JsonValue::Bool(true) => out.push_str("true"),
        JsonValue::Bool(false) => out.push_str("false"),
        JsonValue::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => out.push_str(&python_float_repr(f)),
            None => out.push_str(&n.to_string()),
        },
        JsonValue::String(s) => write_string(s, out),
        JsonValue::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_value(item, out);
            }
            out.push(']');
        }
        JsonValue::Object(obj) => write_object(obj, out),
    }
}

fn write_object(obj: &JsonObject, out: &mut String) {
    out.push('{');
    for (i, (key, value)) in obj.entries.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_string(key, out);
        out.push_str(": ");
        write_value(value, out);
    }
    out.push('}');
}

/// A JSON string literal with Python's `ensure_ascii=False` escaping.
pub fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

impl<'de> Deserialize<'de> for JsonValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = JsonValue;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<JsonValue, E> {
        Ok(JsonValue::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<JsonValue, E> {
        Ok(JsonValue::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<JsonValue, E> {
        Ok(JsonValue::Number(v.into()))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<JsonValue, E> {
        serde_json::Number::from_f64(v)
            .map(JsonValue::Number)
            .ok_or_else(|| E::custom("non-finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<JsonValue, E> {
        Ok(JsonValue::String(v))
    }
    fn visit_unit<E>(self) -> Result<JsonValue, E> {
        Ok(JsonValue::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<JsonValue, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(JsonValue::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<JsonValue, A::Error> {
        let mut obj = JsonObject::default();
        while let Some((key, value)) = map.next_entry::<String, JsonValue>()? {
            obj.insert(&key, value);
        }
        Ok(JsonValue::Object(obj))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumps_like_python() {
        let obj = JsonObject::parse(
            r#"{"text":"caf\u00e9 \"q\"\n\u0001","url":"u","n":[1,2.5,1e-7,1e16,100.0],"o":{"b":null,"a":true}}"#,
        )
        .unwrap();
        assert_eq!(
            obj.to_python_json(),
            "{\"text\": \"café \\\"q\\\"\\n\\u0001\", \"url\": \"u\", \"n\": [1, 2.5, 1e-07, 1e+16, 100.0], \"o\": {\"b\": null, \"a\": true}}"
        );
    }

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (0.8333333333333334, "0.8333333333333334"),
            (1.0, "1.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456789012345.6, "123456789012345.6"),
            (1.5e300, "1.5e+300"),
            (-2.0, "-2.0"),
        ] {
            assert_eq!(python_float_repr(f), want);
        }
    }

    #[test]
    fn repeated_key_keeps_first_position_and_last_value() {
        let mut obj = JsonObject::parse(r#"{"a": 1, "b": 2, "a": 3}"#).unwrap();
        obj.insert("c", JsonValue::String("x".into()));
        assert_eq!(obj.to_python_json(), r#"{"a": 3, "b": 2, "c": "x"}"#);
        assert!(JsonObject::parse("[1]").is_err());
    }
}
