//! Byte-pair merging of one pre-token in O(n log n), shared by the GPT-2 and tiktoken BPEs.
//!
//! The parts form a linked list; every adjacent pair the vocabulary can join sits in a binary
//! heap keyed by (merge rank, position of its left part). A merge relinks two parts and offers
//! the two pairs it creates; heap entries whose parts have changed since they were offered are
//! skipped when they come up. Rescanning the whole word after every merge, as the reference
//! implementations do, costs O(n²) on a long word without whitespace.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// Which pairs merge in one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MergeOrder {
    /// GPT-2's `bpe`: the lowest-ranked pair merges at each of its places, left to right in one
    /// pass, before any pair those merges create is looked at (even one of a lower rank).
    EveryOccurrence,
    /// tiktoken's `byte_pair_merge`: one merge per step, the lowest-ranked pair, the leftmost
    /// among equal ranks.
    OneAtATime,
}

/// A joinable adjacent pair: `left` is the node of its left part, `parts` the two parts as they
/// were when offered (to recognise stale entries), `merged` what joining them gives.
struct Candidate<P> {
    rank: u32,
    left: usize,
    parts: (P, P),
    merged: P,
}

impl<P> PartialEq for Candidate<P> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl<P> Eq for Candidate<P> {}
impl<P> PartialOrd for Candidate<P> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl<P> Ord for Candidate<P> {
    // Node indices follow positions in the word, so this is rank, then leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        (self.rank, self.left).cmp(&(other.rank, other.left))
    }
}

struct Word<P> {
    parts: Vec<P>,
    next: Vec<Option<usize>>,
    prev: Vec<Option<usize>>,
    alive: Vec<bool>,
}

impl<P: Copy + Eq> Word<P> {
    /// Whether `candidate`'s two parts are still adjacent and unchanged. A part only changes by
    /// growing, so it never takes a value it had before.
    fn is_current(&self, candidate: &Candidate<P>) -> bool {
        let left = candidate.left;
        self.alive[left]
            && self.parts[left] == candidate.parts.0
            && self.next[left].is_some_and(|right| self.parts[right] == candidate.parts.1)
    }

    fn candidate(
        &self,
        left: usize,
        join: &mut impl FnMut(P, P) -> Option<(u32, P)>,
    ) -> Option<Candidate<P>> {
        let right = self.next[left]?;
        let parts = (self.parts[left], self.parts[right]);
        join(parts.0, parts.1).map(|(rank, merged)| Candidate {
            rank,
            left,
            parts,
            merged,
        })
    }

    /// Joins `candidate`'s parts and offers the pairs the joined part now forms to `offer`.
    fn apply(
        &mut self,
        candidate: &Candidate<P>,
        join: &mut impl FnMut(P, P) -> Option<(u32, P)>,
        offer: &mut Vec<Reverse<Candidate<P>>>,
    ) {
        let left = candidate.left;
        let right = self.next[left].expect("a current candidate has a right part");
        self.parts[left] = candidate.merged;
        self.alive[right] = false;
        self.next[left] = self.next[right];
        if let Some(after) = self.next[right] {
            self.prev[after] = Some(left);
        }
        let before = self.prev[left].and_then(|before| self.candidate(before, join));
        let after = self.candidate(left, join);
        offer.extend(before.into_iter().chain(after).map(Reverse));
    }
}

/// Merges `parts` in place until no adjacent pair joins. `join` gives a pair's merge rank
/// (lower merges first) and the joined part, or `None` when the pair does not merge.
pub(super) fn merge<P: Copy + Eq>(
    parts: &mut Vec<P>,
    order: MergeOrder,
    mut join: impl FnMut(P, P) -> Option<(u32, P)>,
) {
    let n = parts.len();
    if n < 2 {
        return;
    }
    let mut word = Word {
        parts: std::mem::take(parts),
        next: (1..=n).map(|i| (i < n).then_some(i)).collect(),
        prev: (0..n).map(|i| i.checked_sub(1)).collect(),
        alive: vec![true; n],
    };
    let mut heap: BinaryHeap<Reverse<Candidate<P>>> = (0..n - 1)
        .filter_map(|i| word.candidate(i, &mut join))
        .map(Reverse)
        .collect();
    let mut offered = Vec::new();
    while let Some(Reverse(first)) = heap.pop() {
        if !word.is_current(&first) {
            continue;
        }
        word.apply(&first, &mut join, &mut offered);
        if order == MergeOrder::EveryOccurrence {
            // A rank belongs to one pair, and merging it never creates it again, so the
            // entries of this rank still in the heap are its remaining places, leftmost first.
            while heap.peek().is_some_and(|Reverse(c)| c.rank == first.rank) {
                let Reverse(next) = heap.pop().expect("peeked");
                if word.is_current(&next) {
                    word.apply(&next, &mut join, &mut offered);
                }
            }
        }
        heap.extend(offered.drain(..));
    }
    let mut node = Some(0);
    while let Some(i) = node {
        parts.push(word.parts[i]);
        node = word.next[i];
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// GPT-2's `bpe` loop as written in its reference: rescan for the lowest-ranked pair, then
    /// rebuild the word with every occurrence of it joined.
    pub(in crate::tokenizer) fn every_occurrence_reference<P: Copy + Eq>(
        mut word: Vec<P>,
        join: impl Fn(P, P) -> Option<(u32, P)>,
    ) -> Vec<P> {
        while word.len() > 1 {
            let best = word
                .windows(2)
                .filter_map(|w| join(w[0], w[1]).map(|(rank, merged)| (rank, w[0], w[1], merged)))
                .min_by_key(|&(rank, ..)| rank);
            let Some((_, left, right, merged)) = best else {
                break;
            };
            let mut next = Vec::with_capacity(word.len());
            let mut i = 0;
            while i < word.len() {
                if i + 1 < word.len() && word[i] == left && word[i + 1] == right {
                    next.push(merged);
                    i += 2;
                } else {
                    next.push(word[i]);
                    i += 1;
                }
            }
            word = next;
        }
        word
    }

    /// tiktoken's `byte_pair_merge` as written in its reference: rescan for the lowest
    /// (rank, position) and join that one pair.
    fn one_at_a_time_reference<P: Copy + Eq>(
        mut word: Vec<P>,
        join: impl Fn(P, P) -> Option<(u32, P)>,
    ) -> Vec<P> {
        loop {
            let best = (0..word.len().saturating_sub(1))
                .filter_map(|i| join(word[i], word[i + 1]).map(|(rank, merged)| (rank, i, merged)))
                .min_by_key(|&(rank, i, _)| (rank, i));
            let Some((_, i, merged)) = best else {
                return word;
            };
            word[i] = merged;
            word.remove(i + 1);
        }
    }

    /// Merge rules over strings: (left, right) → rank. Ranks are the rules' order, so
    /// a pair may merge before the pairs that build its parts, and a joined part may take part
    /// in a pair of lower rank than the merge that made it.
    fn rules_strategy() -> impl Strategy<Value = Vec<(String, String)>> {
        let symbol = prop::sample::select(vec!["a", "b", "c", "ab", "ba", "bc", "aa", "abc"]);
        prop::collection::vec((symbol.clone(), symbol), 0..24).prop_map(|rules| {
            rules
                .into_iter()
                .map(|(l, r)| (l.to_string(), r.to_string()))
                .collect()
        })
    }

    fn run(
        word: &str,
        rules: &[(String, String)],
        order: MergeOrder,
    ) -> (Vec<String>, Vec<String>) {
        let mut names: Vec<String> = Vec::new();
        let mut ids: HashMap<String, u32> = HashMap::new();
        let mut id = |s: &str| {
            *ids.entry(s.to_string()).or_insert_with(|| {
                names.push(s.to_string());
                names.len() as u32 - 1
            })
        };
        let mut table = HashMap::new();
        for (rank, (l, r)) in rules.iter().enumerate() {
            let merged = id(&format!("{l}{r}"));
            table.insert((id(l), id(r)), (rank as u32, merged));
        }
        let symbols: Vec<u32> = word.chars().map(|c| id(&c.to_string())).collect();
        let join = |a: u32, b: u32| table.get(&(a, b)).copied();
        let mut ours = symbols.clone();
        merge(&mut ours, order, join);
        let reference = match order {
            MergeOrder::EveryOccurrence => every_occurrence_reference(symbols, join),
            MergeOrder::OneAtATime => one_at_a_time_reference(symbols, join),
        };
        let text = |v: Vec<u32>| v.into_iter().map(|s| names[s as usize].clone()).collect();
        (text(ours), text(reference))
    }

    proptest! {
        #[test]
        fn every_occurrence_equals_gpt2_reference(word in "[abc]{0,40}", rules in rules_strategy()) {
            let (ours, reference) = run(&word, &rules, MergeOrder::EveryOccurrence);
            prop_assert_eq!(ours, reference);
        }

        #[test]
        fn one_at_a_time_equals_tiktoken_reference(word in "[abc]{0,40}", rules in rules_strategy()) {
            let (ours, reference) = run(&word, &rules, MergeOrder::OneAtATime);
            prop_assert_eq!(ours, reference);
        }
    }

    #[test]
    fn the_orders_differ_where_a_merge_makes_a_lower_ranked_pair() {
        // Joining the first "a"+"b" makes "ab"+"a", ranked lower: GPT-2 still joins the
        // second "a"+"b" first, tiktoken takes "ab"+"a" in between.
        let rules = [("ab", "a"), ("a", "b")].map(|(l, r)| (l.to_string(), r.to_string()));
        assert_eq!(
            run("abab", &rules, MergeOrder::EveryOccurrence),
            (
                vec!["ab".into(), "ab".into()],
                vec!["ab".into(), "ab".into()]
            )
        );
        assert_eq!(
            run("abab", &rules, MergeOrder::OneAtATime),
            (
                vec!["aba".into(), "b".into()],
                vec!["aba".into(), "b".into()]
            )
        );
    }

    #[test]
    fn a_long_word_costs_a_linear_number_of_pair_lookups() {
        // One merge per rank level: "a"+"a" pairs up all the way to a single part.
        let n = 1 << 20;
        let mut parts = vec![1u32; n];
        let mut lookups = 0usize;
        merge(&mut parts, MergeOrder::OneAtATime, |a, b| {
            lookups += 1;
            (a == b).then_some((a, a * 2))
        });
        assert_eq!(parts, [n as u32]);
        // n - 1 initial pairs, at most two new pairs per merge, n - 1 merges.
        assert!(lookups <= 3 * n, "{lookups} pair lookups for {n} parts");
    }
}
