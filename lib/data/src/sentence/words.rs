//! Punkt's word tokenizer and per-token features, with Python `re` character semantics.

use unicode_general_category::{get_general_category, GeneralCategory as Gc};

/// Python's `str.isspace`, which `\s` follows: Unicode White_Space plus U+001C..U+001F.
pub(crate) fn is_space(c: char) -> bool {
    c.is_whitespace() || ('\x1c'..='\x1f').contains(&c)
}

/// Punkt's "non-word" characters: punctuation that ends a word. NLTK 3.10 added the curly
/// quotes and guillemets.
pub(crate) fn is_non_word(c: char) -> bool {
    matches!(
        c,
        ')' | '"' | ';' | '}' | ']' | '*' | ':' | '@' | '\'' | '(' | '{' | '[' | '!' | '?'
    ) || is_unicode_quote(c)
}

/// The curly quotes and guillemets NLTK 3.10 treats like ASCII quotes.
pub(crate) fn is_unicode_quote(c: char) -> bool {
    matches!(
        c,
        '\u{2018}' | '\u{2019}' | '\u{201c}' | '\u{201d}' | '\u{ab}' | '\u{bb}'
    )
}

/// Characters that may not start a word.
fn is_non_word_start(c: char) -> bool {
    matches!(
        c,
        '(' | '"'
            | '`'
            | '{'
            | '['
            | ':'
            | ';'
            | '&'
            | '#'
            | '*'
            | '@'
            | ')'
            | '}'
            | ']'
            | '-'
            | ','
    )
}

/// Python `re`'s `\d`: Unicode decimal digits.
fn is_digit(c: char) -> bool {
    get_general_category(c) == Gc::DecimalNumber
}

/// Python `re`'s `[^\W\d]`: word characters other than decimal digits.
fn is_alpha_like(c: char) -> bool {
    c == '_'
        || matches!(
            get_general_category(c),
            Gc::UppercaseLetter
                | Gc::LowercaseLetter
                | Gc::TitlecaseLetter
                | Gc::ModifierLetter
                | Gc::OtherLetter
                | Gc::LetterNumber
                | Gc::OtherNumber
        )
}

/// End (exclusive, in chars) of Punkt's multi-character punctuation at `i`:
/// `-{2,}`, `\.{2,}` or `(?:\.\s){2,}\.`.
fn multi_char_at(chars: &[char], i: usize) -> Option<usize> {
    let run = |c: char| chars[i..].iter().take_while(|&&x| x == c).count();
    if chars.get(i) == Some(&'-') && run('-') >= 2 {
        return Some(i + run('-'));
    }
    if chars.get(i) == Some(&'.') && run('.') >= 2 {
        return Some(i + run('.'));
    }
    let mut pairs = 0;
    while chars.get(i + 2 * pairs) == Some(&'.')
        && chars.get(i + 2 * pairs + 1).is_some_and(|&c| is_space(c))
    {
        pairs += 1;
    }
    // Backtrack from the longest run of ". " pairs to the longest that a final '.' follows.
    while pairs >= 2 {
        if chars.get(i + 2 * pairs) == Some(&'.') {
            return Some(i + 2 * pairs + 1);
        }
        pairs -= 1;
    }
    None
}

/// Whether a word may end before position `e` (Punkt's end-of-word look-ahead).
fn word_ends_at(chars: &[char], e: usize) -> bool {
    let Some(&c) = chars.get(e) else { return true };
    if is_space(c) || is_non_word(c) || multi_char_at(chars, e).is_some() {
        return true;
    }
    c == ','
        && match chars.get(e + 1) {
            None => true,
            Some(&n) => is_space(n) || is_non_word(n) || multi_char_at(chars, e + 1).is_some(),
        }
}

/// Punkt's `word_tokenize` for one line (no newlines).
pub(crate) fn tokenize_line(line: &str) -> Vec<String> {
    let chars: Vec<char> = line.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if is_space(c) {
            i += 1;
            continue;
        }
        let end = if let Some(end) = multi_char_at(&chars, i) {
            end
        } else if !is_non_word_start(c) {
            let mut e = i + 1;
            while !word_ends_at(&chars, e) {
                e += 1;
            }
            e
        } else {
            i + 1
        };
        out.push(chars[i..end].iter().collect());
        i = end;
    }
    out
}

/// A word with the features Punkt's annotation passes use.
#[derive(Debug)]
pub(crate) struct Token {
    pub tok: String,
    /// Lower-cased text, or `##number##` for numbers.
    pub typ: String,
    pub period_final: bool,
    pub sentbreak: bool,
    pub abbr: bool,
    pub ellipsis: bool,
}

/// Punkt's number pattern `^-?[\.,]?\d[\d,\.-]*\.?$`.
fn is_number(s: &str) -> bool {
    let mut rest = s.strip_prefix('-').unwrap_or(s);
    rest = rest.strip_prefix(['.', ',']).unwrap_or(rest);
    let mut chars = rest.chars();
    chars.next().is_some_and(is_digit) && chars.all(|c| is_digit(c) || matches!(c, ',' | '.' | '-'))
}

impl Token {
    pub fn new(tok: String) -> Self {
        let lower = tok.to_lowercase();
        let typ = if is_number(&lower) {
            "##number##".to_string()
        } else {
            lower
        };
        Token {
            period_final: tok.ends_with('.'),
            tok,
            typ,
            sentbreak: false,
            abbr: false,
            ellipsis: false,
        }
    }

    pub fn type_no_period(&self) -> &str {
        if self.typ.chars().count() > 1 && self.typ.ends_with('.') {
            &self.typ[..self.typ.len() - 1]
        } else {
            &self.typ
        }
    }

    pub fn type_no_sentperiod(&self) -> &str {
        if self.sentbreak {
            self.type_no_period()
        } else {
            &self.typ
        }
    }

    fn first_char(&self) -> char {
        self.tok.chars().next().expect("tokens are non-empty")
    }

    pub fn first_upper(&self) -> bool {
        self.first_char().is_uppercase()
    }

    pub fn first_lower(&self) -> bool {
        self.first_char().is_lowercase()
    }

    pub fn is_ellipsis(&self) -> bool {
        self.tok.len() >= 2 && self.tok.bytes().all(|b| b == b'.')
    }

    pub fn is_initial(&self) -> bool {
        let mut chars = self.tok.chars();
        matches!((chars.next(), chars.next(), chars.next()), (Some(c), Some('.'), None) if is_alpha_like(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_tokenizer_matches_punkt() {
        assert_eq!(tokenize_line("Hello, world."), ["Hello", ",", "world."]);
        assert_eq!(
            tokenize_line("(Mr. Smith) said \"hi\"..."),
            ["(", "Mr.", "Smith", ")", "said", "\"", "hi", "\"", "..."]
        );
        assert_eq!(
            tokenize_line("a -- b . . . c"),
            ["a", "--", "b", ". . .", "c"]
        );
        assert_eq!(
            tokenize_line("1,000,000 people,"),
            ["1,000,000", "people", ","]
        );
    }

    #[test]
    fn token_features() {
        assert_eq!(Token::new("-3.5".into()).typ, "##number##");
        assert_eq!(Token::new("1990s".into()).typ, "1990s");
        assert!(Token::new("J.".into()).is_initial());
        assert!(!Token::new("5.".into()).is_initial());
        assert!(Token::new("..".into()).is_ellipsis());
        assert_eq!(Token::new("Etc.".into()).type_no_period(), "etc");
    }
}
