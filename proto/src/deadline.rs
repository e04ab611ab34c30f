//! Transfer deadlines: a min-heap of named entries, armed only while a transfer waits.
//!
//! Arming never reads the clock: a deadline is armed without an instant and stamped
//! (`now + timeout`) by the next [`Deadlines::pop_due`] pass, which the progress loop makes with
//! a clock it has just read. A deadline therefore never passes early: a clock cached by the loop
//! may be older than the arming (other tasks run between two of its turns, for as long as they
//! take), so stamping with it would. It may pass late by up to the time between two passes.
//! Entries of finished transfers are dropped lazily (most of them at that first pass). Arming
//! only appends to a list; the pass moves what is still live into the heap, so a transfer that
//! finishes before the next pass (most of them) never costs a heap operation.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use crate::inflight::SlotId;

/// When one waiting transfer expires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    /// The instant it passes; `None` until the clock is next read.
    pub at: Option<Instant>,
    /// The transfer's slot.
    pub slot: SlotId,
    /// Its connection (failed when the deadline passes).
    pub conn: u32,
    /// The timeout it was armed with.
    pub timeout: Duration,
}

/// The deadlines of one core, soonest first.
#[derive(Debug, Default)]
pub struct Deadlines {
    /// Armed since the last pass (not stamped yet).
    armed: Vec<Deadline>,
    /// Stamped, soonest first.
    heap: BinaryHeap<Reverse<Deadline>>,
}

/// What [`Deadlines::pop_due`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// This deadline has passed.
    Passed(Deadline),
    /// Nothing more is due at this instant.
    None,
}

impl Deadlines {
    /// Entries, including lazily dropped ones of finished transfers.
    pub fn len(&self) -> usize {
        self.armed.len() + self.heap.len()
    }

    /// Whether no entry is armed.
    pub fn is_empty(&self) -> bool {
        self.armed.is_empty() && self.heap.is_empty()
    }

    /// Forgets every entry (nothing is in flight).
    pub fn clear(&mut self) {
        self.armed.clear();
        self.heap.clear();
    }

    /// Arms `timeout` for `slot`, to start at the next [`Self::pop_due`]. When more than twice
    /// `live` entries plus 1024 are held, entries whose slot `is_live` rejects are dropped.
    pub fn arm(
        &mut self,
        slot: SlotId,
        conn: u32,
        timeout: Duration,
        live: usize,
        is_live: impl Fn(SlotId) -> bool,
    ) {
        self.armed.push(Deadline {
            at: None,
            slot,
            conn,
            timeout,
        });
        if self.len() > 2 * live + 1024 {
            self.armed.retain(|d| is_live(d.slot));
            self.heap.retain(|Reverse(d)| is_live(d.slot));
        }
    }

    /// The next deadline that has passed at `now`, if any. Unstamped entries of live slots are
    /// stamped `now + timeout` on the way (those of dead slots dropped).
    pub fn pop_due(&mut self, now: Instant, is_live: impl Fn(SlotId) -> bool) -> Due {
        for d in self.armed.drain(..) {
            // A deadline past what `Instant` can hold never passes.
            let at = now.checked_add(d.timeout);
            if at.is_some() && is_live(d.slot) {
                self.heap.push(Reverse(Deadline { at, ..d }));
            }
        }
        match self.heap.peek() {
            Some(Reverse(Deadline { at: Some(at), .. })) if *at <= now => self
                .heap
                .pop()
                .map_or(Due::None, |Reverse(d)| Due::Passed(d)),
            _ => Due::None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(key: u32) -> SlotId {
        SlotId { key, generation: 1 }
    }

    #[test]
    fn deadlines_start_at_the_first_pass_after_arming_and_pass_in_order() {
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut d = Deadlines::default();
        d.arm(slot(1), 0, Duration::from_millis(30), 8, |_| true);
        d.arm(slot(2), 0, Duration::from_millis(10), 8, |_| true);
        assert_eq!(
            d.pop_due(t0, |_| true),
            Due::None,
            "stamped at t0, nothing passed"
        );
        // Armed after the first pass: it starts at the next one (1 ms), not at t0.
        d.arm(slot(3), 0, Duration::from_millis(5), 8, |_| true);
        assert_eq!(d.pop_due(at(1), |_| true), Due::None);
        assert_eq!(
            d.pop_due(at(5), |_| true),
            Due::None,
            "t0 + 5 ms is early for slot 3"
        );
        match d.pop_due(at(7), |_| true) {
            Due::Passed(x) => assert_eq!((x.slot, x.at), (slot(3), Some(at(6)))),
            Due::None => panic!("slot 3 is due"),
        }
        assert_eq!(d.pop_due(at(7), |_| true), Due::None);
        let mut order = Vec::new();
        while let Due::Passed(x) = d.pop_due(at(40), |_| true) {
            order.push(x.slot.key);
        }
        assert_eq!(order, [2, 1]);
        assert!(d.is_empty());
    }

    #[test]
    fn finished_transfers_are_dropped_at_the_first_pass() {
        let mut d = Deadlines::default();
        d.arm(slot(1), 0, Duration::from_secs(1), 8, |_| true);
        d.arm(slot(2), 0, Duration::from_secs(1), 8, |_| true);
        assert_eq!(d.pop_due(Instant::now(), |s| s.key == 2), Due::None);
        assert_eq!(d.len(), 1, "slot 1 finished before the pass: dropped");
    }

    #[test]
    fn a_timeout_past_what_an_instant_holds_never_passes() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm(slot(1), 0, Duration::MAX, 8, |_| true);
        assert_eq!(d.pop_due(t0, |_| true), Due::None, "no overflow panic");
        assert!(d.is_empty(), "nothing left to pass");
    }

    #[test]
    fn dead_entries_are_pruned_when_the_heap_outgrows_the_live_set() {
        let mut d = Deadlines::default();
        for k in 0..1100 {
            d.arm(slot(k), 0, Duration::from_secs(1), 0, |s| s.key >= 1090);
        }
        assert!(d.len() <= 1025, "pruned to the live ones: {}", d.len());
    }
}
