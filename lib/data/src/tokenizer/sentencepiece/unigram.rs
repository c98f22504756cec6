//! The unigram model's best segmentation, bit for bit as SentencePiece's optimized Viterbi
//! (0.2.x): the best total score ending at each position in single precision, pieces tried
//! from each position shortest first, a later candidate replacing an earlier one only when
//! strictly higher, an unknown character scored 10 below the lowest piece, user-defined pieces
//! scored 0.1 per byte beyond the first (so they always win), and the running totals rebased
//! to 0 whenever they pass ±100,000, which changes how later sums round. On long documents
//! single-precision rounding decides near-ties, so any other arithmetic picks other pieces.

/// What may end a path at a position: a piece id, or `None` for an unknown character.
pub(super) type Step = Option<u32>;

/// SentencePiece's penalty of an unknown character below the lowest piece score.
pub(super) const UNKNOWN_PENALTY: f32 = 10.0;
/// Totals beyond this magnitude are rebased to keep single-precision sums accurate.
const REBASE_THRESHOLD: f32 = 100_000.0;

/// A piece the lattice may use: a normal piece with its score or a user-defined one.
#[derive(Clone, Copy)]
pub(super) enum Candidate {
    Scored(f32),
    UserDefined,
}

impl Candidate {
    /// The score of the piece spanning `bytes` bytes.
    fn score(self, bytes: usize) -> f32 {
        match self {
            Candidate::Scored(score) => score,
            Candidate::UserDefined => (0.1 * (bytes as f64 - 1.0)) as f32,
        }
    }
}

/// The pieces the lattice may use (normal and user-defined ones, never unused or control
/// pieces), sorted by text: the pieces sharing a prefix are a contiguous run, so extending a
/// candidate stops as soon as no piece continues it, as the C++ library's trie walk does.
pub(super) struct Lattice {
    pieces: Vec<(String, u32, Candidate)>,
}

impl Lattice {
    pub(super) fn new(mut pieces: Vec<(String, u32, Candidate)>) -> Self {
        pieces.sort_by(|a, b| a.0.cmp(&b.0));
        Lattice { pieces }
    }
}

#[derive(Clone, Copy)]
struct Best {
    score: f32,
    start: usize,
    step: Step,
}

/// The best segmentation of `text` as (byte range, step) pieces.
pub(super) fn segment(
    text: &str,
    lattice: &Lattice,
    unknown_score: f32,
) -> Vec<(std::ops::Range<usize>, Step)> {
    let bounds: Vec<usize> = text
        .char_indices()
        .map(|(i, _)| i)
        .chain([text.len()])
        .collect();
    let n = bounds.len() - 1;
    // best[i]: the best path over the first i characters; `None` until one reaches i.
    let mut best: Vec<Option<Best>> = vec![None; n + 1];
    best[0] = Some(Best {
        score: 0.0,
        start: 0,
        step: None,
    });
    let offer = |best: &mut Vec<Option<Best>>, end: usize, candidate: Best| {
        if best[end].is_none_or(|current| candidate.score > current.score) {
            best[end] = Some(candidate);
        }
    };
    // The furthest position any path has reached so far.
    let mut frontier = 0;
    for start in 0..n {
        let Some(here) = best[start] else {
            continue;
        };
        let mut base = here.score;
        if !(-REBASE_THRESHOLD..=REBASE_THRESHOLD).contains(&base) {
            for node in best[start..=frontier].iter_mut().flatten() {
                node.score -= base;
            }
            base = 0.0;
        }
        let mut single = false;
        // The run of pieces starting with the text from `start` to `end`: each step narrows
        // it by the next character alone, since the run shares everything before it.
        let mut run = &lattice.pieces[..];
        for end in start + 1..=n {
            let (from, to) = (bounds[start], bounds[end]);
            let (shared, next) = (
                bounds[end - 1] - from,
                &text.as_bytes()[bounds[end - 1]..to],
            );
            run = &run[run.partition_point(|p| &p.0.as_bytes()[shared..] < next)..];
            run = &run[..run.partition_point(|p| p.0.as_bytes()[shared..].starts_with(next))];
            let Some(&(ref piece, id, candidate)) = run.first() else {
                break;
            };
            if piece.len() == to - from {
                frontier = frontier.max(end);
                single |= end == start + 1;
                let score = candidate.score(to - from) + base;
                offer(
                    &mut best,
                    end,
                    Best {
                        score,
                        start,
                        step: Some(id),
                    },
                );
            }
        }
        if !single {
            frontier = frontier.max(start + 1);
            offer(
                &mut best,
                start + 1,
                Best {
                    score: unknown_score + base,
                    start,
                    step: None,
                },
            );
        }
    }
    let mut pieces = Vec::new();
    let mut end = n;
    while end > 0 {
        let node = best[end].expect("every character boundary is reached");
        pieces.push((bounds[node.start]..bounds[end], node.step));
        end = node.start;
    }
    pieces.reverse();
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces `segment` picks from `pieces` (text, score; `None` marks user-defined).
    fn pieces_of<'t>(text: &'t str, pieces: &[(&str, Option<f32>)]) -> Vec<&'t str> {
        let lowest = pieces.iter().filter_map(|p| p.1).fold(f32::MAX, f32::min);
        segment(text, &lattice(pieces), lowest - UNKNOWN_PENALTY)
            .into_iter()
            .map(|(span, _)| &text[span])
            .collect()
    }

    fn lattice(pieces: &[(&str, Option<f32>)]) -> Lattice {
        Lattice::new(
            pieces
                .iter()
                .enumerate()
                .map(|(i, (text, score))| {
                    let candidate = score.map_or(Candidate::UserDefined, Candidate::Scored);
                    (text.to_string(), i as u32, candidate)
                })
                .collect(),
        )
    }

    const LARGE: [(&str, Option<f32>); 2] = [("▁", Some(-1.0)), ("Q", Some(-39_999.0))];

    #[test]
    fn near_ties_are_decided_in_single_precision() {
        // At -80,000 "xy" (-2.003) and "x" + "y" (-1.999) round to the same f32 total; the
        // earlier candidate stays. Summed in double, "x" + "y" would win.
        let pieces = [
            LARGE.as_slice(),
            &[("x", Some(-1.0)), ("y", Some(-0.999)), ("xy", Some(-2.003))],
        ]
        .concat();
        assert_eq!(pieces_of("▁QQ▁xy", &pieces), ["▁", "Q", "Q", "▁", "xy"]);
        // Near 0 the same scores are told apart.
        assert_eq!(pieces_of("▁xy", &pieces), ["▁", "x", "y"]);
    }

    #[test]
    fn totals_beyond_100000_are_rebased_before_extending() {
        // From -119,999 on, totals restart at 0, where "v" + "w" (-2) beats "vw" (-2.003);
        // without the rebase both round to -120,001 and "vw" would stay.
        let pieces = [
            LARGE.as_slice(),
            &[("v", Some(-1.0)), ("w", Some(-1.0)), ("vw", Some(-2.003))],
        ]
        .concat();
        assert_eq!(
            pieces_of("▁QQQ▁vw", &pieces),
            ["▁", "Q", "Q", "Q", "▁", "v", "w"]
        );
    }

    #[test]
    fn user_defined_pieces_score_a_tenth_per_extra_byte() {
        // "<sep>" scores 0.4 whatever its stored score, above any split into normal pieces;
        // of two user-defined pieces over the same text the longer wins (0.4 > 0.1 + 0.2).
        let pieces = [
            ("<sep>", None),
            ("<s", None),
            ("ep>", None),
            ("<se", Some(-0.1)),
            ("p>", Some(-0.1)),
            ("a", Some(-1.0)),
        ];
        assert_eq!(pieces_of("a<sep>a", &pieces), ["a", "<sep>", "a"]);
    }

    #[test]
    fn an_uncovered_character_is_one_unknown_step() {
        let pieces = [("a", Some(-1.0)), ("b", Some(-2.0))];
        let steps = segment("aéb", &lattice(&pieces), -12.0);
        assert_eq!(steps, [(0..1, Some(0)), (1..3, None), (3..4, Some(1))]);
    }
}
