//! The core's traits over verbs: a connection's queue pair with its batch and receive buffers,
//! the engine's completion queue, and what an in-flight slot keeps alive.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use rixl_proto::{Completion, CompletionSource, SendFlags, SendOp, SendQueue, Sge};
use rixl_verbs::{
    CompletionQueue, OwnedRegistration, QueuePair, RecvBatch, SendBatch, WorkCompletion,
};
use smallvec::SmallVec;

use crate::desc::Region;
use crate::probe::{self, Delay, Point};

/// What a transfer's slot keeps alive until the NIC is done with it.
pub(crate) struct KeepAlive {
    pub regions: SmallVec<[Region; 2]>,
    /// Held only to be dropped (returning the slot to the pool) with the keep-alive.
    pub _message: Option<MessageSlot>,
}

/// The engine's registered send-message pool: free slot indices and the senders waiting for one.
#[derive(Default)]
pub(crate) struct MessageSlots {
    free: Vec<u32>,
    waiters: Vec<Waker>,
}

impl MessageSlots {
    pub fn new(slots: u32) -> Self {
        MessageSlots {
            free: (0..slots).rev().collect(),
            waiters: Vec::new(),
        }
    }

    /// Takes a free slot, or registers the sender's waker (woken when a slot comes back).
    pub fn take(pool: &Rc<RefCell<Self>>, cx: &mut Context<'_>) -> Poll<MessageSlot> {
        let mut p = pool.borrow_mut();
        match p.free.pop() {
            Some(index) => Poll::Ready(MessageSlot {
                index,
                pool: Rc::clone(pool),
            }),
            None => {
                p.waiters.push(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// A slot of the engine's registered send-message pool. Returned to the pool on drop, whatever
/// drops it (the sender's slot finishing, a cancelled queued message, a released in-flight
/// slot), and the senders waiting for a slot are woken then.
pub(crate) struct MessageSlot {
    pub index: u32,
    pool: Rc<RefCell<MessageSlots>>,
}

impl Drop for MessageSlot {
    fn drop(&mut self) {
        let waiters = {
            let mut p = self.pool.borrow_mut();
            p.free.push(self.index);
            std::mem::take(&mut p.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// One connection's queue pair as the core drives it.
pub(crate) struct VerbsQueue {
    pub qp: Arc<QueuePair>,
    /// This side's initial packet sequence number (applied when the connection completes).
    pub psn: u32,
    batch: SendBatch,
    /// A receive buffer posted again (kept, so a received message allocates no request list).
    repost: RecvBatch,
    recv_region: Region,
    max_message: u32,
}

impl VerbsQueue {
    pub fn new(qp: Arc<QueuePair>, psn: u32, recv_region: Region, max_message: u32) -> Self {
        VerbsQueue {
            qp,
            psn,
            batch: SendBatch::with_capacity(64, 4),
            repost: RecvBatch::default(),
            recv_region,
            max_message,
        }
    }

    /// Its receive buffers (`max_message` bytes each).
    pub fn recv_region(&self) -> &Region {
        &self.recv_region
    }

    /// Posts receive buffers `indices` under `conn`'s receive ids.
    pub fn post_receives(
        &self,
        conn: u32,
        indices: impl Iterator<Item = u32>,
    ) -> Result<(), rixl_verbs::Error> {
        let mut r = RecvBatch::default();
        for i in indices {
            r.push(rixl_proto::recv_wr_id(conn, i), &[self.recv_sge(i)]);
        }
        self.qp.post_recv_in(&mut r, self.recv_region.nic_slice())
    }

    fn recv_sge(&self, index: u32) -> Sge {
        Sge {
            addr: self.recv_region.addr() + u64::from(index * self.max_message),
            length: self.max_message,
            lkey: self.recv_region.lkey(),
        }
    }
}

impl SendQueue for VerbsQueue {
    type Keep = KeepAlive;
    type Error = rixl_verbs::Error;

    fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    fn push(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) {
        if self.batch.is_empty() {
            probe::stamp(Point::Building);
        }
        self.batch.push(wr_id, op, sges, flags);
    }

    fn post(&mut self, keeps: &[&KeepAlive]) -> Result<(), rixl_verbs::Error> {
        // On the stack for a batch of up to the default `post_batch` transfers. (A lone
        // transfer's request is posted by `post_one`, with its one registration.)
        let regs: SmallVec<[&dyn OwnedRegistration; rixl_proto::POST_BATCH_INLINE]> = keeps
            .iter()
            .flat_map(|k| k.regions.iter().filter_map(Region::registration))
            .collect();
        probe::delay(Delay::BeforeDoorbell);
        probe::stamp(Point::Doorbell);
        let r = self.qp.post_send_in(&mut self.batch, &regs);
        probe::stamp(Point::Rung);
        probe::delay(Delay::AfterDoorbell);
        self.batch.clear();
        r
    }

    fn post_one(
        &mut self,
        wr_id: u64,
        op: SendOp,
        sge: Sge,
        flags: SendFlags,
        keep: &KeepAlive,
    ) -> Result<(), rixl_verbs::Error> {
        // A lone transfer keeps the one region its entry lies in; anything else is checked
        // against all it keeps, as a batch.
        let reg = match &keep.regions[..] {
            [r] => r.registration(),
            _ => None,
        };
        let Some(reg) = reg else {
            self.push(wr_id, op, std::slice::from_ref(&sge), flags);
            return self.post(&[keep]);
        };
        probe::stamp(Point::Building);
        probe::delay(Delay::BeforeDoorbell);
        probe::stamp(Point::Doorbell);
        let r = self.qp.post_send_one_in(wr_id, op, sge, flags, reg);
        probe::stamp(Point::Rung);
        probe::delay(Delay::AfterDoorbell);
        r
    }

    fn set_error(&mut self) -> Result<(), rixl_verbs::Error> {
        self.qp.to_error()
    }

    fn received(&mut self, index: u32, len: u32) -> &[u8] {
        received_bytes(&self.recv_region, self.max_message, index, len)
    }

    fn repost_recv(&mut self, wr_id: u64, index: u32) -> Result<(), rixl_verbs::Error> {
        let sge = self.recv_sge(index);
        self.repost.clear();
        self.repost.push(wr_id, &[sge]);
        self.qp
            .post_recv_in(&mut self.repost, self.recv_region.nic_slice())
    }
}

/// The first `len` bytes of buffer `index` of a receive region of `max_message`-byte buffers
/// (empty if out of range, which a completion from the NIC never is).
pub(crate) fn received_bytes(region: &Region, max_message: u32, index: u32, len: u32) -> &[u8] {
    let start = index as usize * max_message as usize;
    region
        .host_memory()
        .and_then(|h| h.slice_at(start, len.min(max_message) as usize))
        .unwrap_or(&[])
}

/// The engine's completion queue, polled through a buffer of raw completions.
pub(crate) struct VerbsCq<'a> {
    pub cq: &'a CompletionQueue,
    pub wcs: &'a mut [WorkCompletion],
    /// Set when a poll fails: the progress task then fails every connection (their completions
    /// can no longer be trusted to arrive).
    pub failed: &'a std::cell::Cell<bool>,
}

impl CompletionSource for VerbsCq<'_> {
    #[inline(always)]
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let n = out.len().min(self.wcs.len());
        let got = match self.cq.poll(&mut self.wcs[..n]) {
            Ok(got) => got,
            Err(e) => {
                tracing::error!(error = %e, "polling the CQ failed; failing every connection");
                self.failed.set(true);
                0
            }
        };
        for (o, wc) in out.iter_mut().zip(&self.wcs[..got]) {
            *o = wc.completion();
        }
        got
    }
}
