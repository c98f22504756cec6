//! SentencePiece `.model` files read without the C++ library: the model protobuf is decoded
//! here (pieces, the trainer's model type and special ids, the normalizer), and text is encoded
//! as `sentencepiece.SentencePieceProcessor.encode_as_ids` does: the precompiled NFKC charsmap,
//! whitespace folding and the `▁` dummy prefix, then unigram Viterbi segmentation or BPE merges
//! by score, with byte fallback or `<unk>` for what no piece covers.
//!
//! Megatron's three wrappers share it: `GPTSentencePieceTokenizer` (the model's own ids, eod =
//! eos), `Llama2Tokenizer` (BOS first) and `SentencePieceTokenizer` (special tokens added after
//! the pieces and recognised in raw text, eod = `<EOD>`).

use std::collections::HashMap;
use std::path::Path;

use tokenizers::normalizers::Precompiled;
use tokenizers::{NormalizedString, Normalizer};

use super::{unknown_id, Tokenizer, TokenizerError};

const SPACE: char = '\u{2581}';
/// SentencePiece's penalty of an unknown character below the lowest piece score.
const UNKNOWN_PENALTY: f32 = 10.0;

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
    ids: HashMap<String, u32>,
    model_type: ModelType,
    byte_fallback: bool,
    unk_id: u32,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    pad_id: Option<u32>,
    normalizer: Option<Precompiled>,
    add_dummy_prefix: bool,
    remove_extra_whitespaces: bool,
    /// Longest piece in characters (bounds the unigram lattice).
    longest: usize,
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
        let mut pieces = Vec::new();
        let (mut model_type, mut byte_fallback) = (ModelType::Unigram, false);
        let (mut unk_id, mut bos_id, mut eos_id, mut pad_id) = (0i64, 1i64, 2i64, -1i64);
        let (mut charsmap, mut add_dummy_prefix, mut remove_extra_whitespaces) =
            (Vec::new(), true, true);
        let mut model = fields(bytes);
        while let Some(field) = model.next_field() {
            match field.map_err(|_| malformed("model"))? {
                (1, Value::Bytes(piece)) => {
                    let (mut text, mut score, mut kind) = (String::new(), 0.0, PieceType::Normal);
                    let mut f = fields(piece);
                    while let Some(field) = f.next_field() {
                        match field.map_err(|_| malformed("piece"))? {
                            (1, Value::Bytes(t)) => {
                                text = String::from_utf8(t.to_vec())
                                    .map_err(|_| malformed("piece text"))?
                            }
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
                    pieces.push((text, score, kind));
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
                            (35, Value::Varint(b)) => byte_fallback = b != 0,
                            (40, Value::Varint(v)) => unk_id = v as i32 as i64,
                            (41, Value::Varint(v)) => bos_id = v as i32 as i64,
                            (42, Value::Varint(v)) => eos_id = v as i32 as i64,
                            (43, Value::Varint(v)) => pad_id = v as i32 as i64,
                            _ => {}
                        }
                    }
                }
                (3, Value::Bytes(normalizer)) => {
                    let mut f = fields(normalizer);
                    while let Some(field) = f.next_field() {
                        match field.map_err(|_| malformed("normalizer spec"))? {
                            (2, Value::Bytes(map)) => charsmap = map.to_vec(),
                            (3, Value::Varint(b)) => add_dummy_prefix = b != 0,
                            (4, Value::Varint(b)) => remove_extra_whitespaces = b != 0,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if pieces.is_empty() {
            return Err("it has no pieces".into());
        }
        let id = |v: i64| (v >= 0 && (v as usize) < pieces.len()).then_some(v as u32);
        let normalizer = if charsmap.is_empty() {
            None
        } else {
            Some(Precompiled::from(&charsmap).map_err(|e| format!("precompiled charsmap: {e}"))?)
        };
        let ids = pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.0.clone(), i as u32))
            .collect();
        let mut byte_ids = vec![None; 256];
        for (i, (text, _, kind)) in pieces.iter().enumerate() {
            if *kind == PieceType::Byte {
                if let Some(b) = text
                    .strip_prefix("<0x")
                    .and_then(|t| t.strip_suffix('>'))
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    byte_ids[b as usize] = Some(i as u32);
                }
            }
        }
        let matchable = |k: &PieceType| matches!(k, PieceType::Normal | PieceType::UserDefined);
        Ok(SentencePieceModel {
            longest: pieces
                .iter()
                .filter(|p| matchable(&p.2))
                .map(|p| p.0.chars().count())
                .max()
                .unwrap_or(1),
            min_score: pieces
                .iter()
                .filter(|p| p.2 == PieceType::Normal)
                .map(|p| p.1)
                .fold(f32::INFINITY, f32::min),
            unk_id: id(unk_id).ok_or("it has no unknown piece")?,
            bos_id: id(bos_id),
            eos_id: id(eos_id),
            pad_id: id(pad_id),
            pieces,
            ids,
            model_type,
            byte_fallback,
            normalizer,
            add_dummy_prefix,
            remove_extra_whitespaces,
            byte_ids,
        })
    }

    pub fn piece_count(&self) -> usize {
        self.pieces.len()
    }

    pub fn piece_id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// SentencePiece's normalization: the charsmap, whitespace folding, `▁` for spaces.
    fn normalize(&self, text: &str) -> String {
        let mapped = match &self.normalizer {
            Some(normalizer) => {
                let mut normalized = NormalizedString::from(text);
                // The charsmap is a pure table lookup; it cannot fail.
                let _ = normalizer.normalize(&mut normalized);
                normalized.get().to_string()
            }
            None => text.to_string(),
        };
        if mapped.is_empty() {
            return mapped;
        }
        let mut out = String::with_capacity(mapped.len() + 3);
        if self.add_dummy_prefix {
            out.push(SPACE);
        }
        let mut previous_space = self.remove_extra_whitespaces;
        for c in mapped.chars() {
            if c == ' ' {
                if !(self.remove_extra_whitespaces && previous_space) {
                    out.push(SPACE);
                }
                previous_space = true;
            } else {
                out.push(c);
                previous_space = false;
            }
        }
        if self.remove_extra_whitespaces && out.ends_with(SPACE) && out.chars().count() > 1 {
            out.pop();
        }
        if self.remove_extra_whitespaces && out == SPACE.to_string() {
            out.clear();
        }
        out
    }

    fn matchable(&self, piece: &str) -> Option<(u32, f32)> {
        let &id = self.ids.get(piece)?;
        let (_, score, kind) = &self.pieces[id as usize];
        matches!(kind, PieceType::Normal | PieceType::UserDefined).then_some((id, *score))
    }

    /// Appends the model's ids of `text` (`encode_as_ids`).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) {
        let normalized = self.normalize(text);
        if normalized.is_empty() {
            return;
        }
        let pieces = match self.model_type {
            ModelType::Unigram => self.viterbi(&normalized),
            ModelType::Bpe => self.merge_by_score(&normalized),
        };
        let mut previous_unknown = false;
        for piece in pieces {
            match self.matchable(piece) {
                Some((id, _)) => {
                    out.push(id);
                    previous_unknown = false;
                }
                None if self.byte_fallback => {
                    for b in piece.bytes() {
                        out.push(self.byte_ids[b as usize].unwrap_or(self.unk_id));
                    }
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

    /// The unigram model's best segmentation: the highest total score, with an unknown
    /// character scored below every piece. As in SentencePiece's optimized Viterbi, the best
    /// total ending at each position is kept in single precision while a piece's candidate is
    /// summed and compared in double; on long texts the rounding decides near-ties, and a few
    /// of those (4 ids in 194,862 on the test corpora) still come out the other way.
    fn viterbi<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let starts: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        let n = starts.len() - 1;
        let unknown_score = self.min_score - UNKNOWN_PENALTY;
        // best[i]: (score, start char) of the best segmentation of the first i chars.
        let mut best: Vec<(f32, usize)> = vec![(f32::NEG_INFINITY, 0); n + 1];
        best[0] = (0.0, 0);
        for start in 0..n {
            let base = best[start].0;
            if base == f32::NEG_INFINITY {
                continue;
            }
            let mut single = false;
            for end in start + 1..=(start + self.longest).min(n) {
                if let Some((_, score)) = self.matchable(&text[starts[start]..starts[end]]) {
                    single |= end == start + 1;
                    let candidate = f64::from(base) + f64::from(score);
                    if candidate > f64::from(best[end].0) {
                        best[end] = (candidate as f32, start);
                    }
                }
            }
            if !single {
                let candidate = base + unknown_score;
                if candidate > best[start + 1].0 {
                    best[start + 1] = (candidate, start);
                }
            }
        }
        let mut pieces = Vec::new();
        let mut end = n;
        while end > 0 {
            let start = best[end].1;
            pieces.push(&text[starts[start]..starts[end]]);
            end = start;
        }
        pieces.reverse();
        pieces
    }

    /// The BPE model: start from characters and repeatedly join the adjacent pair whose joined
    /// text is the highest-scoring piece (the leftmost on ties), through a priority queue as
    /// SentencePiece does, so a long text costs O(n log n).
    fn merge_by_score<'t>(&self, text: &'t str) -> Vec<&'t str> {
        #[derive(Clone, Copy)]
        struct Symbol {
            start: usize,
            end: usize,
            prev: Option<usize>,
            next: Option<usize>,
            alive: bool,
        }
        struct Candidate {
            score: f32,
            left: usize,
            right: usize,
            span: (usize, usize),
        }
        impl PartialEq for Candidate {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == std::cmp::Ordering::Equal
            }
        }
        impl Eq for Candidate {}
        impl PartialOrd for Candidate {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
        impl Ord for Candidate {
            // The highest score first, then the leftmost.
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                self.score
                    .total_cmp(&other.score)
                    .then(other.span.0.cmp(&self.span.0))
            }
        }
        let bounds: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        let count = bounds.len() - 1;
        let mut symbols: Vec<Symbol> = (0..count)
            .map(|i| Symbol {
                start: bounds[i],
                end: bounds[i + 1],
                prev: i.checked_sub(1),
                next: (i + 1 < count).then_some(i + 1),
                alive: true,
            })
            .collect();
        let mut queue = std::collections::BinaryHeap::new();
        let push = |queue: &mut std::collections::BinaryHeap<Candidate>,
                    symbols: &[Symbol],
                    left: usize,
                    right: usize| {
            let span = (symbols[left].start, symbols[right].end);
            if let Some((_, score)) = self.matchable(&text[span.0..span.1]) {
                queue.push(Candidate {
                    score,
                    left,
                    right,
                    span,
                });
            }
        };
        for i in 1..count {
            push(&mut queue, &symbols, i - 1, i);
        }
        while let Some(candidate) = queue.pop() {
            let (left, right) = (candidate.left, candidate.right);
            let current = symbols[left].alive
                && symbols[right].alive
                && symbols[left].next == Some(right)
                && (symbols[left].start, symbols[right].end) == candidate.span;
            if !current {
                continue;
            }
            symbols[left].end = symbols[right].end;
            symbols[right].alive = false;
            symbols[left].next = symbols[right].next;
            if let Some(next) = symbols[right].next {
                symbols[next].prev = Some(left);
                push(&mut queue, &symbols, left, next);
            }
            if let Some(prev) = symbols[left].prev {
                push(&mut queue, &symbols, prev, left);
            }
        }
        symbols
            .iter()
            .filter(|s| s.alive)
            .map(|s| &text[s.start..s.end])
            .collect()
    }

    /// `decode_ids`: pieces joined, `▁` as spaces (the dummy prefix's dropped), byte pieces as
    /// bytes, control pieces as nothing.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut bytes = Vec::new();
        for &id in ids {
            let (text, _, kind) = self
                .pieces
                .get(id as usize)
                .ok_or_else(|| unknown_id(id, self.pieces.len()))?;
            match kind {
                PieceType::Control => {}
                PieceType::Byte => match self.byte_ids.iter().position(|b| *b == Some(id)) {
                    Some(byte) => bytes.push(byte as u8),
                    None => bytes.extend_from_slice(text.as_bytes()),
                },
                PieceType::Unknown => bytes.extend_from_slice(" \u{2047} ".as_bytes()),
                _ => bytes.extend_from_slice(text.replace(SPACE, " ").as_bytes()),
            }
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Ok(match text.strip_prefix(' ') {
            Some(rest) if self.add_dummy_prefix => rest.to_string(),
            _ => text,
        })
    }
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
        if flavor == SentencePieceFlavor::Megatron {
            // Megatron's `_SentencePieceTokenizer._initalize`: <CLS>, <SEP>, <EOD>, <MASK>, then
            // the model's pad/bos/eos pieces or new ones, then the T5 sentinels.
            let mut next = model.piece_count() as u32;
            let mut add = |text: String, added: &mut Vec<(String, u32)>| -> u32 {
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
            for name in ["<CLS>", "<SEP>"] {
                add(name.into(), &mut added);
            }
            eod = Some(add("<EOD>".into(), &mut added));
            add("<MASK>".into(), &mut added);
            for (id, fallback) in [
                (model.pad_id, "<PAD>"),
                (model.bos_id, "<BOS>"),
                (model.eos_id, "<EOS>"),
            ] {
                let text = match id {
                    Some(id) => model.pieces[id as usize].0.clone(),
                    None => fallback.to_string(),
                };
                add(text, &mut added);
            }
            for i in 0..extra_ids {
                add(format!("<extra_id_{i}>"), &mut added);
            }
        }
        Ok(SentencePiece {
            model,
            flavor,
            added,
            eod,
        })
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
                let mut rest = text;
                loop {
                    let next = self
                        .added
                        .iter()
                        .filter_map(|(t, id)| rest.find(t.as_str()).map(|at| (at, t, *id)))
                        .min_by_key(|(at, _, _)| *at);
                    match next {
                        Some((at, token, id)) => {
                            self.model.encode_into(&rest[..at], out);
                            out.push(id);
                            rest = &rest[at + token.len()..];
                        }
                        None => {
                            self.model.encode_into(rest, out);
                            break;
                        }
                    }
                }
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
