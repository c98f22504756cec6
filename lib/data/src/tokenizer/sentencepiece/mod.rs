//! SentencePiece `.model` files read without the C++ library: the model protobuf is decoded
//! here (pieces, the trainer's model type and special pieces, the normalizer), and text is
//! encoded as `sentencepiece.SentencePieceProcessor.encode_as_ids` (0.2.x) does, id for id:
//! the normalizer (`normalizer`), then the unigram Viterbi (`unigram`) or BPE merges by score,
//! with byte fallback or one `<unk>` per run of characters no piece covers.
//!
//! Megatron's three wrappers share it: `GPTSentencePieceTokenizer` (the model's own ids, eod =
//! eos), `Llama2Tokenizer` (BOS first) and `SentencePieceTokenizer` (special tokens added after
//! the pieces and recognised in raw text, eod = `<EOD>`).

mod normalizer;
mod unigram;

use std::collections::HashMap;
use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};

use normalizer::{Charsmap, Normalizer, UserDefined, SPACE};
use unigram::{Candidate, Lattice, UNKNOWN_PENALTY};

use super::{unknown_id, Tokenizer, TokenizerError};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelType {
    Unigram,
    Bpe,
}

/// The decoded `ModelProto` and what encoding needs from it.
pub struct SentencePieceModel {
    pieces: Vec<(String, f32, PieceType)>,
    /// Normal, user-defined and unused pieces by text (the C++ library's piece trie).
    ids: HashMap<String, u32>,
    model_type: ModelType,
    byte_fallback: bool,
    unk_id: u32,
    /// How `decode` shows an unknown piece.
    unk_surface: String,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    normalizer: Normalizer,
    /// The model's rules applied to decoded text, if it has any.
    denormalizer: Option<Normalizer>,
    /// The unigram model's pieces for segmentation.
    lattice: Lattice,
    min_score: f32,
    /// `<0xAB>` pieces by byte.
    byte_ids: Vec<Option<u32>>,
}

/// A protobuf reader over one message's bytes.
struct Fields<'a> {
    bytes: &'a [u8],
    at: usize,
}

enum Value<'a> {
    Varint(u64),
    Fixed32(u32),
    Fixed64,
    Bytes(&'a [u8]),
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self.bytes.get(self.at)?;
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// The next `(field number, value)`; `Err` on malformed bytes.
    fn next_field(&mut self) -> Option<Result<(u64, Value<'a>), ()>> {
        if self.at >= self.bytes.len() {
            return None;
        }
        let Some(key) = self.varint() else {
            return Some(Err(()));
        };
        let value = match key & 7 {
            0 => self.varint().map(Value::Varint),
            1 => {
                self.at += 8;
                (self.at <= self.bytes.len()).then_some(Value::Fixed64)
            }
            2 => self.varint().and_then(|n| {
                let end = self.at.checked_add(n as usize)?;
                let slice = self.bytes.get(self.at..end)?;
                self.at = end;
                Some(Value::Bytes(slice))
            }),
            5 => self.bytes.get(self.at..self.at + 4).map(|b| {
                self.at += 4;
                Value::Fixed32(u32::from_le_bytes(b.try_into().expect("4 bytes")))
            }),
            _ => None,
        };
        Some(value.map(|v| (key >> 3, v)).ok_or(()))
    }
}

fn fields(bytes: &[u8]) -> Fields<'_> {
    Fields { bytes, at: 0 }
}

impl SentencePieceModel {
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        let bytes = std::fs::read(path).map_err(|e| TokenizerError::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::from_bytes(&bytes).map_err(|reason| TokenizerError::File {
            path: path.to_path_buf(),
            reason: format!("not a SentencePiece model: {reason}"),
        })
    }

    fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let malformed = |what: &str| format!("malformed {what}");
        let text =
            |t: &[u8], what: &str| String::from_utf8(t.to_vec()).map_err(|_| malformed(what));
        let mut pieces = Vec::new();
        let (mut model_type, mut byte_fallback) = (ModelType::Unigram, false);
        let mut special: [String; 3] = ["<s>".into(), "</s>".into(), "<pad>".into()];
        let mut unk_surface = " \u{2047} ".to_string();
        let (mut normalizer, mut denormalizer) = (Normalizer::with_spec_defaults(), None);
        let mut model = fields(bytes);
        while let Some(field) = model.next_field() {
            match field.map_err(|_| malformed("model"))? {
                (1, Value::Bytes(piece)) => {
                    let (mut piece_text, mut score, mut kind) =
                        (String::new(), 0.0, PieceType::Normal);
                    let mut f = fields(piece);
                    while let Some(field) = f.next_field() {
                        match field.map_err(|_| malformed("piece"))? {
                            (1, Value::Bytes(t)) => piece_text = text(t, "piece text")?,
                            (2, Value::Fixed32(s)) => score = f32::from_bits(s),
                            (3, Value::Varint(t)) => {
                                kind = match t {
                                    2 => PieceType::Unknown,
                                    3 => PieceType::Control,
                                    4 => PieceType::UserDefined,
                                    5 => PieceType::Unused,
                                    6 => PieceType::Byte,
                                    _ => PieceType::Normal,
                                }
                            }
                            _ => {}
                        }
                    }
                    if piece_text.is_empty() {
                        return Err(format!("piece {} is empty", pieces.len()));
                    }
                    pieces.push((piece_text, score, kind));
                }
                (2, Value::Bytes(trainer)) => {
                    let mut f = fields(trainer);
                    while let Some(field) = f.next_field() {
                        match field.map_err(|_| malformed("trainer spec"))? {
                            (3, Value::Varint(t)) => {
                                model_type = match t {
                                    1 => ModelType::Unigram,
                                    2 => ModelType::Bpe,
                                    other => {
                                        return Err(format!(
                                            "model type {} is not supported (unigram and BPE are)",
                                            match other {
                                                3 => "WORD".to_string(),
                                                4 => "CHAR".to_string(),
                                                n => n.to_string(),
                                            }
                                        ))
                                    }
                                }
                            }
                            (24, Value::Varint(b)) => {
                                normalizer.treat_whitespace_as_suffix = b != 0
                            }
                            (35, Value::Varint(b)) => byte_fallback = b != 0,
                            (44, Value::Bytes(t)) => unk_surface = text(t, "unknown surface")?,
                            (46, Value::Bytes(t)) => special[0] = text(t, "bos piece")?,
                            (47, Value::Bytes(t)) => special[1] = text(t, "eos piece")?,
                            (48, Value::Bytes(t)) => special[2] = text(t, "pad piece")?,
                            _ => {}
                        }
                    }
                }
                (3, Value::Bytes(spec)) => read_normalizer_spec(spec, &mut normalizer)?,
                (5, Value::Bytes(spec)) => {
                    let mut spec_normalizer = Normalizer::with_spec_defaults();
                    read_normalizer_spec(spec, &mut spec_normalizer)?;
                    denormalizer = spec_normalizer
                        .charsmap
                        .is_some()
                        .then_some(spec_normalizer);
                }
                _ => {}
            }
        }
        if pieces.is_empty() {
            return Err("it has no pieces".into());
        }
        if model_type == ModelType::Unigram {
            if let Some((text, ..)) = pieces.iter().find(|p| !p.1.is_finite()) {
                return Err(format!(
                    "piece {text:?} has a score that is NaN or infinite"
                ));
            }
        }
        let mut ids = HashMap::new();
        let mut byte_ids = vec![None; 256];
        let mut unk_id = None;
        for (i, (text, _, kind)) in pieces.iter().enumerate() {
            let i = i as u32;
            match kind {
                PieceType::Normal | PieceType::UserDefined | PieceType::Unused => {
                    if ids.insert(text.clone(), i).is_some() {
                        return Err(format!("piece {text:?} is defined twice"));
                    }
                }
                PieceType::Unknown if unk_id.is_some() => {
                    return Err("it has more than one unknown piece".into())
                }
                PieceType::Unknown => unk_id = Some(i),
                PieceType::Byte => {
                    if let Some(b) = text
                        .strip_prefix("<0x")
                        .and_then(|t| t.strip_suffix('>'))
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                    {
                        byte_ids[b as usize] = Some(i);
                    }
                }
                PieceType::Control => {}
            }
        }
        normalizer.user_defined = UserDefined::new(
            pieces
                .iter()
                .filter(|p| p.2 == PieceType::UserDefined)
                .map(|p| p.0.as_str()),
        );
        // As `SentencePieceProcessor`: the special ids are those of the trainer's named
        // pieces, where those are control pieces.
        let control = |name: &str| {
            pieces
                .iter()
                .position(|p| p.0 == name && p.2 == PieceType::Control)
                .map(|i| i as u32)
        };
        let [bos, eos, pad] = &special;
        Ok(SentencePieceModel {
            lattice: Lattice::new(
                pieces
                    .iter()
                    .enumerate()
                    .filter_map(|(i, (text, score, kind))| {
                        let candidate = match kind {
                            PieceType::Normal => Candidate::Scored(*score),
                            PieceType::UserDefined => Candidate::UserDefined,
                            _ => return None,
                        };
                        Some((text.clone(), i as u32, candidate))
                    })
                    .collect(),
            ),
            min_score: pieces
                .iter()
                .filter(|p| p.2 == PieceType::Normal)
                .map(|p| p.1)
                .fold(f32::MAX, f32::min),
            unk_id: unk_id.ok_or("it has no unknown piece")?,
            unk_surface,
            bos_id: control(bos),
            eos_id: control(eos),
            pad_id: control(pad),
            pieces,
            ids,
            model_type,
            byte_fallback,
            normalizer,
            denormalizer,
            byte_ids,
        })
    }

    pub fn piece_count(&self) -> usize {
        self.pieces.len()
    }

    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied().or_else(|| {
            self.pieces
                .iter()
                .position(|p| p.0 == piece)
                .map(|i| i as u32)
        })
    }

    /// A normal, user-defined or unused piece's id and type.
    fn lookup(&self, piece: &str) -> Option<(u32, PieceType)> {
        let &id = self.ids.get(piece)?;
        Some((id, self.pieces[id as usize].2))
    }

    /// Appends the model's ids of `text` (`encode_as_ids`).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let normalized = self.normalizer.normalize(text);
        if normalized.is_empty() {
            return;
        }
        let pieces = match self.model_type {
            ModelType::Unigram => {
                unigram::segment(&normalized, &self.lattice, self.min_score - UNKNOWN_PENALTY)
            }
            ModelType::Bpe => self.merge_by_score(&normalized),
        };
        let mut previous_unknown = false;
        for (span, step) in pieces {
            match step {
                Some(id) => {
                    out.push(id);
                    previous_unknown = false;
                }
                None if self.byte_fallback => {
                    for b in normalized[span].bytes() {
                        out.push(self.byte_ids[b as usize].unwrap_or(self.unk_id));
                    }
                    previous_unknown = true;
                }
                None => {
                    // SentencePiece reports a run of unknown characters as one <unk>.
                    if !previous_unknown {
                        out.push(self.unk_id);
                    }
                    previous_unknown = true;
                }
            }
        }
    }

    /// The BPE model: start from characters (a user-defined piece is one symbol that never
    /// merges) and repeatedly join the adjacent pair whose joined text is the highest-scoring
    /// piece (the leftmost on ties), through a priority queue as SentencePiece does, so a long
    /// text costs O(n log n). A merge into an unused piece is undone at the end.
    fn merge_by_score<'t>(&self, text: &'t str) -> Vec<(std::ops::Range<usize>, unigram::Step)> {
        #[derive(Clone, Copy)]
        struct Symbol {
            start: usize,
            end: usize,
            prev: Option<usize>,
            next: Option<usize>,
            alive: bool,
            frozen: bool,
        }
        struct Pair {
            score: f32,
            left: usize,
            right: usize,
            span: (usize, usize),
        }
        impl PartialEq for Pair {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for Pair {}
        impl PartialOrd for Pair {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
        impl Ord for Pair {
            // The highest score first, then the leftmost.
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                self.score
                    .total_cmp(&other.score)
                    .then(other.span.0.cmp(&self.span.0))
            }
        }
        let mut symbols: Vec<Symbol> = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let rest = &text[at..];
            let user_defined = self.normalizer.user_defined.longest_prefix(rest.as_bytes());
            let length =
                user_defined.unwrap_or_else(|| rest.chars().next().map_or(1, char::len_utf8));
            let index = symbols.len();
            symbols.push(Symbol {
                start: at,
                end: at + length,
                prev: index.checked_sub(1),
                next: (at + length < text.len()).then_some(index + 1),
                alive: true,
                frozen: user_defined.is_some(),
            });
            at += length;
        }
        // Unused pieces made by a merge: the length of the left part of the latest merge
        // into each (by text, as SentencePiece keeps it).
        let mut unmerge: HashMap<&str, usize> = HashMap::new();
        let mut queue = std::collections::BinaryHeap::new();
        let push = |queue: &mut std::collections::BinaryHeap<Pair>,
                    unmerge: &mut HashMap<&'t str, usize>,
                    symbols: &[Symbol],
                    left: usize,
                    right: usize| {
            if symbols[left].frozen || symbols[right].frozen {
                return;
            }
            let span = (symbols[left].start, symbols[right].end);
            if let Some((id, kind)) = self.lookup(&text[span.0..span.1]) {
                if kind == PieceType::Unused {
                    unmerge.insert(&text[span.0..span.1], symbols[left].end - span.0);
                }
                queue.push(Pair {
                    score: self.pieces[id as usize].1,
                    left,
                    right,
                    span,
                });
            }
        };
        for i in 1..symbols.len() {
            push(&mut queue, &mut unmerge, &symbols, i - 1, i);
        }
        while let Some(pair) = queue.pop() {
            let (left, right) = (pair.left, pair.right);
            let current = symbols[left].alive
                && symbols[right].alive
                && symbols[left].next == Some(right)
                && (symbols[left].start, symbols[right].end) == pair.span;
            if !current {
                continue;
            }
            symbols[left].end = symbols[right].end;
            symbols[right].alive = false;
            symbols[left].next = symbols[right].next;
            if let Some(next) = symbols[right].next {
                symbols[next].prev = Some(left);
            }
            if let Some(prev) = symbols[left].prev {
                push(&mut queue, &mut unmerge, &symbols, prev, left);
            }
            if let Some(next) = symbols[left].next {
                push(&mut queue, &mut unmerge, &symbols, left, next);
            }
        }
        let mut out = Vec::new();
        for symbol in symbols.iter().filter(|s| s.alive) {
            self.resegment(text, symbol.start..symbol.end, &unmerge, 0, &mut out);
        }
        out
    }

    /// A final BPE symbol as pieces: itself, or for an unused piece the two symbols it was
    /// merged from (recursively, at most 100 deep as in SentencePiece).
    fn resegment(
        &self,
        text: &str,
        span: std::ops::Range<usize>,
        unmerge: &HashMap<&str, usize>,
        depth: usize,
        out: &mut Vec<(std::ops::Range<usize>, unigram::Step)>,
    ) {
        let piece = &text[span.clone()];
        let (found, split) = (self.lookup(piece), unmerge.get(piece));
        match (found, split) {
            (Some((id, _)), _) if depth > 100 => out.push((span, Some(id))),
            (Some((_, PieceType::Unused)), Some(&left)) => {
                let split = span.start + left;
                self.resegment(text, span.start..split, unmerge, depth + 1, out);
                self.resegment(text, split..span.end, unmerge, depth + 1, out);
            }
            (Some((id, kind)), _) if kind != PieceType::Unused => out.push((span, Some(id))),
            _ => out.push((span, None)),
        }
    }

    /// `decode_ids` as the C++ library's: pieces joined with `▁` as spaces; until some text
    /// is out, a leading `▁` dropped from each piece (from the first one only when
    /// `remove_extra_whitespaces` is off); runs of byte pieces as UTF-8 with U+FFFD for each
    /// byte that starts no valid character; control pieces as nothing, unknown ones as the
    /// trainer's `unk_surface`; then the model's denormalization rules, if any.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut text = String::new();
        let mut bytes = Vec::new();
        let strip = self.normalizer.add_dummy_prefix || self.normalizer.remove_extra_whitespaces;
        let mut at_start = true;
        for &id in ids {
            let (piece, _, kind) = self
                .pieces
                .get(id as usize)
                .ok_or_else(|| unknown_id(id, self.pieces.len()))?;
            if *kind == PieceType::Byte {
                if let Some(byte) = self.byte_ids.iter().position(|b| *b == Some(id)) {
                    bytes.push(byte as u8);
                    continue;
                }
            }
            push_bytes(&mut text, &mut bytes);
            at_start &= text.is_empty();
            if *kind == PieceType::Control {
                continue;
            }
            let mut piece = piece.as_str();
            let mut stripped = false;
            if at_start && strip {
                if let Some(rest) = piece.strip_prefix(SPACE) {
                    piece = rest;
                    stripped = !self.normalizer.remove_extra_whitespaces;
                }
            }
            if *kind == PieceType::Unknown {
                text.push_str(&self.unk_surface);
            } else {
                text.push_str(&piece.replace(SPACE, " "));
            }
            at_start &= !stripped && text.is_empty();
        }
        push_bytes(&mut text, &mut bytes);
        Ok(match &self.denormalizer {
            Some(rules) => rules.normalize(&text),
            None => text,
        })
    }
}

/// A `NormalizerSpec` message's charsmap and whitespace options into `normalizer`.
fn read_normalizer_spec(spec: &[u8], normalizer: &mut Normalizer) -> Result<(), String> {
    let mut f = fields(spec);
    while let Some(field) = f.next_field() {
        match field.map_err(|_| "malformed normalizer spec".to_string())? {
            (2, Value::Bytes(map)) if !map.is_empty() => {
                normalizer.charsmap = Some(Charsmap::from_bytes(map)?)
            }
            (3, Value::Varint(b)) => normalizer.add_dummy_prefix = b != 0,
            (4, Value::Varint(b)) => normalizer.remove_extra_whitespaces = b != 0,
            (5, Value::Varint(b)) => normalizer.escape_whitespaces = b != 0,
            _ => {}
        }
    }
    Ok(())
}

/// Appends (and clears) a run of byte pieces' bytes: valid UTF-8 as it is, U+FFFD for each byte
/// that starts no valid character.
fn push_bytes(text: &mut String, bytes: &mut Vec<u8>) {
    let mut rest = &bytes[..];
    while !rest.is_empty() {
        match std::str::from_utf8(rest) {
            Ok(valid) => {
                text.push_str(valid);
                break;
            }
            Err(e) => {
                let (valid, invalid) = rest.split_at(e.valid_up_to());
                text.push_str(std::str::from_utf8(valid).expect("checked as valid"));
                text.push(char::REPLACEMENT_CHARACTER);
                rest = &invalid[1..];
            }
        }
    }
    bytes.clear();
}

/// Which of Megatron's SentencePiece wrappers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SentencePieceFlavor {
    /// `SentencePieceTokenizer`: special tokens appended to the vocabulary.
    Megatron,
    /// `GPTSentencePieceTokenizer`: the model's ids, eod = eos.
    Gpt,
    /// `Llama2Tokenizer`: the model's ids after BOS, eod = eos.
    Llama2,
}

pub struct SentencePiece {
    model: SentencePieceModel,
    flavor: SentencePieceFlavor,
    /// Added tokens (`SentencePieceTokenizer`): text and id, in registration order.
    added: Vec<(String, u32)>,
    eod: Option<u32>,
    /// The ids of the added tokens by role (`SentencePieceTokenizer` only).
    specials: Option<MegatronSpecialIds>,
    /// Finds the added tokens' texts in one pass, the leftmost first and, where several start
    /// there, the first registered: the match Megatron's search loop takes.
    added_matcher: Option<AhoCorasick>,
}

/// The special tokens Megatron's `SentencePieceTokenizer` registers, by role: the masked-LM
/// datasets read them as the tokenizer's `cls`, `sep`, `mask`, `pad`, `bos`, `eos` and
/// `additional_special_tokens_ids`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MegatronSpecialIds {
    pub cls: u32,
    pub sep: u32,
    pub eod: u32,
    pub mask: u32,
    pub pad: u32,
    pub bos: u32,
    pub eos: u32,
    /// `<extra_id_0>`.. (`--vocab-extra-ids`) in order.
    pub extra_ids: Vec<u32>,
}

impl SentencePiece {
    pub fn from_file(
        path: &Path,
        flavor: SentencePieceFlavor,
        extra_ids: usize,
    ) -> Result<Self, TokenizerError> {
        let model = SentencePieceModel::from_file(path)?;
        let mut added: Vec<(String, u32)> = Vec::new();
        let mut eod = model.eos_id;
        let mut specials = None;
        if flavor == SentencePieceFlavor::Megatron {
            // Megatron's `_SentencePieceTokenizer._initalize`: <CLS>, <SEP>, <EOD>, <MASK>, then
            // the model's pad/bos/eos pieces or new ones, then the T5 sentinels.
            let mut next = model.piece_count() as u32;
            let mut add = |text: String| -> u32 {
                if let Some((_, id)) = added.iter().find(|(t, _)| *t == text) {
                    return *id;
                }
                let id = match model.piece_id(&text) {
                    Some(id) => id,
                    None => {
                        next += 1;
                        next - 1
                    }
                };
                added.push((text, id));
                id
            };
            let (cls, sep, eod_id, mask) = (
                add("<CLS>".into()),
                add("<SEP>".into()),
                add("<EOD>".into()),
                add("<MASK>".into()),
            );
            let [pad, bos, eos] = [
                (model.pad_id, "<PAD>"),
                (model.bos_id, "<BOS>"),
                (model.eos_id, "<EOS>"),
            ]
            .map(|(id, fallback)| {
                add(match id {
                    Some(id) => model.pieces[id as usize].0.clone(),
                    None => fallback.to_string(),
                })
            });
            let extra_ids = (0..extra_ids)
                .map(|i| add(format!("<extra_id_{i}>")))
                .collect();
            eod = Some(eod_id);
            specials = Some(MegatronSpecialIds {
                cls,
                sep,
                eod: eod_id,
                mask,
                pad,
                bos,
                eos,
                extra_ids,
            });
        }
        let added_matcher = (!added.is_empty())
            .then(|| {
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostFirst)
                    .build(added.iter().map(|(text, _)| text))
            })
            .transpose()
            .map_err(|e| TokenizerError::Config(format!("the added tokens: {e}")))?;
        Ok(SentencePiece {
            model,
            flavor,
            added,
            eod,
            specials,
            added_matcher,
        })
    }

    /// The special tokens `SentencePieceTokenizer` adds (`None` for the other flavors).
    pub fn megatron_specials(&self) -> Option<&MegatronSpecialIds> {
        self.specials.as_ref()
    }

    /// Megatron's `inv_vocab[id]`: an added token's text or the model's piece.
    pub fn id_piece(&self, id: u32) -> Option<&str> {
        self.added
            .iter()
            .find(|(_, added)| *added == id)
            .map(|(text, _)| text.as_str())
            .or_else(|| self.model.pieces.get(id as usize).map(|p| p.0.as_str()))
    }
}

impl Tokenizer for SentencePiece {
    fn tokenize_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        match self.flavor {
            SentencePieceFlavor::Gpt => self.model.encode_into(text, out),
            SentencePieceFlavor::Llama2 => {
                out.extend(self.model.bos_id);
                self.model.encode_into(text, out);
            }
            SentencePieceFlavor::Megatron => {
                // The earliest special-token text becomes its id; the text between is encoded.
                let mut at = 0;
                if let Some(matcher) = &self.added_matcher {
                    for found in matcher.find_iter(text) {
                        self.model.encode_into(&text[at..found.start()], out);
                        out.push(self.added[found.pattern().as_usize()].1);
                        at = found.end();
                    }
                }
                self.model.encode_into(&text[at..], out);
            }
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        let added = self.added.iter().map(|(_, id)| *id as usize + 1).max();
        added.unwrap_or(0).max(self.model.piece_count())
    }

    fn eod(&self) -> Option<u32> {
        self.eod
    }

    fn bos(&self) -> Option<u32> {
        self.model.bos_id
    }

    fn detokenize(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        if self.flavor != SentencePieceFlavor::Megatron {
            return self.model.decode(ids);
        }
        // As Megatron: each special token as its text with a space either side, the pieces
        // between them decoded.
        let mut text = String::new();
        let mut run = Vec::new();
        for &id in ids {
            match self.added.iter().find(|(_, a)| *a == id) {
                Some((token, _)) => {
                    text.push_str(&self.model.decode(&run)?);
                    text.push(' ');
                    text.push_str(token);
                    text.push(' ');
                    run.clear();
                }
                None => run.push(id),
            }
        }
        text.push_str(&self.model.decode(&run)?);
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut value: u64, out: &mut Vec<u8>) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn bytes_field(number: u64, bytes: &[u8], out: &mut Vec<u8>) {
        varint(number << 3 | 2, out);
        varint(bytes.len() as u64, out);
        out.extend_from_slice(bytes);
    }

    fn varint_field(number: u64, value: u64, out: &mut Vec<u8>) {
        varint(number << 3, out);
        varint(value, out);
    }

    /// A small `ModelProto`: every piece type, byte fallback, a charsmap.
    fn model_proto(model_type: u64) -> Vec<u8> {
        let mut model = Vec::new();
        let pieces: [(&str, f32, u64); 10] = [
            ("<unk>", 0.0, 2),
            ("<s>", 0.0, 3),
            ("</s>", 0.0, 3),
            ("<0x41>", 0.0, 6),
            ("<u>", 0.0, 4),
            ("zz", -1.0, 5),
            ("\u{2581}", -1.0, 1),
            ("a", -2.0, 1),
            ("b", -2.0, 1),
            ("ab", -3.0, 1),
        ];
        for (text, score, kind) in pieces {
            let mut piece = Vec::new();
            bytes_field(1, text.as_bytes(), &mut piece);
            varint(2 << 3 | 5, &mut piece);
            piece.extend(score.to_le_bytes());
            varint_field(3, kind, &mut piece);
            bytes_field(1, &piece, &mut model);
        }
        let mut trainer = Vec::new();
        varint_field(3, model_type, &mut trainer);
        varint_field(35, 1, &mut trainer);
        bytes_field(2, &trainer, &mut model);
        let mut spec = Vec::new();
        bytes_field(2, &normalizer::tests::charsmap_blob(), &mut spec);
        bytes_field(3, &spec, &mut model);
        model
    }

    #[test]
    fn corrupted_models_are_refused_or_encode_without_panicking() {
        let texts = ["", "ab a<u>b zz", "  é\u{0} A ab", "\u{fffd}\u{2581}"];
        for model_type in [1, 2] {
            let proto = model_proto(model_type);
            SentencePieceModel::from_bytes(&proto).unwrap();
            // Single-byte corruptions, a few values each: every byte of the pieces and specs,
            // a sample of the charsmap's trie units.
            let mut loaded = 0;
            let end = proto.len();
            let positions = (0..300)
                .chain((300..end - 100).step_by(31))
                .chain(end - 100..end);
            for at in positions {
                for value in [0x00, 0x01, 0x7f, 0x80, 0xff, proto[at] ^ 0x20] {
                    let mut corrupted = proto.clone();
                    corrupted[at] = value;
                    if let Ok(model) = SentencePieceModel::from_bytes(&corrupted) {
                        loaded += 1;
                        for ids in model.tokenize_all(&texts) {
                            model.decode(&ids).unwrap();
                        }
                    }
                }
            }
            assert!(loaded > 0);
        }
    }

    impl SentencePieceModel {
        fn tokenize_all(&self, texts: &[&str]) -> Vec<Vec<u32>> {
            texts
                .iter()
                .map(|text| {
                    let mut ids = Vec::new();
                    self.encode_into(text, &mut ids);
                    ids
                })
                .collect()
        }
    }
}
