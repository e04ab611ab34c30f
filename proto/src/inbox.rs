//! A connection's inbox: received messages wait for their reader, in order.
//!
//! A SEND's payload lands in one of the connection's receive buffers. When the connection's
//! reader borrows payloads ([`Core::take_delivery`] and [`Core::release_received`]; the
//! runtime's `recv_with`), up to [`ConnParams::recv_buffers`](crate::ConnParams::recv_buffers)
//! ` / 2` of them wait there, unposted, until it takes them: it reads them in place, with no copy,
//! and the buffer is posted again when it is done. Past that many (a reader behind its sender),
//! and for a reader that copies ([`Core::try_recv`], [`Core::poll_recv`]), a payload is copied out
//! when it arrives and its buffer posted again at once, so at least half of the receive ring
//! stays posted (all of it for a copying reader). Past [`INBOX_LIMIT`] messages, buffers are
//! posted again only as the reader takes messages: the sender meets receiver-not-ready
//! back-pressure instead of this side's memory growing. An immediate (WRITE_WITH_IMM) reads no
//! buffer. A receive completion is routed only to the connection whose queue pair it names (a
//! late one of a removed connection never reaches the connection that took its slot).

use std::task::{Context, Poll};

use crate::conn::{unknown, ConnState, INBOX_LIMIT};
use crate::core::Core;
use crate::error::TransferError;
use crate::queue::SendQueue;
use crate::stats::{ConnId, Message};
use crate::wire::{Completion, WcOpcode};

/// A received payload still in its receive buffer, lent to the reader: read it in place (the
/// runtime reads buffer [`Self::index`] of its connection's receive region), then hand it back
/// with [`Core::release_received`], which posts the buffer again. Until then the NIC does not
/// write the buffer.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a held buffer is posted again only when released"]
pub struct HeldBuffer {
    conn: ConnId,
    epoch: u64,
    wr_id: u64,
    index: u32,
    len: u32,
    imm: Option<u32>,
}

impl HeldBuffer {
    /// Its connection.
    pub fn conn(&self) -> ConnId {
        self.conn
    }

    /// The receive buffer's index in its connection's ring.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The payload's length in bytes (at the buffer's start).
    pub fn len(&self) -> u32 {
        self.len
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The SEND's immediate value, if it had one.
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }
}

/// A message as an inbox keeps it, and as a reader takes it.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// A payload in its receive buffer (read it, then release it).
    Held(HeldBuffer),
    /// A message already copied out, or an immediate.
    Message(Message),
}

/// A received message, borrowed from where it is (its receive buffer, or a copy).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Received<'a> {
    /// A SEND's payload (with its immediate value, if any).
    Data(&'a [u8], Option<u32>),
    /// The immediate value of an RDMA WRITE_WITH_IMM: the writer's data has landed.
    Immediate(u32),
}

impl Received<'_> {
    /// An owned copy.
    pub fn to_message(&self) -> Message {
        match *self {
            Received::Data(bytes, imm) => Message::Data(bytes.to_vec(), imm),
            Received::Immediate(v) => Message::Immediate(v),
        }
    }
}

impl<'a> From<&'a Message> for Received<'a> {
    fn from(m: &'a Message) -> Self {
        match m {
            Message::Data(bytes, imm) => Received::Data(bytes, *imm),
            Message::Immediate(v) => Received::Immediate(*v),
        }
    }
}

impl<Q: SendQueue> Core<Q> {
    /// The next message of `conn`, or its error; registers the waker otherwise.
    pub fn poll_recv(
        &mut self,
        conn: ConnId,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Message, TransferError>> {
        self.take_copied(conn, Some(cx))
    }

    /// The next message of `conn`, or its error, without registering a waker (a receiver that
    /// reaps the CQ itself does not wake itself).
    pub fn try_recv(&mut self, conn: ConnId) -> Poll<Result<Message, TransferError>> {
        self.take_copied(conn, None)
    }

    /// The next message of `conn` as an owned copy (a held payload is copied out of its buffer
    /// and the buffer posted again). Payloads arriving from now on are copied on arrival.
    fn take_copied(
        &mut self,
        conn: ConnId,
        cx: Option<&mut Context<'_>>,
    ) -> Poll<Result<Message, TransferError>> {
        self.next_delivery(conn, cx, false).map_ok(|d| match d {
            Delivery::Message(m) => m,
            Delivery::Held(held) => {
                let m = match self.conns.get_mut(conn.0 as usize) {
                    Some(c) => {
                        Message::Data(c.queue.received(held.index, held.len).to_vec(), held.imm)
                    }
                    // Unreachable: the connection was there a moment ago.
                    None => Message::Data(Vec::new(), held.imm),
                };
                self.release_received(held);
                m
            }
        })
    }

    /// The next message of `conn` (a payload still in its buffer is lent: release it with
    /// [`Self::release_received`]), or its error once its inbox is empty and it failed. With
    /// `cx`, registers the waker when there is none. Payloads arriving from now on wait in their
    /// buffers (up to half the ring) to be lent.
    pub fn take_delivery(
        &mut self,
        conn: ConnId,
        cx: Option<&mut Context<'_>>,
    ) -> Poll<Result<Delivery, TransferError>> {
        self.next_delivery(conn, cx, true)
    }

    /// The next delivery; `lends`: whether the reader borrows payloads (they may be held).
    fn next_delivery(
        &mut self,
        conn: ConnId,
        cx: Option<&mut Context<'_>>,
        lends: bool,
    ) -> Poll<Result<Delivery, TransferError>> {
        let Some(c) = self.conns.get_mut(conn.0 as usize) else {
            return Poll::Ready(Err(unknown(conn.0)));
        };
        c.reader_lends = lends;
        if let Some(m) = c.inbox.pop_front() {
            // Held back: one buffer per message over the limit.
            if c.deferred_recvs.len() > c.inbox.len().saturating_sub(INBOX_LIMIT)
                && !matches!(c.state, ConnState::Failed(_))
            {
                if let Some((wr_id, index)) = c.deferred_recvs.pop() {
                    if let Err(e) = c.queue.repost_recv(wr_id, index) {
                        tracing::warn!(conn = conn.0, error = %e, "reposting a held-back receive failed");
                    }
                }
            }
            return Poll::Ready(Ok(m));
        }
        if let Err(e) = c.check_live(conn.0) {
            return Poll::Ready(Err(e));
        }
        if let Some(cx) = cx {
            c.inbox_waiter = Some(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Hands a lent receive buffer back: it is posted again (unless its connection failed or
    /// was replaced meanwhile).
    pub fn release_received(&mut self, held: HeldBuffer) {
        let Some(c) = self.conns.get_mut(held.conn.0 as usize) else {
            return;
        };
        if c.epoch != held.epoch {
            return;
        }
        c.held = c.held.saturating_sub(1);
        if matches!(c.state, ConnState::Failed(_)) {
            return;
        }
        if let Err(e) = c.queue.repost_recv(held.wr_id, held.index) {
            tracing::warn!(conn = held.conn.0, error = %e, "reposting a receive failed");
        }
    }

    /// A receive completed into buffer `index` of connection `conn`.
    pub(crate) fn route_recv(&mut self, wc: &Completion) {
        let conn = ((wc.wr_id >> 16) & 0xffff) as u32;
        let index = (wc.wr_id & 0xffff) as u32;
        let c = match self.conns.get_mut(conn as usize) {
            Some(c) if c.queue.qpn() == wc.qp_num => c,
            // Unknown, or a late completion of a removed connection whose slot was taken since.
            _ => {
                self.counters.stale_completions += 1;
                return;
            }
        };
        if !wc.is_success() {
            // Flushed receives of a failing connection.
            return;
        }
        if wc.opcode != WcOpcode::RecvRdmaWithImm && c.reader_lends && c.held < c.held_limit {
            // Left in its buffer until the reader takes it.
            c.held += 1;
            c.inbox.push_back(Delivery::Held(HeldBuffer {
                conn: ConnId(conn),
                epoch: c.epoch,
                wr_id: wc.wr_id,
                index,
                len: wc.byte_len,
                imm: wc.imm,
            }));
        } else {
            let msg = match wc.opcode {
                WcOpcode::RecvRdmaWithImm => Message::Immediate(wc.imm.unwrap_or(0)),
                _ => Message::Data(c.queue.received(index, wc.byte_len).to_vec(), wc.imm),
            };
            c.inbox.push_back(Delivery::Message(msg));
            if c.inbox.len() > INBOX_LIMIT {
                // The reader is behind: the buffer is posted again when it takes a message.
                c.deferred_recvs.push((wc.wr_id, index));
                self.counters.receives_held_back += 1;
            } else if let Err(e) = c.queue.repost_recv(wc.wr_id, index) {
                tracing::warn!(conn, error = %e, "reposting a receive failed");
            }
        }
        if let Some(w) = c.inbox_waiter.take() {
            w.wake();
        }
    }
}
