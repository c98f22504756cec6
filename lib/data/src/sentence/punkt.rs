use super::params::PunktParameters;
use super::words::{is_non_word, is_space, is_unicode_quote, tokenize_line, Token};

/// Megatron splits texts into slices of this many characters before sentence splitting.
pub const MEGATRON_SLICE_CHARS: usize = 1_000_000;

const ORTHO_BEG_UC: u32 = 1 << 1;
const ORTHO_MID_UC: u32 = 1 << 2;
const ORTHO_UNK_UC: u32 = 1 << 3;
const ORTHO_BEG_LC: u32 = 1 << 4;
const ORTHO_MID_LC: u32 = 1 << 5;
const ORTHO_UNK_LC: u32 = 1 << 6;
const ORTHO_UC: u32 = ORTHO_BEG_UC | ORTHO_MID_UC | ORTHO_UNK_UC;
const ORTHO_LC: u32 = ORTHO_BEG_LC | ORTHO_MID_LC | ORTHO_UNK_LC;

/// A potential sentence end found by the period-context pattern (byte offsets).
struct EndContext {
    start: usize,
    end: usize,
    /// End of the look-ahead token that follows the match.
    after_end: usize,
    /// Start of the next word, when the look-ahead was whitespace and a word.
    next_tok: Option<usize>,
}

/// Whether Punkt's orthographic evidence says a word starts a sentence.
#[derive(PartialEq)]
enum Ortho {
    Starter,
    NotStarter,
    Unknown,
}

/// NLTK's `PunktSentenceTokenizer.tokenize` with pre-trained parameters.
pub struct SentenceSplitter {
    params: PunktParameters,
    keep_newlines: bool,
}

fn char_at(text: &str, i: usize) -> Option<char> {
    text.get(i..).and_then(|s| s.chars().next())
}

/// End of the run of characters satisfying `pred` starting at byte `i`.
fn run_end(text: &str, i: usize, pred: impl Fn(char) -> bool) -> usize {
    text[i..]
        .char_indices()
        .find(|&(_, c)| !pred(c))
        .map_or(text.len(), |(k, _)| i + k)
}

fn rstrip_len(text: &str) -> usize {
    text.trim_end_matches(is_space).len()
}

impl SentenceSplitter {
    /// `keep_newlines` is Megatron's `--keep-newlines`: whitespace after a sentence end stays
    /// at the end of that sentence.
    pub fn new(params: PunktParameters, keep_newlines: bool) -> Self {
        SentenceSplitter {
            params,
            keep_newlines,
        }
    }

    /// Splits a document the way Megatron does: in 1,000,000-character slices, each split
    /// independently, the sentences concatenated.
    pub fn split_document<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let cut = rest
                .char_indices()
                .nth(MEGATRON_SLICE_CHARS)
                .map_or(rest.len(), |(b, _)| b);
            out.extend(self.split(&rest[..cut]));
            rest = &rest[cut..];
        }
        out
    }

    /// The sentences of `text`, in order.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let slices = self.slices(text);
        self.realign(text, &slices)
            .into_iter()
            .map(|(s, e)| &text[s..e])
            .collect()
    }

    /// Matches of the period-context pattern that starts scanning at byte `from`.
    fn next_context(&self, text: &str, from: usize) -> Option<EndContext> {
        let mut pos = from;
        while pos < text.len() {
            let found = if self.keep_newlines {
                self.keep_newlines_context_at(text, pos)
            } else {
                self.default_context_at(text, pos)
            };
            match found {
                Ok(ctx) => return Some(ctx),
                Err(next) => pos = next,
            }
        }
        None
    }

    /// The look-ahead `(?=(?P<after_tok>NonWord|\s+(?P<next_tok>\S+)))` (without the `\s+`
    /// when `after_space` was already consumed) at byte `i`.
    fn look_ahead(text: &str, i: usize, need_space: bool) -> Option<(usize, Option<usize>)> {
        let c = char_at(text, i)?;
        if is_non_word(c) {
            return Some((i + c.len_utf8(), None));
        }
        let word_start = if need_space {
            if !is_space(c) {
                return None;
            }
            run_end(text, i, is_space)
        } else {
            i
        };
        let word_end = run_end(text, word_start, |c| !is_space(c));
        (word_end > word_start).then_some((word_end, Some(word_start)))
    }

    /// NLTK's pattern: a sentence-end character followed by the look-ahead.
    fn default_context_at(&self, text: &str, pos: usize) -> Result<EndContext, usize> {
        let c = char_at(text, pos).expect("pos is inside text");
        let end = pos + c.len_utf8();
        if matches!(c, '.' | '?' | '!') {
            if let Some((after_end, next_tok)) = Self::look_ahead(text, end, true) {
                return Ok(EndContext {
                    start: pos,
                    end,
                    after_end,
                    next_tok,
                });
            }
        }
        Err(end)
    }

    /// Megatron's `--keep-newlines` pattern `\S*[.?!]\s*` + look-ahead without leading `\s+`:
    /// the greedy `\S*` makes the last sentence-end character of the word that can be
    /// followed by a token win.
    fn keep_newlines_context_at(&self, text: &str, pos: usize) -> Result<EndContext, usize> {
        let c = char_at(text, pos).expect("pos is inside text");
        if is_space(c) {
            return Err(pos + c.len_utf8());
        }
        let word_end = run_end(text, pos, |c| !is_space(c));
        let word = &text[pos..word_end];
        for (k, ch) in word.char_indices().rev() {
            if !matches!(ch, '.' | '?' | '!') {
                continue;
            }
            let end = run_end(text, pos + k + 1, is_space);
            if let Some((after_end, next_tok)) = Self::look_ahead(text, end, false) {
                return Ok(EndContext {
                    start: pos,
                    end,
                    after_end,
                    next_tok,
                });
            }
        }
        // No later start inside this word can succeed where the whole word failed.
        Err(word_end)
    }

    /// NLTK's `_match_potential_end_contexts`: each match with the text it is judged on
    /// (the previous word, the match and the following token). A match whose previous word
    /// overlaps the preceding match's suppresses that preceding match.
    fn end_contexts(&self, text: &str) -> Vec<(EndContext, String)> {
        let mut out = Vec::new();
        let mut previous: Option<(EndContext, (usize, usize))> = None;
        let mut prev_slice = (0usize, 0usize);
        let mut from = 0;
        while let Some(m) = self.next_context(text, from) {
            from = m.end.max(m.start + 1);
            let before = &text[prev_slice.1..m.start];
            // NLTK looks for ASCII whitespace only, and treats a hit at index 0 as none.
            let last_space = before
                .bytes()
                .rposition(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c))
                .unwrap_or(0);
            let word_start = if last_space > 0 {
                prev_slice.1 + last_space + 1
            } else {
                prev_slice.0
            };
            let word_slice = (word_start, m.start);
            if let Some((pm, ps)) = previous.take() {
                if ps.1 <= word_slice.0 {
                    let context = format!("{}{}", &text[ps.0..ps.1], &text[pm.start..pm.after_end]);
                    out.push((pm, context));
                }
            }
            previous = Some((m, word_slice));
            prev_slice = word_slice;
        }
        if let Some((pm, ps)) = previous {
            let context = format!("{}{}", &text[ps.0..ps.1], &text[pm.start..pm.after_end]);
            out.push((pm, context));
        }
        out
    }

    /// NLTK's `_slices_from_text`.
    fn slices(&self, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut last_break = 0;
        for (m, context) in self.end_contexts(text) {
            if self.contains_sentbreak(&context) {
                out.push((last_break, m.end));
                last_break = m.next_tok.unwrap_or(m.end);
            }
        }
        out.push((last_break, rstrip_len(text)));
        out
    }

    /// NLTK's `_realign_boundaries`: closing quotes and brackets after a sentence end move
    /// into the sentence they close.
    fn realign(&self, text: &str, slices: &[(usize, usize)]) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut realign = 0;
        for (i, &(start, stop)) in slices.iter().enumerate() {
            let first = (start + realign, stop);
            let Some(&(next_start, next_stop)) = slices.get(i + 1) else {
                if first.0 < first.1 {
                    out.push(first);
                }
                continue;
            };
            match boundary_realignment(&text[next_start..next_stop.max(next_start)]) {
                Some((kept, consumed)) => {
                    out.push((first.0, next_start + kept));
                    realign = consumed;
                }
                None => {
                    realign = 0;
                    if first.0 < first.1 {
                        out.push(first);
                    }
                }
            }
        }
        out
    }

    /// NLTK's `text_contains_sentbreak`: a sentence break followed by at least one token.
    fn contains_sentbreak(&self, text: &str) -> bool {
        let mut tokens: Vec<Token> = text
            .split('\n')
            .filter(|line| !line.trim_matches(is_space).is_empty())
            .flat_map(tokenize_line)
            .map(Token::new)
            .collect();
        for t in &mut tokens {
            self.first_pass(t);
        }
        for i in 0..tokens.len().saturating_sub(1) {
            let (head, tail) = tokens.split_at_mut(i + 1);
            self.second_pass(&mut head[i], &tail[0]);
        }
        tokens.iter().rev().skip(1).any(|t| t.sentbreak)
    }

    fn first_pass(&self, t: &mut Token) {
        if matches!(t.tok.as_str(), "." | "?" | "!") {
            t.sentbreak = true;
        } else if t.is_ellipsis() {
            t.ellipsis = true;
        } else if t.period_final && !t.tok.ends_with("..") {
            let stem = t.tok[..t.tok.len() - 1].to_lowercase();
            let last_part = stem.rsplit('-').next().unwrap_or("");
            if self.params.abbrev_types.contains(&stem)
                || self.params.abbrev_types.contains(last_part)
            {
                t.abbr = true;
            } else {
                t.sentbreak = true;
            }
        }
    }

    fn second_pass(&self, t1: &mut Token, t2: &Token) {
        if !t1.period_final {
            return;
        }
        let typ = t1.type_no_period().to_string();
        let next_typ = t2.type_no_sentperiod();
        let is_initial = t1.is_initial();
        if self
            .params
            .collocations
            .contains(&(typ.clone(), next_typ.to_string()))
        {
            t1.sentbreak = false;
            t1.abbr = true;
            return;
        }
        if (t1.abbr || t1.ellipsis) && !is_initial {
            if self.ortho_heuristic(t2) == Ortho::Starter {
                t1.sentbreak = true;
                return;
            }
            if t2.first_upper() && self.params.sent_starters.contains(next_typ) {
                t1.sentbreak = true;
                return;
            }
        }
        if is_initial || typ == "##number##" {
            let ortho = self.ortho_heuristic(t2);
            if ortho == Ortho::NotStarter {
                t1.sentbreak = false;
                t1.abbr = true;
                return;
            }
            let context = self.ortho_context(next_typ);
            if ortho == Ortho::Unknown && is_initial && t2.first_upper() && context & ORTHO_LC == 0
            {
                t1.sentbreak = false;
                t1.abbr = true;
            }
        }
    }

    fn ortho_context(&self, typ: &str) -> u32 {
        self.params.ortho_context.get(typ).copied().unwrap_or(0)
    }

    fn ortho_heuristic(&self, t: &Token) -> Ortho {
        if matches!(t.tok.as_str(), ";" | ":" | "," | "." | "!" | "?") {
            return Ortho::NotStarter;
        }
        let context = self.ortho_context(t.type_no_sentperiod());
        if t.first_upper() && context & ORTHO_LC != 0 && context & ORTHO_MID_UC == 0 {
            return Ortho::Starter;
        }
        if t.first_lower() && (context & ORTHO_UC != 0 || context & ORTHO_BEG_LC == 0) {
            return Ortho::NotStarter;
        }
        Ortho::Unknown
    }
}

/// NLTK's `re_boundary_realignment`, `["')\]}‘’“”«»]+?(?:\s+|(?=--)|$)` (multiline), matched at
/// the start of `text`: returns (length of the match without trailing whitespace, full length).
fn boundary_realignment(text: &str) -> Option<(usize, usize)> {
    let closers = run_end(text, 0, |c| {
        matches!(c, '"' | '\'' | ')' | ']' | '}') || is_unicode_quote(c)
    });
    if closers == 0 {
        return None;
    }
    for (k, _) in text[..closers]
        .char_indices()
        .skip(1)
        .chain([(closers, ' ')])
    {
        let end = match char_at(text, k) {
            Some(c) if is_space(c) => run_end(text, k, is_space),
            Some(_) if text[k..].starts_with("--") => k,
            None => k,
            Some(_) => continue,
        };
        return Some((rstrip_len(&text[..end]), end));
    }
    None
}
