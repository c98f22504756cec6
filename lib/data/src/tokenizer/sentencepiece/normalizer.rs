//! SentencePiece's text normalization, as the C++ library applies it before segmentation:
//! at each position the longest rule of the model's precompiled charsmap (a Darts double-array
//! trie over UTF-8 bytes) or the longest user-defined piece (kept as written), else one
//! character unchanged; then whitespace folding and the `▁` escape of spaces.
//!
//! The `tokenizers` crate's `Precompiled` normalizer is not used: it applies the charsmap per
//! grapheme cluster, which composes differently (half-width katakana with their sound marks,
//! Hangul jamo) and drops stacked combining marks.

/// The whitespace escape, U+2581.
pub(super) const SPACE: &str = "\u{2581}";

/// A precompiled charsmap: `<trie size: u32 LE><double-array units><NUL-separated outputs>`.
pub(super) struct Charsmap {
    units: Vec<u32>,
    outputs: Vec<u8>,
}

impl Charsmap {
    pub(super) fn from_bytes(blob: &[u8]) -> Result<Self, String> {
        let size = blob
            .get(..4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
            .ok_or("the precompiled charsmap is shorter than its header")?;
        let trie = blob
            .get(4..4 + size)
            .filter(|_| size % 4 == 0 && size > 0)
            .ok_or("the precompiled charsmap's trie size does not fit the blob")?;
        Ok(Charsmap {
            units: trie
                .chunks_exact(4)
                .map(|u| u32::from_le_bytes(u.try_into().expect("4 bytes")))
                .collect(),
            outputs: blob[4 + size..].to_vec(),
        })
    }

    /// The longest rule matching a prefix of `input`: its length in bytes and its output.
    /// A malformed trie or output offset matches nothing, as in the C++ library.
    fn longest_match(&self, input: &[u8]) -> Option<(usize, &[u8])> {
        // Darts-clone's unit layout: bit 8 says a leaf hangs below, bits 0-7 (and bit 31 for
        // leaves) are the label, the offset to the children is bits 10-31, shifted left by 8
        // when bit 9 is set; a leaf unit holds the value in bits 0-30.
        let offset = |unit: u32| ((unit >> 10) << ((unit & (1 << 9)) >> 6)) as usize;
        let mut node = offset(*self.units.first()?);
        let mut best = None;
        for (i, &byte) in input.iter().enumerate() {
            node ^= byte as usize;
            let Some(&unit) = self.units.get(node) else {
                break;
            };
            if unit & ((1 << 31) | 0xff) != u32::from(byte) {
                break;
            }
            node ^= offset(unit);
            if (unit >> 8) & 1 == 1 {
                if let Some(&leaf) = self.units.get(node) {
                    best = Some((i + 1, (leaf & 0x7fff_ffff) as usize));
                }
            }
        }
        let (length, value) = best?;
        let output = self.outputs.get(value..)?;
        let end = output.iter().position(|&b| b == 0).unwrap_or(output.len());
        Some((length, &output[..end]))
    }
}

/// User-defined pieces by first byte, for the longest one starting a text.
#[derive(Default)]
pub(super) struct UserDefined(std::collections::HashMap<u8, Vec<String>>);

impl UserDefined {
    pub(super) fn new<'a>(pieces: impl IntoIterator<Item = &'a str>) -> Self {
        let mut by_first = std::collections::HashMap::<u8, Vec<String>>::new();
        for piece in pieces {
            if let Some(&first) = piece.as_bytes().first() {
                by_first.entry(first).or_default().push(piece.to_string());
            }
        }
        UserDefined(by_first)
    }

    /// The length in bytes of the longest user-defined piece `text` starts with.
    pub(super) fn longest_prefix(&self, text: &[u8]) -> Option<usize> {
        let candidates = self.0.get(text.first()?)?;
        candidates
            .iter()
            .filter(|piece| text.starts_with(piece.as_bytes()))
            .map(String::len)
            .max()
    }
}

/// The `NormalizerSpec` (and the trainer's whitespace placement) with the model's
/// user-defined pieces.
pub(super) struct Normalizer {
    pub(super) charsmap: Option<Charsmap>,
    pub(super) add_dummy_prefix: bool,
    pub(super) remove_extra_whitespaces: bool,
    pub(super) escape_whitespaces: bool,
    pub(super) treat_whitespace_as_suffix: bool,
    /// User-defined pieces, matched before the charsmap and never normalized.
    pub(super) user_defined: UserDefined,
}

impl Normalizer {
    /// The `NormalizerSpec` defaults: no rules, dummy prefix, extra whitespace removed,
    /// spaces escaped.
    pub(super) fn with_spec_defaults() -> Self {
        Normalizer {
            charsmap: None,
            add_dummy_prefix: true,
            remove_extra_whitespaces: true,
            escape_whitespaces: true,
            treat_whitespace_as_suffix: false,
            user_defined: UserDefined::default(),
        }
    }

    /// The normalized form of the longest rule at the start of `input` and the bytes it
    /// consumes.
    fn prefix<'a>(&'a self, input: &'a [u8]) -> (&'a [u8], usize) {
        if let Some(length) = self.user_defined.longest_prefix(input) {
            return (&input[..length], length);
        }
        if let Some((length, output)) = self
            .charsmap
            .as_ref()
            .and_then(|map| map.longest_match(input))
        {
            return (output, length);
        }
        // One character as it is. A charsmap rule may end inside a character (in a hand-made
        // model); each byte left of it becomes U+FFFD, as in the C++ library.
        let length = match input.first() {
            None => 0,
            Some(0x00..=0x7f) => 1,
            Some(0xc0..=0xdf) => 2,
            Some(0xe0..=0xef) => 3,
            Some(_) => 4,
        };
        match input.get(..length).map(std::str::from_utf8) {
            Some(Ok(_)) => (&input[..length], length),
            _ => ("\u{fffd}".as_bytes(), 1),
        }
    }

    /// `Normalizer::Normalize`: the rules applied left to right; leading, repeated and
    /// trailing spaces dropped when `remove_extra_whitespaces`; the dummy `▁` before (or,
    /// with `treat_whitespace_as_suffix`, after) the text.
    pub(super) fn normalize(&self, text: &str) -> String {
        let mut input = text.as_bytes();
        if self.remove_extra_whitespaces {
            loop {
                let (output, consumed) = self.prefix(input);
                if consumed == 0 || output != b" " {
                    break;
                }
                input = &input[consumed..];
            }
        }
        if input.is_empty() {
            return String::new();
        }
        let space: &[u8] = if self.escape_whitespaces {
            SPACE.as_bytes()
        } else {
            b" "
        };
        let mut out: Vec<u8> = Vec::with_capacity(input.len() * 3 / 2);
        if self.add_dummy_prefix && !self.treat_whitespace_as_suffix {
            out.extend_from_slice(space);
        }
        let mut previous_space = self.remove_extra_whitespaces;
        while !input.is_empty() {
            let (mut output, consumed) = self.prefix(input);
            while previous_space && output.first() == Some(&b' ') {
                output = &output[1..];
            }
            if !output.is_empty() {
                for &byte in output {
                    if byte == b' ' {
                        out.extend_from_slice(space);
                    } else {
                        out.push(byte);
                    }
                }
                previous_space = output.ends_with(b" ");
            }
            input = &input[consumed..];
            if !self.remove_extra_whitespaces {
                previous_space = false;
            }
        }
        if self.remove_extra_whitespaces {
            while out.ends_with(space) {
                out.truncate(out.len() - space.len());
            }
        }
        if self.add_dummy_prefix && self.treat_whitespace_as_suffix {
            out.extend_from_slice(space);
        }
        // Charsmap outputs are UTF-8 in every model the trainer writes; a hand-made one that
        // is not still yields text, with U+FFFD where its bytes are broken.
        String::from_utf8(out)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn normalizer() -> Normalizer {
        Normalizer::with_spec_defaults()
    }

    /// A double-array trie with the rules "a" → "A", "ab" → "X" and the byte 0xC3 → "Z",
    /// laid out by hand in Darts-clone's unit format, as a precompiled charsmap blob.
    pub(in super::super) fn charsmap_blob() -> Vec<u8> {
        let mut units = vec![0u32; 1024];
        let (leaf, has_leaf) = (1u32 << 31, 1u32 << 8);
        units[0] = 256 << 10; // root: children at 256 ^ byte
        units[256 ^ 97] = 97 | has_leaf | (512 << 10); // 'a', then at 353 ^ 512 = 865
        units[865] = leaf; // "a" → outputs[0..]
        units[865 ^ 98] = 98 | has_leaf | (128 << 10); // 'b', then at 771 ^ 128 = 899
        units[899] = leaf | 2; // "ab" → outputs[2..]
        units[256 ^ 0xc3] = 0xc3 | has_leaf | (64 << 10); // é's first byte, then at 451 ^ 64
        units[387] = leaf | 4; // "\xc3" → outputs[4..]
        let mut blob = ((units.len() * 4) as u32).to_le_bytes().to_vec();
        blob.extend(units.iter().flat_map(|u| u.to_le_bytes()));
        blob.extend(b"A\0X\0Z\0");
        blob
    }

    fn charsmap() -> Charsmap {
        Charsmap::from_bytes(&charsmap_blob()).unwrap()
    }

    #[test]
    fn the_longest_charsmap_rule_applies_at_each_position() {
        let normalizer = Normalizer {
            charsmap: Some(charsmap()),
            ..normalizer()
        };
        assert_eq!(normalizer.normalize("abac b"), "▁XAc▁b");
        // A rule ending inside a character leaves its other bytes as U+FFFD each.
        assert_eq!(normalizer.normalize("aé"), "▁AZ\u{fffd}");
    }

    #[test]
    fn a_broken_charsmap_matches_nothing_instead_of_panicking() {
        let mut blob = 8u32.to_le_bytes().to_vec();
        blob.extend([0xff; 8]);
        let normalizer = Normalizer {
            charsmap: Some(Charsmap::from_bytes(&blob).unwrap()),
            ..normalizer()
        };
        assert_eq!(normalizer.normalize("ab\u{0}"), "▁ab\u{0}");
        assert!(Charsmap::from_bytes(&[1, 0]).is_err());
        assert!(Charsmap::from_bytes(&64u32.to_le_bytes()).is_err());
    }

    #[test]
    fn whitespace_is_folded_and_escaped() {
        assert_eq!(normalizer().normalize("  a  b  "), "▁a▁b");
        assert_eq!(normalizer().normalize("   "), "");
    }

    #[test]
    fn user_defined_pieces_are_kept_as_written() {
        // Their inner spaces are escaped but not folded.
        let normalizer = Normalizer {
            user_defined: UserDefined::new(["a  b", "a  bc", "b"]),
            ..normalizer()
        };
        assert_eq!(normalizer.normalize("a  b  a  c"), "▁a▁▁b▁a▁c");
        // The longest one wins.
        assert_eq!(normalizer.normalize("a  bc  a  c"), "▁a▁▁bc▁a▁c");
    }

    #[test]
    fn whitespace_options_of_the_spec() {
        let suffix = Normalizer {
            treat_whitespace_as_suffix: true,
            ..normalizer()
        };
        assert_eq!(suffix.normalize(" hello  world "), "hello▁world▁");
        let verbatim = Normalizer {
            escape_whitespaces: false,
            remove_extra_whitespaces: false,
            ..normalizer()
        };
        assert_eq!(verbatim.normalize(" a  b "), "  a  b ");
    }
}
