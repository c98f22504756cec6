//! `--data-path` style lists: `A B C` or `0.3 A 0.7 B` (Megatron's `get_blend_from_list`),
//! `--data-args-path` files and `--per-split-data-args-path` JSON.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// Dataset prefixes with optional (unnormalised) weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Blend {
    pub prefixes: Vec<String>,
    pub weights: Option<Vec<f64>>,
}

impl Blend {
    /// Parses a list the way Megatron does: even-length lists whose every other entry is a
    /// Python float are `(weight, prefix)` pairs, anything else is a list of prefixes.
    pub fn parse(items: &[String]) -> Result<Blend> {
        if items.is_empty() {
            bail!("empty data path list");
        }
        let pairs: Option<Vec<(f64, &String)>> = items
            .len()
            .is_multiple_of(2)
            .then(|| {
                items
                    .chunks_exact(2)
                    .map(|pair| python_float(&pair[0]).map(|w| (w, &pair[1])))
                    .collect()
            })
            .flatten();
        let blend = match pairs {
            Some(pairs) => Blend {
                prefixes: pairs.iter().map(|(_, p)| p.trim().to_string()).collect(),
                weights: Some(pairs.iter().map(|(w, _)| *w).collect()),
            },
            None => Blend {
                prefixes: items.iter().map(|p| p.trim().to_string()).collect(),
                weights: None,
            },
        };
        if let Some(weights) = &blend.weights {
            if let Some(bad) = weights.iter().find(|w| w.is_nan() || **w <= 0.0) {
                bail!("data path weights must be positive, found {bad}");
            }
        }
        Ok(blend)
    }

    /// `--data-args-path FILE`: the file's whitespace-separated words, parsed as a list.
    pub fn from_args_file(path: &Path) -> Result<Blend> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading data args file {}", path.display()))?;
        let items: Vec<String> = text.split_whitespace().map(str::to_string).collect();
        Blend::parse(&items).with_context(|| format!("parsing {}", path.display()))
    }

    /// `--per-split-data-args-path FILE`: `{"train": [...]|"...", "valid": ..., "test": ...}`.
    pub fn per_split_from_json(path: &Path) -> Result<[Option<Blend>; 3]> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading per-split data args {}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing JSON in {}", path.display()))?;
        let mut blends: [Option<Blend>; 3] = [None, None, None];
        for (slot, key) in blends.iter_mut().zip(["train", "valid", "test"]) {
            let items: Vec<String> = match value.get(key) {
                None | Some(serde_json::Value::Null) => continue,
                Some(serde_json::Value::String(s)) => {
                    s.split_whitespace().map(str::to_string).collect()
                }
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .map(|v| match v {
                        serde_json::Value::String(s) => Ok(s.clone()),
                        serde_json::Value::Number(n) => Ok(n.to_string()),
                        other => bail!("{}: \"{key}\" holds {other}", path.display()),
                    })
                    .collect::<Result<_>>()?,
                Some(other) => bail!(
                    "{}: \"{key}\" must be a list or a string, found {other}",
                    path.display()
                ),
            };
            *slot = Some(
                Blend::parse(&items).with_context(|| format!("{}: \"{key}\"", path.display()))?,
            );
        }
        Ok(blends)
    }
}

/// Python's `float(s)` for the forms that occur as weights (surrounding whitespace allowed,
/// `_` digit separators, `inf`/`nan` words).
fn python_float(text: &str) -> Option<f64> {
    let trimmed = text.trim();
    if trimmed.is_empty()
        || trimmed.starts_with('_')
        || trimmed.ends_with('_')
        || trimmed.contains("__")
    {
        return None;
    }
    let cleaned = trimmed.replace('_', "");
    let lower = cleaned.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if matches!(unsigned, "inf" | "infinity" | "nan") {
        return lower.parse().ok();
    }
    if unsigned
        .chars()
        .any(|c| c.is_ascii_alphabetic() && c != 'e')
    {
        return None;
    }
    cleaned.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn weighted_pairs_and_plain_prefixes() {
        let blend = Blend::parse(&strings(&["0.3", "A", "0.7", " B "])).unwrap();
        assert_eq!(blend.prefixes, ["A", "B"]);
        assert_eq!(blend.weights, Some(vec![0.3, 0.7]));
        let plain = Blend::parse(&strings(&["A", "B"])).unwrap();
        assert_eq!(plain.prefixes, ["A", "B"]);
        assert_eq!(plain.weights, None);
        let odd = Blend::parse(&strings(&["1", "A", "B"])).unwrap();
        assert_eq!(odd.weights, None);
        assert_eq!(odd.prefixes.len(), 3);
    }

    #[test]
    fn non_positive_weights_are_rejected() {
        assert!(Blend::parse(&strings(&["0", "A", "1", "B"])).is_err());
        assert!(Blend::parse(&strings(&["-1", "A", "1", "B"])).is_err());
    }

    #[test]
    fn per_split_json_accepts_lists_strings_and_null() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("splits.json");
        std::fs::write(
            &path,
            r#"{"train": ["1", "A", "3", "B"], "valid": "C", "test": null}"#,
        )
        .unwrap();
        let [train, valid, test] = Blend::per_split_from_json(&path).unwrap();
        assert_eq!(train.unwrap().weights, Some(vec![1.0, 3.0]));
        assert_eq!(valid.unwrap().prefixes, ["C"]);
        assert!(test.is_none());
    }
}
