//! The registration cache: live NIC registrations of caller memory indexed by address interval,
//! so registering a range equal to, or inside, a live registration reuses its memory regions
//! (one per rail) instead of pinning the pages again.
//!
//! - The cache holds no registration alive: entries are weak, and a registration is
//!   deregistered when the last region using it is gone (refcounted by its regions, which
//!   in-flight transfers hold too). Dead entries are pruned on lookup.
//! - A range that contains live registrations gets a registration of its own (later ranges
//!   inside it may reuse either).
//! - A range that overlaps a live registration without either containing the other is refused
//!   ([`Lookup::Overlap`]): a merged registration would keep pinned, and reachable by its rkey,
//!   memory that the owner of the other range may free. Register the union, or disjoint
//!   pieces.

use std::collections::BTreeMap;

/// A cached registration's key: its address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub start: u64,
    pub end: u64,
}

impl Span {
    /// `len` bytes at `start` (saturating at the top of the address space).
    pub fn new(start: u64, len: u64) -> Span {
        Span {
            start,
            end: start.saturating_add(len),
        }
    }

    fn contains(&self, other: &Span) -> bool {
        self.start <= other.start && other.end <= self.end
    }

    fn overlaps(&self, other: &Span) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// What a lookup found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Lookup<T> {
    /// A live registration contains the range: reuse it.
    Hit(T),
    /// A live registration overlaps the range without containing it or being inside it.
    Overlap(Span),
    /// Nothing to reuse: make a registration.
    Miss,
}

/// Live registrations by start address. Entries may nest (a range registered after a range
/// inside it), never partially overlap.
#[derive(Debug)]
pub(crate) struct IntervalCache<T> {
    by_start: BTreeMap<u64, Vec<Entry<T>>>,
    /// The longest entry ever inserted: entries starting more than this below a range cannot
    /// reach it, which bounds the backward scan.
    max_len: u64,
}

#[derive(Debug)]
struct Entry<T> {
    end: u64,
    value: T,
}

impl<T> Default for IntervalCache<T> {
    fn default() -> Self {
        IntervalCache {
            by_start: BTreeMap::new(),
            max_len: 0,
        }
    }
}

impl<T: Clone> IntervalCache<T> {
    /// Looks `span` up among the entries `alive` accepts (the others are pruned).
    pub fn find(&mut self, span: Span, alive: impl Fn(&T) -> bool) -> Lookup<T> {
        let lowest = span.start.saturating_sub(self.max_len);
        let mut hit = None;
        let mut overlap = None;
        let mut emptied = Vec::new();
        for (&start, entries) in self.by_start.range_mut(lowest..span.end).rev() {
            entries.retain(|e| alive(&e.value));
            if entries.is_empty() {
                emptied.push(start);
                continue;
            }
            for e in entries.iter() {
                let s = Span { start, end: e.end };
                if !s.overlaps(&span) {
                    continue;
                }
                if s.contains(&span) {
                    if hit.is_none() {
                        hit = Some(e.value.clone());
                    }
                } else if !span.contains(&s) && overlap.is_none() {
                    overlap = Some(s);
                }
            }
        }
        for start in emptied {
            self.by_start.remove(&start);
        }
        match (hit, overlap) {
            (Some(v), _) => Lookup::Hit(v),
            (None, Some(s)) => Lookup::Overlap(s),
            (None, None) => Lookup::Miss,
        }
    }

    /// Adds a registration of `span`.
    pub fn insert(&mut self, span: Span, value: T) {
        self.max_len = self.max_len.max(span.end - span.start);
        self.by_start.entry(span.start).or_default().push(Entry {
            end: span.end,
            value,
        });
    }

    /// Entries held (live or not yet pruned).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.by_start.values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashSet;

    fn span(start: u64, len: u64) -> Span {
        Span::new(start, len)
    }

    #[test]
    fn equal_and_inner_ranges_hit_partial_overlaps_are_refused_outer_ranges_miss() {
        let mut c = IntervalCache::default();
        let live = |_: &u32| true;
        assert_eq!(c.find(span(1000, 100), live), Lookup::Miss);
        c.insert(span(1000, 100), 1);
        assert_eq!(c.find(span(1000, 100), live), Lookup::Hit(1));
        assert_eq!(c.find(span(1010, 10), live), Lookup::Hit(1));
        assert_eq!(c.find(span(1099, 1), live), Lookup::Hit(1));
        assert_eq!(
            c.find(span(1050, 100), live),
            Lookup::Overlap(span(1000, 100))
        );
        assert_eq!(
            c.find(span(950, 100), live),
            Lookup::Overlap(span(1000, 100))
        );
        // Adjacent ranges do not overlap.
        assert_eq!(c.find(span(1100, 10), live), Lookup::Miss);
        assert_eq!(c.find(span(900, 100), live), Lookup::Miss);
        // A range containing the entry gets its own; both then serve ranges inside them.
        assert_eq!(c.find(span(0, 4096), live), Lookup::Miss);
        c.insert(span(0, 4096), 2);
        assert_eq!(c.find(span(1020, 8), live), Lookup::Hit(1));
        assert_eq!(c.find(span(2000, 8), live), Lookup::Hit(2));
        assert_eq!(
            c.find(span(4000, 200), live),
            Lookup::Overlap(span(0, 4096))
        );
    }

    #[test]
    fn dead_entries_are_pruned_and_never_reused() {
        let mut c = IntervalCache::default();
        let dead = RefCell::new(HashSet::new());
        let alive = |v: &u32| !dead.borrow().contains(v);
        c.insert(span(0, 1 << 30), 1);
        c.insert(span(1 << 31, 4096), 2);
        assert_eq!(c.find(span(4096, 4096), alive), Lookup::Hit(1));
        dead.borrow_mut().insert(1);
        assert_eq!(c.find(span(4096, 4096), alive), Lookup::Miss);
        assert_eq!(c.len(), 1);
        // A dead entry no longer blocks an overlapping range either.
        dead.borrow_mut().insert(2);
        assert_eq!(c.find(span((1 << 31) + 100, 8192), alive), Lookup::Miss);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn long_entries_far_below_a_range_are_found() {
        let mut c = IntervalCache::default();
        let live = |_: &u32| true;
        for i in 0..1000u64 {
            c.insert(span(1 << 40 | i << 20, 4096), 7);
        }
        c.insert(span(0, 1 << 41), 9);
        assert_eq!(c.find(span(1 << 40 | 5 << 20, 4096), live), Lookup::Hit(7));
        assert_eq!(
            c.find(span(1 << 40 | 5 << 20 | 8192, 4096), live),
            Lookup::Hit(9)
        );
        assert_eq!(
            c.find(span((1 << 41) - 10, 20), live),
            Lookup::Overlap(span(0, 1 << 41))
        );
    }
}
