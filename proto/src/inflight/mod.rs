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

mod cover;
mod id;
#[cfg(test)]
mod tests;

use id::GEN_MASK;
pub use id::{decode_wr_id, encode_wr_id, SlotId};

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
    #[inline(always)]
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
