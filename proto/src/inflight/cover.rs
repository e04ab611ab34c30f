//! Covering: a transfer whose last work request was posted unsignaled completes with the next
//! signaled request posted after it on the same queue pair (RC completes in order). The signaled
//! slot keeps the list of slots it covers; emptied lists are kept for reuse.

use super::{InflightTable, SlotId};

/// Spare cover lists kept at most (one per signaled slot of a full send queue is plenty).
const SPARE_COVERS: usize = 64;

impl<K> InflightTable<K> {
    /// Completes the slots `covers` names and keeps the emptied list for reuse.
    pub(super) fn release_covers(&mut self, mut covers: Vec<SlotId>) {
        for &c in &covers {
            self.release_cover(c);
        }
        if self.spare_covers.len() < SPARE_COVERS {
            covers.clear();
            self.spare_covers.push(covers);
        }
    }

    /// Makes `covered` (posted, its last request unsignaled) complete when `by` completes: `by`'s
    /// signaled request was posted after it on the same queue pair, and RC completes in order.
    pub fn cover(&mut self, by: SlotId, covered: SlotId) {
        if by == covered || !self.contains(covered) {
            return;
        }
        let spare = &mut self.spare_covers;
        match self
            .slots
            .get_mut(by.key as usize)
            .filter(|s| s.generation == by.generation)
        {
            Some(b) if b.outstanding != 0 || b.posting => {
                if b.covers.capacity() == 0 {
                    if let Some(list) = spare.pop() {
                        b.covers = list;
                    }
                }
                b.covers.push(covered);
            }
            // `by` is gone or already done: `covered`'s requests are complete too.
            _ => return,
        }
        if let Some(c) = self.get_mut(covered) {
            c.outstanding += 1;
        }
    }

    fn release_cover(&mut self, id: SlotId) {
        let Some(s) = self.get_mut(id) else { return };
        s.outstanding = s.outstanding.saturating_sub(1);
        if s.outstanding > 0 || s.posting {
            return;
        }
        if s.detached {
            self.slots.remove(id.key as usize);
        } else if let Some(w) = s.waker.take() {
            w.wake();
        }
    }
}
