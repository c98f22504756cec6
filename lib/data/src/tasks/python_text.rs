//! Python's notion of whitespace (`str.isspace`, `str.split()`, `str.strip()`), which Megatron's
//! task code relies on. It is Unicode's `White_Space` plus the four ASCII separators
//! U+001C–U+001F.

/// `ch.isspace()` in Python.
pub fn is_python_space(ch: char) -> bool {
    ch.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&ch)
}

/// `text.strip()` in Python.
pub fn python_strip(text: &str) -> &str {
    text.trim_matches(is_python_space)
}

/// `text.split()` in Python: runs of whitespace separate, no empty pieces.
pub fn python_split_whitespace(text: &str) -> impl DoubleEndedIterator<Item = &str> {
    text.split(is_python_space)
        .filter(|piece| !piece.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_count_as_whitespace() {
        assert_eq!(python_strip("\u{1f} a b\u{a0}\n"), "a b");
        let words: Vec<&str> = python_split_whitespace("a\u{1c}b  c\u{2003}d ").collect();
        assert_eq!(words, ["a", "b", "c", "d"]);
        assert!(!is_python_space('\u{200b}'));
    }
}
