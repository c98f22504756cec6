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

#[derive(Clone, Copy)]
struct Best {
    score: f32,
    start: usize,
    step: Step,
}

/// The best segmentation of `text` as (byte range, step) pieces. `lookup` gives the pieces
/// the lattice may use (normal and user-defined ones, never unused or control pieces),
/// `longest` bounds their length in characters.
pub(super) fn segment(
    text: &str,
    longest: usize,
    unknown_score: f32,
    lookup: impl Fn(&str) -> Option<(u32, Candidate)>,
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
        for end in start + 1..=(start + longest).min(n) {
            let (from, to) = (bounds[start], bounds[end]);
            if let Some((id, candidate)) = lookup(&text[from..to]) {
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
