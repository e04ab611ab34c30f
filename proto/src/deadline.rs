//! Transfer deadlines: a min-heap of named entries, armed only while a transfer waits.
//!
//! A deadline is armed with the clock the core last saw; one armed while the clock was stopped
//! (the progress loop parked) has no instant yet and is stamped (`now + timeout`) on the next
//! [`Deadlines::pop_due`] pass, so arming never reads the clock. Entries of finished transfers are
//! dropped lazily.

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
        self.heap.len()
    }

    /// Whether no entry is armed.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Forgets every entry (nothing is in flight).
    pub fn clear(&mut self) {
        self.heap.clear();
    }

    /// Arms `timeout` for `slot` at `clock + timeout` (`clock` `None`: stamped later). When the
    /// heap holds more than twice `live` entries plus 1024, entries whose slot `is_live` rejects
    /// are dropped.
    pub fn arm(
        &mut self,
        slot: SlotId,
        conn: u32,
        timeout: Duration,
        clock: Option<Instant>,
        live: usize,
        is_live: impl Fn(SlotId) -> bool,
    ) {
        self.heap.push(Reverse(Deadline {
            at: clock.map(|now| now + timeout),
            slot,
            conn,
            timeout,
        }));
        if self.heap.len() > 2 * live + 1024 {
            self.heap.retain(|Reverse(d)| is_live(d.slot));
        }
    }

    /// The next deadline that has passed at `now`, if any. Unstamped entries of live slots are
    /// stamped `now + timeout` on the way (those of dead slots dropped).
    pub fn pop_due(&mut self, now: Instant, is_live: impl Fn(SlotId) -> bool) -> Due {
        loop {
            let Some(Reverse(d)) = self.heap.peek().copied() else {
                return Due::None;
            };
            match d.at {
                None => {
                    self.heap.pop();
                    if is_live(d.slot) {
                        self.heap.push(Reverse(Deadline {
                            at: Some(now + d.timeout),
                            ..d
                        }));
                    }
                }
                Some(at) if at > now => return Due::None,
                Some(_) => {
                    self.heap.pop();
                    return Due::Passed(d);
                }
            }
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
    fn deadlines_pass_in_order_and_unstamped_ones_are_stamped_first() {
        let t0 = Instant::now();
        let mut d = Deadlines::default();
        d.arm(slot(1), 0, Duration::from_millis(30), Some(t0), 8, |_| true);
        d.arm(slot(2), 0, Duration::from_millis(10), Some(t0), 8, |_| true);
        d.arm(slot(3), 0, Duration::from_millis(5), None, 8, |_| true);
        assert_eq!(d.pop_due(t0, |_| true), Due::None, "nothing passed yet");
        // Slot 3 was stamped at t0 + 5 ms.
        let at = |ms| t0 + Duration::from_millis(ms);
        match d.pop_due(at(6), |_| true) {
            Due::Passed(x) => assert_eq!((x.slot, x.at), (slot(3), Some(at(5)))),
            Due::None => panic!("slot 3 is due"),
        }
        assert_eq!(d.pop_due(at(6), |_| true), Due::None);
        let mut order = Vec::new();
        while let Due::Passed(x) = d.pop_due(at(40), |_| true) {
            order.push(x.slot.key);
        }
        assert_eq!(order, [2, 1]);
        assert!(d.is_empty());
    }

    #[test]
    fn dead_entries_are_pruned_when_the_heap_outgrows_the_live_set() {
        let mut d = Deadlines::default();
        for k in 0..1100 {
            d.arm(slot(k), 0, Duration::from_secs(1), None, 0, |s| {
                s.key >= 1090
            });
        }
        assert!(d.len() <= 1025, "pruned to the live ones: {}", d.len());
    }
}
