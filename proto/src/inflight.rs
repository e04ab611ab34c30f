//! The in-flight table (pure logic): one slab slot per transfer, addressed by the `wr_id` of
//! every work request it posts.
//!
//! `wr_id` = `signaled` (bit 63) | generation (bits 32..62) | slot key (bits 0..32). Stale
//! generations (a completion for a slot that was already freed and reused) are ignored.
//! The slot, not the future, owns the transfer's keep-alive (its registered regions): a future that
//! is dropped or forgotten only detaches; the slot and its regions live until every signaled work
//! request has completed or been flushed.

use std::task::{Context, Poll, Waker};

use slab::Slab;

use crate::error::TransferError;

const SIGNALED_BIT: u64 = 1 << 63;
// 30 bits: bit 62 marks receive work requests (see the engine).
const GEN_MASK: u32 = 0x3fff_ffff;

/// Encodes a work request id.
pub fn encode_wr_id(key: u32, generation: u32, signaled: bool) -> u64 {
    (if signaled { SIGNALED_BIT } else { 0 })
        | (u64::from(generation & GEN_MASK) << 32)
        | u64::from(key)
}

/// Decodes a work request id into (key, generation, signaled).
pub fn decode_wr_id(wr_id: u64) -> (u32, u32, bool) {
    (
        wr_id as u32,
        ((wr_id >> 32) as u32) & GEN_MASK,
        wr_id & SIGNALED_BIT != 0,
    )
}

/// A handle to one slot: key + generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId {
    /// Slab key.
    pub key: u32,
    /// Generation (30 bits).
    pub generation: u32,
}

impl SlotId {
    /// The `wr_id` for a work request of this slot.
    pub fn wr_id(self, signaled: bool) -> u64 {
        encode_wr_id(self.key, self.generation, signaled)
    }
}

#[derive(Debug)]
struct Slot<K> {
    generation: u32,
    conn: u32,
    outstanding: u32,
    /// Signaled requests that completed successfully before any error (RC completes in order:
    /// every request posted before the n-th of them completed too).
    ok_signaled: u32,
    posting: bool,
    detached: bool,
    expired: bool,
    /// Boxed: errors are rare, and a smaller slot is moved into and out of the slab with a few
    /// register moves instead of a `memcpy` call on every transfer.
    error: Option<Box<TransferError>>,
    waker: Option<Waker>,
    /// Slots whose last work request was posted unsignaled before this slot's signaled one:
    /// they are complete once this slot is.
    covers: Vec<SlotId>,
    keepalive: K,
}

/// A transfer's failure as its slot ends: the error, and how many of its signaled requests had
/// completed successfully before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotFailure {
    /// The transfer's error.
    pub error: TransferError,
    /// Signaled requests that completed successfully before the error.
    pub ok_signaled: u32,
}

/// What a live slot still waits for: see [`InflightTable::waiting_on`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotWait {
    /// Its future has not ended posting yet.
    pub posting: bool,
    /// Signaled requests (and covering slots) it awaits.
    pub outstanding: u32,
    /// Another slot's signaled request completes it.
    pub covered: bool,
    /// It already carries an error.
    pub failed: bool,
}

/// What a completion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Routed {
    /// Counted; the transfer still has work outstanding.
    Progress,
    /// The transfer finished and its waiting future was woken.
    Finished,
    /// The transfer finished with nobody waiting; its slot and keep-alive were released.
    Released,
    /// The completion belongs to no live slot (stale generation or unknown key); ignored.
    Stale,
}

/// The table. `K` is what a slot keeps alive (registered regions in the engine).
#[derive(Debug)]
pub struct InflightTable<K> {
    slots: Slab<Slot<K>>,
    next_generation: u32,
    signaled_outstanding: u64,
    /// Emptied cover lists, reused: a coalesced batch's signaled slot covers the requests before
    /// it, and a list allocated and freed per batch was most of a small transfer's heap work.
    spare_covers: Vec<Vec<SlotId>>,
}

/// Spare cover lists kept at most (one per signaled slot of a full send queue is plenty).
const SPARE_COVERS: usize = 64;

impl<K> Default for InflightTable<K> {
    fn default() -> Self {
        InflightTable {
            slots: Slab::new(),
            next_generation: 1,
            signaled_outstanding: 0,
            spare_covers: Vec::new(),
        }
    }
}

impl<K> InflightTable<K> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table whose next slot gets `generation` (masked to 30 bits; 0 becomes 1): for
    /// tests of the generation wrap.
    pub fn starting_at_generation(generation: u32) -> Self {
        InflightTable {
            next_generation: (generation & GEN_MASK).max(1),
            ..Self::default()
        }
    }

    /// The largest generation (they wrap from it to 1; 0 is never used).
    pub const MAX_GENERATION: u32 = GEN_MASK;

    /// Number of live slots (including detached ones still waiting for the NIC).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no slot is live.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Signaled work requests posted and not yet completed, over all slots.
    pub fn signaled_outstanding(&self) -> u64 {
        self.signaled_outstanding
    }

    /// Opens a slot for a transfer on connection `conn`, in the posting state.
    pub fn insert(&mut self, conn: u32, keepalive: K) -> SlotId {
        let generation = self.next_generation;
        self.next_generation = (self.next_generation + 1) & GEN_MASK;
        if self.next_generation == 0 {
            self.next_generation = 1;
        }
        let key = self.slots.insert(Slot {
            generation,
            conn,
            outstanding: 0,
            ok_signaled: 0,
            posting: true,
            detached: false,
            expired: false,
            error: None,
            waker: None,
            covers: Vec::new(),
            keepalive,
        });
        SlotId {
            key: u32::try_from(key).expect("fewer than 2^32 transfers in flight"),
            generation,
        }
    }

    fn get(&self, id: SlotId) -> Option<&Slot<K>> {
        self.slots
            .get(id.key as usize)
            .filter(|s| s.generation == id.generation)
    }

    fn get_mut(&mut self, id: SlotId) -> Option<&mut Slot<K>> {
        self.slots
            .get_mut(id.key as usize)
            .filter(|s| s.generation == id.generation)
    }

    /// Records that `n` more signaled work requests of `id` were posted.
    pub fn add_signaled(&mut self, id: SlotId, n: u32) {
        if let Some(s) = self.get_mut(id) {
            s.outstanding += n;
        } else {
            return;
        }
        self.signaled_outstanding += u64::from(n);
    }

    /// Records that posting ended (all requests posted, or posting stopped early by an error).
    /// Returns whether the slot is already complete.
    pub fn end_posting(&mut self, id: SlotId) -> bool {
        match self.get_mut(id) {
            Some(s) => {
                s.posting = false;
                s.outstanding == 0
            }
            None => true,
        }
    }

    /// Marks the transfer failed (first error wins); it still waits for its outstanding work.
    pub fn fail(&mut self, id: SlotId, err: TransferError) {
        if let Some(s) = self.get_mut(id) {
            s.error.get_or_insert_with(|| Box::new(err));
        }
    }

    /// Marks every live transfer of `conn` failed with `err` (its QP has been moved to error, so
    /// their outstanding work will be flushed).
    pub fn fail_connection(&mut self, conn: u32, err: &TransferError) {
        for (_, s) in self.slots.iter_mut() {
            if s.conn == conn {
                s.error.get_or_insert_with(|| Box::new(err.clone()));
            }
        }
    }

    /// Routes one completion. `status` is `Err` for an error completion.
    pub fn on_completion(&mut self, wr_id: u64, status: Result<(), TransferError>) -> Routed {
        let (key, generation, signaled) = decode_wr_id(wr_id);
        let id = SlotId { key, generation };
        let Some(slot) = self.get_mut(id) else {
            return Routed::Stale;
        };
        if let Err(e) = status {
            // A flush after a real error must not hide the real error.
            slot.error.get_or_insert_with(|| Box::new(e));
        }
        if !signaled {
            // Unsignaled requests complete only in error; they hold no outstanding count.
            return Routed::Progress;
        }
        if slot.error.is_none() {
            slot.ok_signaled += 1;
        }
        slot.outstanding = slot.outstanding.saturating_sub(1);
        let done = slot.outstanding == 0 && !slot.posting;
        let detached = slot.detached;
        let waker = if done && !detached {
            slot.waker.take()
        } else {
            None
        };
        let covers = if done {
            std::mem::take(&mut slot.covers)
        } else {
            Vec::new()
        };
        self.signaled_outstanding = self.signaled_outstanding.saturating_sub(1);
        if !done {
            return Routed::Progress;
        }
        let routed = if detached {
            self.slots.remove(key as usize);
            Routed::Released
        } else {
            if let Some(w) = waker {
                w.wake();
            }
            Routed::Finished
        };
        if covers.capacity() > 0 {
            self.release_covers(covers);
        }
        routed
    }

    /// Completes the slots `covers` names and keeps the emptied list for reuse.
    fn release_covers(&mut self, mut covers: Vec<SlotId>) {
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

    /// Ends posting (as [`Self::end_posting`]) for a transfer whose future is already waiting:
    /// wakes it, or releases a detached slot, when nothing is outstanding.
    pub fn finish_posting(&mut self, id: SlotId) {
        let Some(s) = self.get_mut(id) else { return };
        s.posting = false;
        if s.outstanding > 0 {
            return;
        }
        if s.detached {
            self.slots.remove(id.key as usize);
        } else if let Some(w) = s.waker.take() {
            w.wake();
        }
    }

    /// The transfer's deadline passed: it ends now with `err` (its future is woken), while the
    /// slot and its keep-alive stay until the NIC has flushed its outstanding work. Returns whether
    /// the slot was still live and pending.
    pub fn expire(&mut self, id: SlotId, err: TransferError) -> bool {
        let Some(slot) = self.get_mut(id) else {
            return false;
        };
        if slot.expired || slot.detached || (!slot.posting && slot.outstanding == 0) {
            return false;
        }
        slot.error = Some(Box::new(err));
        slot.expired = true;
        if let Some(w) = slot.waker.take() {
            w.wake();
        }
        true
    }

    /// Polls a transfer: ready (and the slot released) once posting ended and nothing is
    /// outstanding, or at once (slot detached) when it expired; otherwise registers the waker.
    pub fn poll(&mut self, id: SlotId, cx: &mut Context<'_>) -> Poll<Result<(), TransferError>> {
        self.poll_counted(id, Some(cx)).map_err(|f| f.error)
    }

    /// [`InflightTable::poll`] without registering a waker: the result if `id` has one now.
    pub fn try_take(&mut self, id: SlotId) -> Poll<Result<(), TransferError>> {
        self.poll_counted(id, None).map_err(|f| f.error)
    }

    /// [`InflightTable::poll`] (with a waker) or [`InflightTable::try_take`] (without), a
    /// failure carrying how many of the slot's signaled requests had completed successfully
    /// before the error (read from the slot as it is released, so only a failure pays for it).
    pub fn poll_counted(
        &mut self,
        id: SlotId,
        cx: Option<&mut Context<'_>>,
    ) -> Poll<Result<(), SlotFailure>> {
        let Some(slot) = self.get_mut(id) else {
            return Poll::Ready(Err(SlotFailure {
                error: TransferError::EngineGone,
                ok_signaled: 0,
            }));
        };
        if slot.expired {
            let failure = SlotFailure {
                error: slot
                    .error
                    .as_deref()
                    .cloned()
                    .unwrap_or(TransferError::Flushed),
                ok_signaled: slot.ok_signaled,
            };
            self.detach(id);
            return Poll::Ready(Err(failure));
        }
        if slot.posting || slot.outstanding > 0 {
            if let Some(cx) = cx {
                match &slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    _ => slot.waker = Some(cx.waker().clone()),
                }
            }
            return Poll::Pending;
        }
        let slot = self.slots.remove(id.key as usize);
        let ok_signaled = slot.ok_signaled;
        Poll::Ready(slot.error.map_or(Ok(()), |error| {
            Err(SlotFailure {
                error: *error,
                ok_signaled,
            })
        }))
    }

    /// The future of `id` went away (dropped, timed out or forgotten): stop posting for it. The
    /// slot (and its keep-alive) is released now if nothing is outstanding, else when the last
    /// completion arrives. Returns whether it was released now.
    pub fn detach(&mut self, id: SlotId) -> bool {
        let Some(slot) = self.get_mut(id) else {
            return true;
        };
        slot.detached = true;
        slot.posting = false;
        slot.waker = None;
        if slot.outstanding == 0 {
            self.slots.remove(id.key as usize);
            true
        } else {
            false
        }
    }

    /// The error of an expired slot (its deadline passed), if it expired.
    pub fn expired(&self, id: SlotId) -> Option<TransferError> {
        self.get(id).filter(|s| s.expired).map(|s| {
            s.error
                .as_deref()
                .cloned()
                .unwrap_or(TransferError::Flushed)
        })
    }

    /// Whether the slot is still live.
    pub fn contains(&self, id: SlotId) -> bool {
        self.get(id).is_some()
    }

    /// What a live slot still waits for (for the log line of a transfer that timed out).
    pub fn waiting_on(&self, id: SlotId) -> Option<SlotWait> {
        let s = self.get(id)?;
        Some(SlotWait {
            posting: s.posting,
            outstanding: s.outstanding,
            covered: self.slots.iter().any(|(_, o)| o.covers.contains(&id)),
            failed: s.error.is_some(),
        })
    }

    /// Keep-alive of a live slot.
    pub fn keepalive(&self, id: SlotId) -> Option<&K> {
        self.get(id).map(|s| &s.keepalive)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WcStatus;
    use std::rc::Rc;

    /// A fake completion source: completions queued as (wr_id, status), delivered in order.
    #[derive(Default)]
    struct FakeCq(std::collections::VecDeque<(u64, Result<(), TransferError>)>);

    impl FakeCq {
        fn complete(&mut self, id: SlotId, signaled: bool) {
            self.0.push_back((id.wr_id(signaled), Ok(())));
        }
        fn fail(&mut self, id: SlotId, signaled: bool, status: WcStatus) {
            self.0
                .push_back((id.wr_id(signaled), Err(TransferError::from_status(status))));
        }
        fn drain<K>(&mut self, t: &mut InflightTable<K>) -> Vec<Routed> {
            self.0
                .drain(..)
                .map(|(w, s)| t.on_completion(w, s))
                .collect()
        }
    }

    use crate::harness::counting_waker as waker;

    #[test]
    fn wr_ids_round_trip() {
        for (k, g, s) in [(0, 1, true), (u32::MAX, GEN_MASK, false), (7, 12345, true)] {
            assert_eq!(decode_wr_id(encode_wr_id(k, g, s)), (k, g, s));
        }
    }

    #[test]
    fn completes_after_the_last_signaled_request_and_wakes_once() {
        let mut t = InflightTable::new();
        let id = t.insert(0, ());
        t.add_signaled(id, 2);
        assert!(!t.end_posting(id));
        let (count, w) = waker();
        let mut cx = Context::from_waker(&w);
        assert!(t.poll(id, &mut cx).is_pending());
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Progress]);
        assert_eq!(count.get(), 0);
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
        assert_eq!(count.get(), 1);
        assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
        assert!(t.is_empty());
        assert_eq!(t.signaled_outstanding(), 0);
    }

    #[test]
    fn try_take_registers_no_waker_so_reaping_ones_own_completion_wakes_nobody() {
        let mut t = InflightTable::new();
        let id = t.insert(0, ());
        t.add_signaled(id, 1);
        t.end_posting(id);
        assert!(t.try_take(id).is_pending());
        let (count, w) = waker();
        let mut cx = Context::from_waker(&w);
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
        assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
        assert_eq!(count.get(), 0, "no self-wake");
        assert!(t.is_empty());
        // A finished slot's result is taken once; the id is then gone.
        assert_eq!(t.try_take(id), Poll::Ready(Err(TransferError::EngineGone)));
    }

    #[test]
    fn completions_while_still_posting_do_not_finish_early() {
        let mut t = InflightTable::new();
        let id = t.insert(0, ());
        t.add_signaled(id, 1);
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Progress]);
        t.add_signaled(id, 1);
        assert!(!t.end_posting(id));
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    }

    #[test]
    fn first_error_wins_over_the_flushes_that_follow() {
        let mut t = InflightTable::new();
        let id = t.insert(3, ());
        t.add_signaled(id, 3);
        t.end_posting(id);
        let mut cq = FakeCq::default();
        // An unsignaled request fails, then the signaled ones are flushed.
        cq.fail(id, false, WcStatus::RemoteAccessError);
        cq.fail(id, true, WcStatus::WorkRequestFlushError);
        cq.fail(id, true, WcStatus::WorkRequestFlushError);
        cq.fail(id, true, WcStatus::WorkRequestFlushError);
        let routed = cq.drain(&mut t);
        assert_eq!(routed.last(), Some(&Routed::Finished));
        let (_, w) = waker();
        let r = t.poll(id, &mut Context::from_waker(&w));
        assert_eq!(
            r,
            Poll::Ready(Err(TransferError::RemoteAccess {
                status: WcStatus::RemoteAccessError
            }))
        );
    }

    #[test]
    fn a_dropped_future_keeps_memory_alive_until_the_nic_is_done() {
        let mut t = InflightTable::new();
        let region = Rc::new([0u8; 64]);
        let id = t.insert(0, Rc::clone(&region));
        t.add_signaled(id, 2);
        t.end_posting(id);
        assert!(!t.detach(id), "work outstanding: not released yet");
        assert_eq!(
            Rc::strong_count(&region),
            2,
            "the slot still holds the memory"
        );
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Progress, Routed::Released]);
        assert_eq!(
            Rc::strong_count(&region),
            1,
            "released after the last completion"
        );
        assert!(t.is_empty());
    }

    #[test]
    fn a_forgotten_future_is_the_same_as_a_pending_slot_the_nic_completes() {
        // mem::forget of the future never runs its destructor: the slot stays attached, the
        // completion wakes a stale waker, and the memory is still released when the table is.
        let mut t = InflightTable::new();
        let region = Rc::new(1u8);
        let id = t.insert(0, Rc::clone(&region));
        t.add_signaled(id, 1);
        t.end_posting(id);
        let (_, w) = waker();
        assert!(t.poll(id, &mut Context::from_waker(&w)).is_pending());
        std::mem::forget(w);
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
        assert!(t.contains(id), "result parked until polled or detached");
        drop(t);
        assert_eq!(
            Rc::strong_count(&region),
            1,
            "dropping the table releases it"
        );
    }

    #[test]
    fn detaching_while_posting_stops_posting_and_releases_when_drained() {
        let mut t = InflightTable::new();
        let id = t.insert(0, ());
        t.add_signaled(id, 1); // one chunk posted, more would have followed
        assert!(!t.detach(id));
        let mut cq = FakeCq::default();
        cq.complete(id, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Released]);
        // Detaching a slot with nothing outstanding releases at once.
        let id2 = t.insert(0, ());
        assert!(t.detach(id2));
        assert!(t.is_empty());
    }

    #[test]
    fn an_expired_transfer_returns_at_once_but_keeps_its_memory_until_flushed() {
        let mut t = InflightTable::new();
        let region = Rc::new(0u8);
        let id = t.insert(0, Rc::clone(&region));
        t.add_signaled(id, 3);
        t.end_posting(id);
        let (count, w) = waker();
        let mut cx = Context::from_waker(&w);
        assert!(t.poll(id, &mut cx).is_pending());
        let err = TransferError::Timeout(std::time::Duration::from_millis(5));
        assert!(t.expire(id, err.clone()));
        assert_eq!(count.get(), 1, "the future is woken");
        assert!(!t.expire(id, err.clone()), "expiring twice does nothing");
        assert_eq!(t.poll(id, &mut cx), Poll::Ready(Err(err)));
        assert_eq!(
            Rc::strong_count(&region),
            2,
            "memory held while the NIC may touch it"
        );
        let mut cq = FakeCq::default();
        for _ in 0..3 {
            cq.fail(id, true, WcStatus::WorkRequestFlushError);
        }
        assert_eq!(cq.drain(&mut t).last(), Some(&Routed::Released));
        assert_eq!(Rc::strong_count(&region), 1);
        // A transfer that already finished cannot expire.
        let done = t.insert(0, Rc::clone(&region));
        t.end_posting(done);
        assert!(!t.expire(done, TransferError::Flushed));
    }

    #[test]
    fn stale_generations_are_ignored_after_slot_reuse() {
        let mut t = InflightTable::new();
        let old = t.insert(0, ());
        assert!(t.detach(old));
        let new = t.insert(0, ());
        assert_eq!(old.key, new.key, "the slab reuses the key");
        assert_ne!(old.generation, new.generation);
        t.add_signaled(new, 1);
        t.end_posting(new);
        let mut cq = FakeCq::default();
        cq.complete(old, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Stale]);
        assert!(t.contains(new));
        assert_eq!(
            t.signaled_outstanding(),
            1,
            "a stale completion takes no credit"
        );
        cq.complete(new, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
    }

    #[test]
    fn failing_a_connection_marks_only_its_transfers() {
        let mut t = InflightTable::new();
        let a = t.insert(1, ());
        let b = t.insert(2, ());
        for id in [a, b] {
            t.add_signaled(id, 1);
            t.end_posting(id);
        }
        t.fail_connection(
            1,
            &TransferError::Timeout(std::time::Duration::from_secs(1)),
        );
        let mut cq = FakeCq::default();
        cq.fail(a, true, WcStatus::WorkRequestFlushError);
        cq.complete(b, true);
        cq.drain(&mut t);
        let (_, w) = waker();
        let mut cx = Context::from_waker(&w);
        assert!(matches!(
            t.poll(a, &mut cx),
            Poll::Ready(Err(TransferError::Timeout(_)))
        ));
        assert_eq!(t.poll(b, &mut cx), Poll::Ready(Ok(())));
    }

    #[test]
    fn covered_transfers_complete_with_the_signaled_one_after_them() {
        let mut t = InflightTable::new();
        // A and B posted unsignaled, C's (later) request signaled: one CQE completes all three.
        let (a, b, c) = (t.insert(0, ()), t.insert(0, ()), t.insert(0, ()));
        let (count, w) = waker();
        let mut cx = Context::from_waker(&w);
        for id in [a, b, c] {
            assert!(t.poll(id, &mut cx).is_pending());
        }
        t.add_signaled(c, 1);
        t.cover(c, a);
        t.cover(c, b);
        for id in [a, b, c] {
            t.finish_posting(id);
        }
        assert_eq!(count.get(), 0, "nothing completes before the CQE");
        assert_eq!(t.signaled_outstanding(), 1, "covers are not NIC work");
        let mut cq = FakeCq::default();
        cq.complete(c, true);
        assert_eq!(cq.drain(&mut t), vec![Routed::Finished]);
        assert_eq!(count.get(), 3, "C, then A and B, woken");
        for id in [a, b, c] {
            assert_eq!(t.poll(id, &mut cx), Poll::Ready(Ok(())));
        }
        assert!(t.is_empty());
    }

    #[test]
    fn a_covered_transfer_keeps_its_own_error_and_a_detached_one_is_released() {
        let mut t = InflightTable::new();
        let (a, b, c) = (t.insert(0, ()), t.insert(0, ()), t.insert(0, ()));
        t.add_signaled(c, 1);
        t.cover(c, a);
        t.cover(c, b);
        for id in [a, b, c] {
            t.finish_posting(id);
        }
        // B's future went away: its slot (and keep-alive) stays until C's completion.
        assert!(!t.detach(b));
        assert!(t.contains(b));
        // A's unsignaled request fails (errors always complete); C is flushed.
        let mut cq = FakeCq::default();
        cq.fail(a, false, WcStatus::RemoteAccessError);
        cq.fail(c, true, WcStatus::WorkRequestFlushError);
        cq.drain(&mut t);
        assert!(!t.contains(b), "detached and covered: released with C");
        let (_, w) = waker();
        let mut cx = Context::from_waker(&w);
        assert!(matches!(
            t.poll(a, &mut cx),
            Poll::Ready(Err(TransferError::RemoteAccess { .. }))
        ));
        assert_eq!(t.poll(c, &mut cx), Poll::Ready(Err(TransferError::Flushed)));
        assert!(t.is_empty());
    }

    #[test]
    fn covering_by_a_finished_or_unknown_slot_is_a_no_op() {
        let mut t = InflightTable::new();
        let a = t.insert(0, ());
        let gone = t.insert(0, ());
        t.finish_posting(gone);
        let (_, w) = waker();
        let mut cx = Context::from_waker(&w);
        assert_eq!(t.poll(gone, &mut cx), Poll::Ready(Ok(())));
        t.cover(gone, a);
        t.finish_posting(a);
        assert_eq!(t.poll(a, &mut cx), Poll::Ready(Ok(())));
    }
}
