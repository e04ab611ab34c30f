//! One connection's state: its queue, lifecycle, send credits, coalescing queue and inbox.

use std::collections::VecDeque;
use std::task::Waker;

use smallvec::SmallVec;

use crate::credits::SendCredits;
use crate::error::TransferError;
use crate::inbox::Delivery;
use crate::inflight::{InflightTable, SlotId};
use crate::wire::{SendOp, Sge};

/// Where a connection is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnState {
    /// Its queue pair exists (receives posted); the peer's endpoint is not applied yet.
    Prepared,
    /// Connected: transfers may be posted.
    Ready,
    /// Failed (error completion, timeout, refused post or abort): its queue pair is in the error
    /// state and flushes what is outstanding; nothing more is posted.
    Failed(String),
}

/// What a new connection's queue pair was granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnParams {
    /// Send queue depth.
    pub send_queue_depth: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Inline bytes per send request (0: none).
    pub max_inline: u32,
    /// Receive buffers posted at connect (half of them may hold received payloads for their
    /// reader; see [`crate::inbox`]).
    pub recv_buffers: u32,
}

/// Transfers of at most this many work requests are coalesced (see
/// [`crate::CoreConfig::coalesce`]).
pub const COALESCE_MAX_WRS: usize = 4;

/// In a coalesced batch, at least every this many requests are signaled, so transfers complete
/// in small groups rather than all at the end of the batch.
pub const COALESCE_SIGNAL_INTERVAL: u32 = 8;

/// Coalescing learns from its flushes: after this many flushes in a row that posted a single
/// transfer (nothing joined the queued one: a task that posts, awaits and posts again), the
/// connection posts its small transfers at once.
pub const COALESCE_LONELY_FLUSHES: u32 = 8;

/// A connection that posts its small transfers at once queues every this-many-th one (when it
/// is not the first of its turn) to see whether others would join it; if they do, it
/// coalesces again.
pub const COALESCE_PROBE_EVERY: u32 = 64;

/// What coalescing has learned about a connection's small transfers.
#[derive(Debug, Default)]
pub(crate) struct CoalesceMode {
    /// Flushes in a row that posted one transfer; from [`COALESCE_LONELY_FLUSHES`] on, small
    /// transfers are posted at once.
    pub lonely: u32,
    /// Transfers the current flush has posted.
    pub round: u32,
    /// Small transfers seen in direct mode (every [`COALESCE_PROBE_EVERY`]-th probes).
    pub seen: u32,
}

impl CoalesceMode {
    /// A flush emptied the queue: learn from how many transfers it posted.
    pub fn flushed(&mut self) {
        self.lonely = if self.round >= 2 {
            0
        } else {
            self.lonely.saturating_add(1)
        };
        self.round = 0;
    }

    /// In direct mode (recent flushes found no company), whether this small transfer is posted
    /// at once (not a probe).
    pub fn bypass(&mut self) -> bool {
        let yes = self.would_bypass();
        if self.lonely >= COALESCE_LONELY_FLUSHES {
            self.seen = self.seen.wrapping_add(1);
        }
        yes
    }

    /// What [`Self::bypass`] would answer now, without counting the transfer.
    pub fn would_bypass(&self) -> bool {
        self.lonely >= COALESCE_LONELY_FLUSHES
            && !self
                .seen
                .wrapping_add(1)
                .is_multiple_of(COALESCE_PROBE_EVERY)
    }
}

/// Messages a connection holds for its reader. Past it, a receive buffer is posted again only
/// as the reader takes a message: a sender that outpaces its reader meets receiver-not-ready
/// back-pressure from the NIC (and, past its retries or its deadline, a typed error) instead of
/// growing this side's memory.
pub const INBOX_LIMIT: usize = 64;

/// One queued work request of a coalesced transfer.
#[derive(Debug, Clone)]
pub(crate) struct QueuedWr {
    pub slot: SlotId,
    pub op: SendOp,
    /// Its entries (most small transfers have one: no heap allocation for them).
    pub sges: SmallVec<[Sge; 2]>,
    /// Its memory is host memory (may be posted inline).
    pub host: bool,
    /// The transfer's last request (its requests are queued and posted together).
    pub last: bool,
    /// Number of requests of its transfer (on the first one).
    pub count: usize,
}

impl QueuedWr {
    /// The one request of a one-request transfer or message.
    pub fn single(slot: SlotId, op: SendOp, sge: Sge, host: bool) -> Self {
        QueuedWr {
            slot,
            op,
            sges: smallvec::smallvec![sge],
            host,
            last: true,
            count: 1,
        }
    }
}

pub(crate) struct Connection<Q> {
    /// Unique per core, unlike the slab id (reused after a close) and the QP number (which a
    /// device may reuse): what a prepared transfer is bound to.
    pub epoch: u64,
    pub queue: Q,
    pub state: ConnState,
    pub credits: SendCredits,
    pub credit_waiters: Vec<Waker>,
    pub inbox: VecDeque<Delivery>,
    /// Receive buffers holding a payload for the reader (in the inbox or lent to it).
    pub held: u32,
    /// At most this many buffers are held; past it payloads are copied out on arrival.
    pub held_limit: u32,
    /// The reader borrows payloads (its last take lent them): arriving ones may be held.
    pub reader_lends: bool,
    pub inbox_waiter: Option<Waker>,
    /// Receive buffers (work request id, index) held back while the inbox is over
    /// [`INBOX_LIMIT`], posted again as the reader takes messages.
    pub deferred_recvs: Vec<(u64, u32)>,
    pub max_msg: u64,
    pub max_send_sge: u32,
    /// Inline bytes per send request the queue pair was granted.
    pub max_inline: u64,
    /// Work requests of small transfers waiting for this turn's coalesced post.
    pub pending: VecDeque<QueuedWr>,
    /// A flush of `pending` is scheduled.
    pub flush_scheduled: bool,
    /// The progress turn in which a small transfer was last posted at once.
    pub immediate_turn: u64,
    /// What coalescing learned of this connection's traffic.
    pub mode: CoalesceMode,
}

impl<Q> Connection<Q> {
    pub fn new(epoch: u64, queue: Q, params: ConnParams, signal_interval: u32) -> Self {
        Connection {
            epoch,
            queue,
            state: ConnState::Prepared,
            credits: SendCredits::new(params.send_queue_depth, signal_interval),
            credit_waiters: Vec::new(),
            inbox: VecDeque::new(),
            held: 0,
            held_limit: params.recv_buffers / 2,
            reader_lends: false,
            inbox_waiter: None,
            deferred_recvs: Vec::new(),
            max_msg: u64::from(u32::MAX),
            max_send_sge: params.max_send_sge,
            max_inline: u64::from(params.max_inline),
            pending: VecDeque::new(),
            flush_scheduled: false,
            immediate_turn: 0,
            mode: CoalesceMode::default(),
        }
    }

    /// Coalescing: whether a small transfer in progress turn `turn` is posted at once: the
    /// first of the turn with nothing queued before it (nothing queued may be overtaken, so a
    /// probe in the queue collects the transfers that follow it in its turn), or any while the
    /// connection's flushes find no company, but for a probe now and then. Changes nothing:
    /// [`Self::decide_turn`] decides the same and records it.
    pub fn posts_at_once(&self, turn: u64) -> bool {
        self.idle_queue() && (self.immediate_turn != turn || self.mode.would_bypass())
    }

    /// [`Self::posts_at_once`], recorded for a transfer that acts on it: one posted at once
    /// takes the turn, and in direct mode every transfer after the turn's first counts towards
    /// the next probe, posted at once or not.
    #[inline(always)]
    pub fn decide_turn(&mut self, turn: u64) -> bool {
        let at_once = self.idle_queue() && (self.immediate_turn != turn || self.mode.bypass());
        if at_once {
            self.immediate_turn = turn;
        }
        at_once
    }

    /// Nothing queued and no flush scheduled.
    fn idle_queue(&self) -> bool {
        self.pending.is_empty() && !self.flush_scheduled
    }

    /// Whether a request of `op` moving `bytes` is posted inline (READs never are).
    pub fn inline(&self, op: &SendOp, bytes: u64) -> bool {
        op.sends_local_data() && bytes <= self.max_inline
    }

    /// `Ok` when transfers may be posted.
    pub fn check_ready(&self, conn: u32) -> Result<(), TransferError> {
        match &self.state {
            ConnState::Ready => Ok(()),
            ConnState::Failed(why) => Err(TransferError::Connection(conn, why.clone())),
            ConnState::Prepared => Err(TransferError::Connection(conn, "not connected".into())),
        }
    }

    /// `Ok` unless it failed.
    pub fn check_live(&self, conn: u32) -> Result<(), TransferError> {
        match &self.state {
            ConnState::Failed(why) => Err(TransferError::Connection(conn, why.clone())),
            _ => Ok(()),
        }
    }

    /// Ends every queued (not yet posted) transfer with `err`.
    pub fn fail_pending<K>(&mut self, inflight: &mut InflightTable<K>, err: &TransferError) {
        for q in self.pending.drain(..) {
            inflight.fail(q.slot, err.clone());
            if q.last {
                inflight.finish_posting(q.slot);
            }
        }
    }

    /// Wakers of everything waiting on it (credits and the inbox).
    pub fn take_waiters(&mut self) -> Vec<Waker> {
        self.credit_waiters
            .drain(..)
            .chain(self.inbox_waiter.take())
            .collect()
    }
}

/// The error of an unknown connection.
pub(crate) fn unknown(conn: u32) -> TransferError {
    TransferError::Connection(conn, "unknown".into())
}
