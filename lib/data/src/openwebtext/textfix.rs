//! The essential fixes of `ftfy.fix_text` with its default options, in ftfy's order:
//! terminal escapes removed, HTML entities decoded (only when the text holds no `<`, like
//! ftfy's "auto"), mojibake undone (UTF-8 that was decoded as Windows-1252 or Latin-1,
//! repeatedly), Latin ligatures and full-width characters replaced, curly quotes
//! straightened, line breaks unified to `\n`, control characters removed, then NFC.
//!
//! Not reproduced: ftfy's "badness" scoring (we accept a re-decoding only when the whole
//! text round-trips to valid UTF-8 and gets shorter), partial-segment repairs of mixed
//! text, and the rarer encodings (MacRoman, cp437, sloppy-windows-1251).

use regex::Regex;
use std::borrow::Cow;
use std::sync::LazyLock;
use unicode_normalization::UnicodeNormalization;

static TERMINAL_ESCAPE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new("\x1b\\[((?:\\d|;)*)([a-zA-Z])").expect("static regex"));

/// Windows-1252 bytes 0x80..=0x9F and the characters they decode to; the five undefined
/// bytes decode to the C1 control of the same value, as in Python's `sloppy` codecs.
const CP1252_HIGH: [char; 32] = [
    '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8d}', 'Ž', '\u{8f}',
    '\u{90}', '‘', '’', '“', '”', '•', '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9d}', 'ž', 'Ÿ',
];

/// Applies every fix; returns the input unchanged (borrowed) when nothing applied.
pub fn fix_text(text: &str) -> Cow<'_, str> {
    let mut s = Cow::Borrowed(text);
    if s.contains('\x1b') {
        s = Cow::Owned(TERMINAL_ESCAPE.replace_all(&s, "").into_owned());
    }
    if s.contains('&') && !s.contains('<') {
        if let Cow::Owned(decoded) = html_escape::decode_html_entities(&s) {
            s = Cow::Owned(decoded);
        }
    }
    while let Some(fixed) = undo_mojibake(&s) {
        s = Cow::Owned(fixed);
    }
    if s.chars().any(needs_char_fix) {
        s = Cow::Owned(fix_chars(&s));
    }
    if s.contains('\r') {
        s = Cow::Owned(s.replace("\r\n", "\n").replace('\r', "\n"));
    }
    if !unicode_normalization::is_nfc(&s) {
        s = Cow::Owned(s.nfc().collect());
    }
    s
}

/// Re-encodes text as Windows-1252/Latin-1 bytes and decodes them as UTF-8. `None` when
/// the text is not representable, does not decode, or decoding changes nothing.
fn undo_mojibake(text: &str) -> Option<String> {
    if text.is_ascii() {
        return None;
    }
    let mut bytes = Vec::with_capacity(text.len());
    for c in text.chars() {
        bytes.push(cp1252_byte(c)?);
    }
    let decoded = String::from_utf8(bytes).ok()?;
    (decoded.len() < text.len()).then_some(decoded)
}

fn cp1252_byte(c: char) -> Option<u8> {
    let code = c as u32;
    if code < 0x80 || (0xA0..=0xFF).contains(&code) {
        return Some(code as u8);
    }
    CP1252_HIGH
        .iter()
        .position(|&h| h == c)
        .map(|i| 0x80 + i as u8)
}

fn needs_char_fix(c: char) -> bool {
    matches!(c,
        '\u{FB00}'..='\u{FB06}'
        | '\u{FF01}'..='\u{FF5E}'
        | '\u{3000}'
        | '‘' | '’' | '‚' | '‛' | '“' | '”' | '„' | '‟'
        | '\u{2028}' | '\u{2029}' | '\u{85}'
    ) || is_removed_control(c)
}

/// Control characters ftfy's `remove_control_chars` deletes (tabs, newlines, carriage
/// returns and form feeds stay).
fn is_removed_control(c: char) -> bool {
    matches!(c,
        '\u{0}'..='\u{8}' | '\u{B}' | '\u{E}'..='\u{1F}' | '\u{7F}'
        | '\u{206A}'..='\u{206F}' | '\u{FEFF}' | '\u{FFF9}'..='\u{FFFC}'
        | '\u{E0000}'..='\u{E007F}'
    )
}

fn fix_chars(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\u{FB00}' => out.push_str("ff"),
            '\u{FB01}' => out.push_str("fi"),
            '\u{FB02}' => out.push_str("fl"),
            '\u{FB03}' => out.push_str("ffi"),
            '\u{FB04}' => out.push_str("ffl"),
            '\u{FB05}' | '\u{FB06}' => out.push_str("st"),
            '\u{FF01}'..='\u{FF5E}' => {
                out.push(char::from_u32(c as u32 - 0xFF01 + 0x21).expect("ASCII range"))
            }
            '\u{3000}' => out.push(' '),
            '‘' | '’' | '‚' | '‛' => out.push('\''),
            '“' | '”' | '„' | '‟' => out.push('"'),
            '\u{2028}' | '\u{2029}' | '\u{85}' => out.push('\n'),
            c if is_removed_control(c) => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn undoes_utf8_read_as_cp1252() {
        assert_eq!(
            fix_text("The Mona Lisa doesnâ€™t have eyebrows."),
            "The Mona Lisa doesn't have eyebrows."
        );
        assert_eq!(fix_text("cafÃ© au lait"), "café au lait");
        // Twice-garbled text is repaired in two rounds.
        assert_eq!(fix_text("cafÃƒÂ© au lait"), "café au lait");
    }

    #[test]
    fn leaves_real_accents_and_plain_text_alone() {
        assert!(matches!(fix_text("plain ascii"), Cow::Borrowed(_)));
        assert_eq!(fix_text("café naïve Ærø"), "café naïve Ærø");
    }

    #[test]
    fn entities_quotes_ligatures_width_and_breaks() {
        assert_eq!(fix_text("fish &amp; chips &lt;3"), "fish & chips <3");
        assert_eq!(fix_text("<p>&amp;</p>"), "<p>&amp;</p>");
        assert_eq!(fix_text("“quoted” ‘x’"), "\"quoted\" 'x'");
        assert_eq!(fix_text("ﬁne ＡＢＣ"), "fine ABC");
        assert_eq!(fix_text("a\r\nb\rc\u{2028}d"), "a\nb\nc\nd");
        assert_eq!(fix_text("x\u{0}y\u{feff}\x1b[31mred"), "xyred");
        assert_eq!(fix_text("e\u{301}"), "é");
    }
}
