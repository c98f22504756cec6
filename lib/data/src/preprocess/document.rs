use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, Visitor};

/// The value of one requested JSON key.
#[derive(Debug, Clone, PartialEq)]
pub enum FieldText {
    /// A plain text (split into sentences when asked to).
    Text(String),
    /// Already-split sentences, as in Megatron's `_ss` intermediate files.
    Sentences(Vec<String>),
}

/// Parses one JSON line and extracts `keys`, in order. Other fields are skipped without
/// being materialised.
pub fn parse_line(line: &str, keys: &[String]) -> Result<Vec<FieldText>, String> {
    let mut de = serde_json::Deserializer::from_str(line);
    let mut found: Vec<Option<FieldText>> = vec![None; keys.len()];
    Fields {
        keys,
        found: &mut found,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end())
    .map_err(|e| format!("invalid JSON: {e}"))?;
    keys.iter()
        .zip(found)
        .map(|(key, value)| value.ok_or_else(|| format!("missing key {key:?}")))
        .collect()
}

struct Fields<'a> {
    keys: &'a [String],
    found: &'a mut Vec<Option<FieldText>>,
}

impl<'de> DeserializeSeed<'de> for Fields<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Fields<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match self.keys.iter().position(|k| *k == key) {
                Some(i) => {
                    let value: serde_json::Value = map.next_value()?;
                    self.found[i] = Some(field_text(&key, value).map_err(de::Error::custom)?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

fn field_text(key: &str, value: serde_json::Value) -> Result<FieldText, String> {
    let kind = |v: &serde_json::Value| match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    };
    match value {
        serde_json::Value::String(s) => Ok(FieldText::Text(s)),
        serde_json::Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                serde_json::Value::String(s) => Ok(s),
                other => Err(format!(
                    "key {key:?} is an array holding {}; expected strings",
                    kind(&other)
                )),
            })
            .collect::<Result<_, _>>()
            .map(FieldText::Sentences),
        other => Err(format!(
            "key {key:?} holds {}; expected a string or an array of strings",
            kind(&other)
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn extracts_requested_keys_in_order() {
        let line = r#"{"id": 3, "meta": {"a": [1, 2]}, "text": "hi", "title": ["a", "b"]}"#;
        let got = parse_line(line, &keys(&["title", "text"])).unwrap();
        assert_eq!(
            got,
            [
                FieldText::Sentences(vec!["a".into(), "b".into()]),
                FieldText::Text("hi".into())
            ]
        );
    }

    #[test]
    fn reports_what_is_wrong() {
        let k = keys(&["text"]);
        assert!(parse_line(r#"{"body": "x"}"#, &k)
            .unwrap_err()
            .contains("missing key \"text\""));
        assert!(parse_line(r#"{"text": 5}"#, &k)
            .unwrap_err()
            .contains("holds a number"));
        assert!(parse_line(r#"{"text": "x""#, &k)
            .unwrap_err()
            .contains("invalid JSON"));
        assert!(parse_line(r#"["text"]"#, &k)
            .unwrap_err()
            .contains("invalid JSON"));
        assert!(parse_line(r#"{"text": "x"} trailing"#, &k)
            .unwrap_err()
            .contains("invalid JSON"));
    }
}
