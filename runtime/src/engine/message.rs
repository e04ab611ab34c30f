//! Messages: SEND from a copy or from a registered region, and receive, copied or borrowed in
//! place.

use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Context, Poll};

use rixl_proto::{ConnId, Core, Delivery, HeldBuffer, Message, Posting, Received, SendOp, Sge};

use super::nic::{received_bytes, KeepAlive, MessageSlots, VerbsQueue};
use super::transfer::spawn_flush;
use super::wait::{reap_until, wait_slot, SlotGuard};
use super::{Engine, Inner};
use crate::desc::Region;
use crate::error::{InvalidDescriptor, PostError, SharedError, TransferError};

impl Engine {
    /// Sends a small message (at most `max_message` bytes) with SEND (and optional immediate).
    /// The bytes are copied into a registered message buffer first, so `msg` may be any memory;
    /// [`Self::send_from`] sends from a registered region without the copy.
    ///
    /// Messages are coalesced like small transfers: the first of a progress turn is posted at
    /// once, later ones in the same turn share the connection's next doorbell and signal.
    /// Messages sent one after another arrive in order; concurrent ones go out in the order
    /// their futures were first polled (one that waits for a free send-queue slot may be
    /// overtaken). A completed send was delivered to the peer's receive queue. A future dropped
    /// before it completes either was posted (the message arrives whole) or was still queued
    /// (it is never sent).
    ///
    /// # Errors
    /// [`InvalidDescriptor::MessageSize`] if it is empty or too large; otherwise as a transfer.
    pub async fn send(
        &self,
        conn: ConnId,
        msg: &[u8],
        imm: Option<u32>,
    ) -> Result<(), TransferError> {
        self.check_message_size(msg.len() as u64)?;
        let max = self.inner.cfg.max_message;
        let inner = Rc::clone(&self.inner);
        let slot = poll_fn(|cx| MessageSlots::take(&inner.msg_slots, cx)).await;
        let off = u64::from(slot.index * max);
        inner
            .msg_region
            .write_at(off, msg)
            .map_err(|e| TransferError::Post(PostError::Staging(SharedError::new(e))))?;
        let sge = Sge {
            addr: inner.msg_region.addr() + off,
            length: msg.len() as u32,
            lkey: inner.msg_region.lkey(),
        };
        let keep = KeepAlive {
            regions: smallvec::smallvec![inner.msg_region.clone()],
            _message: Some(slot),
        };
        // The slot goes back to the pool (waking a waiting sender) when the in-flight table
        // drops the keep-alive.
        post_message(&inner, conn, sge, true, imm, keep).await
    }

    /// Sends `len` bytes at `offset` of the registered `region` with SEND (and optional
    /// immediate), zero-copy: the NIC reads them from the region, as `ib_send_bw` sends from its
    /// buffer. The peer receives them like any message ([`Self::recv`]). Like a transfer, the
    /// in-flight table keeps the region registered until the NIC is done, even if this future
    /// is dropped; the bytes must not change until it completes. Coalesced, ordered and
    /// cancelled like [`Self::send`].
    ///
    /// # Errors
    /// [`InvalidDescriptor::MessageSize`] if `len` is 0 or over `max_message`;
    /// [`InvalidDescriptor::OutOfRange`] / [`InvalidDescriptor::Overflow`] if the bytes are not
    /// inside the region; [`InvalidDescriptor::ForeignRegion`] for another engine's region,
    /// [`InvalidDescriptor::NotRegistered`] for memory not registered with this engine's NIC;
    /// otherwise as a transfer.
    pub async fn send_from(
        &self,
        conn: ConnId,
        region: &Region,
        offset: u64,
        len: u64,
        imm: Option<u32>,
    ) -> Result<(), TransferError> {
        self.check_message_size(len)?;
        let end = offset.checked_add(len).ok_or(InvalidDescriptor::Overflow {
            side: "local",
            index: 0,
        })?;
        if end > region.len() {
            return Err(InvalidDescriptor::OutOfRange {
                index: 0,
                offset,
                len,
                region_len: region.len(),
            }
            .into());
        }
        if region.engine_id() != self.inner.id {
            return Err(InvalidDescriptor::ForeignRegion { index: 0 }.into());
        }
        if region.registration().is_none() {
            return Err(InvalidDescriptor::NotRegistered { index: 0 }.into());
        }
        let sge = Sge {
            addr: region.addr() + offset,
            length: len as u32,
            lkey: region.lkey(),
        };
        let keep = KeepAlive {
            regions: smallvec::smallvec![region.clone()],
            _message: None,
        };
        post_message(&self.inner, conn, sge, !region.is_gpu(), imm, keep).await
    }

    fn check_message_size(&self, len: u64) -> Result<(), InvalidDescriptor> {
        let max = u64::from(self.inner.cfg.max_message);
        if len == 0 || len > max {
            return Err(InvalidDescriptor::MessageSize { len, max });
        }
        Ok(())
    }

    /// Receives the next message (SEND payload or WRITE_WITH_IMM notification) on `conn`, as
    /// an owned copy. [`Self::recv_with`] reads a payload where it landed, without the copy.
    ///
    /// # Errors
    /// [`TransferError::Connection`] when the connection failed or is unknown.
    pub async fn recv(&self, conn: ConnId) -> Result<Message, TransferError> {
        next_in_inbox(&self.inner, |core, cx| match cx {
            Some(cx) => core.poll_recv(conn, cx),
            None => core.try_recv(conn),
        })
        .await
    }

    /// Receives the next message on `conn` and hands it to `f` borrowed: a SEND's payload is
    /// read in the receive buffer it landed in (no copy, as `ib_send_bw`'s receiver reads its
    /// buffers), which is posted again when `f` returns. A payload that arrived while the
    /// reader was far behind (half the connection's receive buffers already waiting) was
    /// copied out on arrival and is lent from that copy. `f` runs with nothing of the engine
    /// borrowed, so it may call the engine; keep it short, as its buffer is not posted
    /// meanwhile.
    ///
    /// # Errors
    /// [`TransferError::Connection`] when the connection failed or is unknown.
    pub async fn recv_with<R>(
        &self,
        conn: ConnId,
        f: impl FnOnce(Received<'_>) -> R,
    ) -> Result<R, TransferError> {
        match next_in_inbox(&self.inner, |core, cx| core.take_delivery(conn, cx)).await? {
            Delivery::Message(m) => Ok(f(Received::from(&m))),
            Delivery::Held(held) => {
                let lent = Lent::new(&self.inner, held);
                Ok(f(Received::Data(lent.bytes(), lent.imm())))
            }
        }
    }
}

/// Waits for `take` to find the next message of a connection: after the inbox, it reaps the CQ itself
/// (for a while when nothing is in flight: a request-response loop waiting for its answer) before
/// it registers its waker and leaves the progress task to wake it.
async fn next_in_inbox<T>(
    inner: &Rc<Inner>,
    mut take: impl FnMut(&mut Core<VerbsQueue>, Option<&mut Context<'_>>) -> Poll<T>,
) -> T {
    poll_fn(|cx| {
        let mut core = inner.core.borrow_mut();
        if let Poll::Ready(r) = take(&mut core, None) {
            return Poll::Ready(r);
        }
        let polls = if core.inflight_len() == 0 {
            inner.cfg.spin_polls
        } else {
            1
        };
        if let Poll::Ready(r) = reap_until(inner, &mut core, polls, |c| take(c, None)) {
            return Poll::Ready(r);
        }
        let r = take(&mut core, Some(cx));
        drop(core);
        if r.is_pending() {
            inner.kick_progress();
        }
        r
    })
    .await
}

/// A receive buffer lent to a reader, posted again when this is dropped (also if the reader
/// panics). The region handle keeps the buffer's memory alive meanwhile.
struct Lent {
    inner: Rc<Inner>,
    region: Option<Region>,
    held: Option<HeldBuffer>,
}

impl Lent {
    fn new(inner: &Rc<Inner>, held: HeldBuffer) -> Self {
        let region = inner
            .core
            .borrow()
            .queue(held.conn())
            .map(|q| q.recv_region().clone());
        Lent {
            inner: Rc::clone(inner),
            region,
            held: Some(held),
        }
    }

    fn bytes(&self) -> &[u8] {
        match (&self.region, &self.held) {
            (Some(r), Some(h)) => received_bytes(r, self.inner.cfg.max_message, h.index(), h.len()),
            _ => &[],
        }
    }

    fn imm(&self) -> Option<u32> {
        self.held.as_ref().and_then(HeldBuffer::imm)
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        let Some(held) = self.held.take() else {
            return;
        };
        match self.inner.core.try_borrow_mut() {
            Ok(mut core) => core.release_received(held),
            Err(_) => tracing::warn!(
                conn = held.conn().0,
                "a lent receive buffer was dropped while the engine was borrowed; not posted again"
            ),
        }
    }
}

/// Queues a message for `conn`'s coalesced post and schedules the flush if none is. Out of
/// line: the message posted at once is the latency path, and its future stays small.
#[inline(never)]
fn queue_message(
    inner: &Rc<Inner>,
    conn: ConnId,
    op: SendOp,
    sge: Sge,
    host: bool,
    keep: KeepAlive,
) -> Posting {
    let mut core = inner.core.borrow_mut();
    let posting = core.queue_message(conn, op, sge, host, keep);
    let flush = posting.queued() && core.take_flush_request(conn);
    drop(core);
    if flush {
        spawn_flush(inner, conn);
    }
    posting
}

/// Posts one SEND of `sge` (host memory if `host`; keeping `keep` in its slot) once the
/// connection has a send credit, or queues it for the connection's coalesced post, and waits
/// for its completion.
async fn post_message(
    inner: &Rc<Inner>,
    conn: ConnId,
    sge: Sge,
    host: bool,
    imm: Option<u32>,
    keep: KeepAlive,
) -> Result<(), TransferError> {
    let op = match imm {
        Some(imm) => SendOp::SendWithImm { imm },
        None => SendOp::Send,
    };
    // Coalesced like a small transfer: a message that is not the first of its turn waits for
    // the connection's flush, which posts it with the others queued in this turn.
    let queue = inner.core.borrow_mut().queues_message(conn);
    let posting = if queue {
        queue_message(inner, conn, op, sge, host, keep)
    } else {
        poll_fn(|cx| inner.core.borrow_mut().poll_credits(conn, 1, cx)).await?;
        let posting = inner
            .core
            .borrow_mut()
            .post_single(conn, op, sge, host, keep);
        inner.kick_progress();
        posting
    };
    let mut guard = SlotGuard {
        inner: Rc::clone(inner),
        posting,
    };
    wait_slot(&mut guard).await
}
