//! Megatron's `clean_text`.

/// Python's `str.isspace` (what `\s` and `strip()` match on `str`): Unicode White_Space plus
/// the information separators U+001C..U+001F.
pub(super) fn is_python_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Newlines to spaces, whitespace runs to one space, then `" . "` → `". "` three times.
pub fn clean_text(text: &str) -> String {
    let mut collapsed = String::with_capacity(text.len());
    let mut in_space = false;
    for c in text.chars() {
        if is_python_space(c) {
            if !in_space {
                collapsed.push(' ');
            }
            in_space = true;
        } else {
            collapsed.push(c);
            in_space = false;
        }
    }
    for _ in 0..3 {
        collapsed = collapsed.replace(" . ", ". ");
    }
    collapsed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapses_whitespace_and_glues_sentence_dots() {
        assert_eq!(clean_text("a\n\n b\t\tc"), "a b c");
        assert_eq!(clean_text("end . next"), "end. next");
        // Python's results: each pass replaces non-overlapping matches left to right.
        assert_eq!(clean_text("a . . . b"), "a. .. b");
        assert_eq!(clean_text("x . . . . . y"), "x. .. .. y");
    }
}
