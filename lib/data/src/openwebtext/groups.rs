//! `group_duplicate_url.py` and `remove_group_duplicates.py`: connected groups of ids
//! linked by a similarity at or above the threshold, then one document kept per group.
//!
//! The threshold defaults to the code's 0.7 (the README's 0.9 was never the default).
//! Groups are numbered, and their members listed, in order of first appearance in the
//! pairs file. Removal keeps the group member that comes first in the data file and drops
//! the others: stable across runs, where the original kept whichever id a Python set
//! happened to list first.

use std::collections::{HashMap, HashSet};

use super::json::{write_string, JsonObject, JsonValue};

/// The original's default similarity threshold for linking two ids.
pub const DEFAULT_GROUP_THRESHOLD: f64 = 0.7;

/// Union-find over ids interned in first-appearance order.
#[derive(Default)]
pub struct DuplicateGroups {
    ids: Vec<String>,
    index: HashMap<String, usize>,
    parent: Vec<usize>,
}

impl DuplicateGroups {
    fn intern(&mut self, id: &str) -> usize {
        if let Some(&i) = self.index.get(id) {
            return i;
        }
        let i = self.ids.len();
        self.ids.push(id.to_string());
        self.index.insert(id.to_string(), i);
        self.parent.push(i);
        i
    }

    fn root(&mut self, mut i: usize) -> usize {
        while self.parent[i] != i {
            self.parent[i] = self.parent[self.parent[i]];
            i = self.parent[i];
        }
        i
    }

    fn union(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.root(a), self.root(b));
        // The earlier-seen id becomes the root so group order follows first appearance.
        if ra < rb {
            self.parent[rb] = ra;
        } else if rb < ra {
            self.parent[ra] = rb;
        }
    }

    /// Adds one line of `find-duplicates` output: `{main: [{other: similarity}, …]}`.
    /// The main id and every other id at or above `threshold` are linked (the main id
    /// joins even when nothing passes, as in the original, but alone it forms no group).
    pub fn add_pairs_line(&mut self, line: &JsonObject, threshold: f64) -> Result<(), String> {
        for (main, others) in line.iter() {
            let main_idx = self.intern(main);
            let JsonValue::Array(others) = others else {
                return Err(format!("value of \"{main}\" is not a list"));
            };
            for entry in others {
                let JsonValue::Object(entry) = entry else {
                    return Err(format!("an entry of \"{main}\" is not an object"));
                };
                for (other, sim) in entry.iter() {
                    let JsonValue::Number(sim) = sim else {
                        return Err(format!("similarity of \"{other}\" is not a number"));
                    };
                    let sim = sim.as_f64().unwrap_or(f64::NAN);
                    if sim >= threshold {
                        let other_idx = self.intern(other);
                        self.union(main_idx, other_idx);
                    }
                }
            }
        }
        Ok(())
    }

    /// Groups with more than one member, in first-appearance order.
    pub fn groups(&mut self) -> Vec<Vec<String>> {
        let mut by_root: HashMap<usize, usize> = HashMap::new();
        let mut groups: Vec<Vec<String>> = Vec::new();
        for i in 0..self.ids.len() {
            let r = self.root(i);
            let g = *by_root.entry(r).or_insert_with(|| {
                groups.push(Vec::new());
                groups.len() - 1
            });
            groups[g].push(self.ids[i].clone());
        }
        groups.retain(|g| g.len() > 1);
        groups
    }
}

/// `{"<number>": [ids…]}` as the original writes a group.
pub fn group_to_python_json(number: usize, members: &[String]) -> String {
    let mut out = format!("{{\"{number}\": [");
    for (i, id) in members.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_string(id, &mut out);
    }
    out.push_str("]}");
    out
}

/// Parses a groups line back into its member ids.
pub fn parse_group_line(line: &JsonObject) -> Result<Vec<String>, String> {
    let mut members = Vec::new();
    for (name, ids) in line.iter() {
        let JsonValue::Array(ids) = ids else {
            return Err(format!("group \"{name}\" is not a list"));
        };
        for id in ids {
            match id {
                JsonValue::String(s) => members.push(s.clone()),
                _ => return Err(format!("group \"{name}\" holds a non-string id")),
            }
        }
    }
    Ok(members)
}

/// Decides, in data order, which documents of the groups survive: the first member of
/// each group that is seen is kept, later members are dropped.
#[derive(Default)]
pub struct GroupDeduplicator {
    group_of: HashMap<String, usize>,
    seen_groups: HashSet<usize>,
}

impl GroupDeduplicator {
    pub fn add_group(&mut self, members: Vec<String>) {
        let g = self.group_of.len();
        // An id listed in several groups belongs to the first one.
        let g = members
            .iter()
            .find_map(|m| self.group_of.get(m).copied())
            .unwrap_or(g);
        for m in members {
            self.group_of.entry(m).or_insert(g);
        }
    }

    pub fn grouped_ids(&self) -> usize {
        self.group_of.len()
    }

    /// True when the document with this id is a later copy of an already kept one.
    pub fn is_duplicate(&mut self, id: &str) -> bool {
        match self.group_of.get(id) {
            Some(&g) => !self.seen_groups.insert(g),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_connected_components_above_threshold() {
        let mut g = DuplicateGroups::default();
        for line in [
            r#"{"a": [{"b": 0.9}, {"c": 0.6}]}"#,
            r#"{"d": [{"e": 0.75}]}"#,
            r#"{"e": [{"b": 0.8}]}"#,
            r#"{"x": [{"y": 0.69}]}"#,
        ] {
            g.add_pairs_line(&JsonObject::parse(line).unwrap(), DEFAULT_GROUP_THRESHOLD)
                .unwrap();
        }
        let groups = g.groups();
        assert_eq!(groups, vec![vec!["a", "b", "d", "e"]]);
        assert_eq!(
            group_to_python_json(0, &groups[0]),
            r#"{"0": ["a", "b", "d", "e"]}"#
        );
    }

    #[test]
    fn first_member_in_data_order_survives() {
        let mut d = GroupDeduplicator::default();
        d.add_group(vec!["b".into(), "a".into()]);
        assert!(!d.is_duplicate("a"));
        assert!(d.is_duplicate("b"));
        assert!(!d.is_duplicate("z"));
    }
}
