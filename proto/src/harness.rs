//! A deterministic fake NIC, a virtual clock and a null queue pair, for tests and benchmarks of
//! the core without hardware.
//!
//! [`FakeNic`] records every posted work request per queue pair and completes nothing by itself:
//! a test completes requests in any order with any status, flushes a queue pair, stalls (does
//! nothing), or refuses the next post. [`NullQueue`] completes every signaled request at once,
//! so a benchmark measures the core's own software path.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};

use crate::queue::{Clock, CompletionSource, SendQueue};
use crate::wire::{Completion, SendFlags, SendOp, Sge, WcOpcode, WcStatus};

/// Counts the wakes of the [`Waker`] [`counting_waker`] made.
#[derive(Debug, Default)]
pub struct WakeCount(AtomicUsize);

impl WakeCount {
    /// Wakes so far.
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

impl Wake for WakeCount {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A waker that counts its wakes.
pub fn counting_waker() -> (Arc<WakeCount>, Waker) {
    let count = Arc::new(WakeCount::default());
    (Arc::clone(&count), Waker::from(count))
}

/// A post or state change the fake NIC refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fake NIC refused: {0}")]
pub struct Refused(pub &'static str);

/// One work request as the fake NIC received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PostedWr {
    /// Its queue pair.
    pub qpn: u32,
    /// Its id.
    pub wr_id: u64,
    /// What it does.
    pub op: SendOp,
    /// Its local entries.
    pub sges: Vec<Sge>,
    /// Its flags.
    pub flags: SendFlags,
    /// The doorbell (post call) it came with, counting from 1.
    pub doorbell: u64,
}

#[derive(Debug, Default)]
struct NicState {
    /// Posted and not completed yet, in posting order.
    outstanding: Vec<PostedWr>,
    /// Every request ever posted.
    log: Vec<PostedWr>,
    cq: VecDeque<Completion>,
    doorbells: u64,
    refuse_posts: u32,
    accept_before_refusing: u32,
    errored: Vec<u32>,
    received: Vec<(u32, u32)>,
    reposted: Vec<u64>,
    next_qpn: u32,
}

/// The fake NIC: cheap to clone (all clones are the same NIC).
#[derive(Debug, Clone, Default)]
pub struct FakeNic(Rc<RefCell<NicState>>);

impl FakeNic {
    /// A NIC with nothing posted.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new queue pair on this NIC, keeping `K`s.
    pub fn queue<K>(&self) -> FakeQueue<K> {
        let mut s = self.0.borrow_mut();
        s.next_qpn += 1;
        FakeQueue {
            nic: self.clone(),
            qpn: 0x100 + s.next_qpn,
            batch: Vec::new(),
            payload: Vec::new(),
            _keep: PhantomData,
        }
    }

    /// Its completion queue.
    pub fn cq(&self) -> FakeCq {
        FakeCq(self.clone())
    }

    /// Requests posted and not completed, in order.
    pub fn outstanding(&self) -> Vec<PostedWr> {
        self.0.borrow().outstanding.clone()
    }

    /// Every request posted so far.
    pub fn posted(&self) -> Vec<PostedWr> {
        self.0.borrow().log.clone()
    }

    /// Doorbells rung so far.
    pub fn doorbells(&self) -> u64 {
        self.0.borrow().doorbells
    }

    /// Completions waiting in the CQ.
    pub fn cq_len(&self) -> usize {
        self.0.borrow().cq.len()
    }

    /// Refuses the next `n` posts (nothing of them is posted).
    pub fn refuse_posts(&self, n: u32) {
        self.refuse_posts_after(0, n);
    }

    /// Accepts the next `ok` posts, then refuses `n`.
    pub fn refuse_posts_after(&self, ok: u32, n: u32) {
        let mut s = self.0.borrow_mut();
        s.accept_before_refusing = ok;
        s.refuse_posts = n;
    }

    /// Whether queue pair `qpn` was moved to error.
    pub fn errored(&self, qpn: u32) -> bool {
        self.0.borrow().errored.contains(&qpn)
    }

    /// Receive buffers read so far, as (index, length).
    pub fn received(&self) -> Vec<(u32, u32)> {
        self.0.borrow().received.clone()
    }

    /// Receive `wr_id`s reposted so far.
    pub fn reposted(&self) -> Vec<u64> {
        self.0.borrow().reposted.clone()
    }

    /// Completes the outstanding request at `index` (0: the oldest) with `status`. A successful
    /// unsignaled request completes silently, like a real NIC; everything else reaches the CQ.
    /// Returns its `wr_id`.
    pub fn complete_at(&self, index: usize, status: WcStatus) -> Option<u64> {
        let mut s = self.0.borrow_mut();
        if index >= s.outstanding.len() {
            return None;
        }
        let wr = s.outstanding.remove(index);
        if wr.flags.signaled || status != WcStatus::Success {
            s.cq.push_back(completion_of(&wr, status));
        }
        Some(wr.wr_id)
    }

    /// Completes the oldest `n` outstanding requests successfully, in order. Returns how many.
    pub fn complete(&self, n: usize) -> usize {
        (0..n)
            .take_while(|_| self.complete_at(0, WcStatus::Success).is_some())
            .count()
    }

    /// Completes every outstanding request successfully, in order.
    pub fn complete_all(&self) -> usize {
        self.complete(usize::MAX)
    }

    /// Completes the request with `wr_id` (the first outstanding one) with `status`.
    pub fn complete_wr(&self, wr_id: u64, status: WcStatus) -> bool {
        let i = self
            .0
            .borrow()
            .outstanding
            .iter()
            .position(|w| w.wr_id == wr_id);
        i.and_then(|i| self.complete_at(i, status)).is_some()
    }

    /// Flushes everything outstanding on `qpn` (all of it reaches the CQ, in order, as
    /// `IBV_WC_WR_FLUSH_ERR`), as a NIC does once a queue pair is in error.
    pub fn flush(&self, qpn: u32) -> usize {
        let mut s = self.0.borrow_mut();
        let (flushed, kept): (Vec<_>, Vec<_>) = s.outstanding.drain(..).partition(|w| w.qpn == qpn);
        s.outstanding = kept;
        let n = flushed.len();
        for wr in flushed {
            s.cq.push_back(completion_of(&wr, WcStatus::WorkRequestFlushError));
        }
        n
    }

    /// Puts a completion straight into the CQ (a stale or foreign one, or a receive).
    pub fn inject(&self, c: Completion) {
        self.0.borrow_mut().cq.push_back(c);
    }
}

fn completion_of(wr: &PostedWr, status: WcStatus) -> Completion {
    Completion {
        wr_id: wr.wr_id,
        status,
        opcode: match wr.op {
            SendOp::Read { .. } => WcOpcode::RdmaRead,
            SendOp::Send | SendOp::SendWithImm { .. } => WcOpcode::Send,
            _ => WcOpcode::RdmaWrite,
        },
        byte_len: 0,
        imm: None,
        qp_num: wr.qpn,
    }
}

/// A queue pair of a [`FakeNic`].
#[derive(Debug)]
pub struct FakeQueue<K> {
    nic: FakeNic,
    qpn: u32,
    batch: Vec<PostedWr>,
    /// The last payload read out of a receive buffer (each buffer `i` holds bytes of value `i`).
    payload: Vec<u8>,
    _keep: PhantomData<fn(K)>,
}

impl<K> SendQueue for FakeQueue<K> {
    type Keep = K;
    type Error = Refused;

    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn push(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) {
        self.batch.push(PostedWr {
            qpn: self.qpn,
            wr_id,
            op,
            sges: sges.to_vec(),
            flags,
            doorbell: 0,
        });
    }

    fn post(&mut self, _keeps: &[&K]) -> Result<(), Refused> {
        let mut s = self.nic.0.borrow_mut();
        let batch = std::mem::take(&mut self.batch);
        if s.accept_before_refusing > 0 {
            s.accept_before_refusing -= 1;
        } else if s.refuse_posts > 0 {
            s.refuse_posts -= 1;
            return Err(Refused("post"));
        }
        if s.errored.contains(&self.qpn) {
            // A queue pair in error flushes what is posted to it.
            for wr in &batch {
                s.cq.push_back(completion_of(wr, WcStatus::WorkRequestFlushError));
            }
            return Ok(());
        }
        s.doorbells += 1;
        let doorbell = s.doorbells;
        for mut wr in batch {
            wr.doorbell = doorbell;
            s.log.push(wr.clone());
            s.outstanding.push(wr);
        }
        Ok(())
    }

    fn set_error(&mut self) -> Result<(), Refused> {
        let mut s = self.nic.0.borrow_mut();
        if !s.errored.contains(&self.qpn) {
            s.errored.push(self.qpn);
        }
        Ok(())
    }

    fn received(&mut self, index: u32, len: u32) -> &[u8] {
        self.nic.0.borrow_mut().received.push((index, len));
        self.payload.clear();
        self.payload.resize(len as usize, index as u8);
        &self.payload
    }

    fn repost_recv(&mut self, wr_id: u64, _index: u32) -> Result<(), Refused> {
        self.nic.0.borrow_mut().reposted.push(wr_id);
        Ok(())
    }
}

/// The completion queue of a [`FakeNic`].
#[derive(Debug, Clone)]
pub struct FakeCq(FakeNic);

impl CompletionSource for FakeCq {
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut s = self.0 .0.borrow_mut();
        let n = out.len().min(s.cq.len());
        for (slot, c) in out.iter_mut().zip(s.cq.drain(..n)) {
            *slot = c;
        }
        n
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Clone)]
pub struct VirtualClock {
    base: Instant,
    offset: Rc<RefCell<Duration>>,
}

impl Default for VirtualClock {
    fn default() -> Self {
        VirtualClock {
            base: Instant::now(),
            offset: Rc::default(),
        }
    }
}

impl VirtualClock {
    /// A clock at its start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves it forward by `d`.
    pub fn advance(&self, d: Duration) {
        *self.offset.borrow_mut() += d;
    }

    /// Time since its start.
    pub fn elapsed(&self) -> Duration {
        *self.offset.borrow()
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Instant {
        self.base + *self.offset.borrow()
    }
}

/// The completions a [`NullQueue`] produced, shared with its CQ.
pub type NullCompletions = Rc<RefCell<VecDeque<Completion>>>;

/// A queue pair that completes every signaled request at once, successfully: the core's software
/// path with the NIC taken out.
#[derive(Debug)]
pub struct NullQueue<K> {
    qpn: u32,
    staged: usize,
    signaled: Vec<u64>,
    cq: NullCompletions,
    /// Every receive buffer reads as zeros.
    payload: Vec<u8>,
    _keep: PhantomData<fn(K)>,
}

impl<K> NullQueue<K> {
    /// A null queue pair numbered `qpn` that completes into `cq`.
    pub fn new(qpn: u32, cq: NullCompletions) -> Self {
        NullQueue {
            qpn,
            staged: 0,
            signaled: Vec::new(),
            cq,
            payload: Vec::new(),
            _keep: PhantomData,
        }
    }
}

impl<K> SendQueue for NullQueue<K> {
    type Keep = K;
    type Error = Refused;

    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn push(&mut self, wr_id: u64, _op: SendOp, sges: &[Sge], flags: SendFlags) {
        // Touch the entries as a real batch builder would copy them.
        self.staged += std::hint::black_box(sges).len();
        if flags.signaled {
            self.signaled.push(wr_id);
        }
    }

    fn post(&mut self, _keeps: &[&K]) -> Result<(), Refused> {
        let mut cq = self.cq.borrow_mut();
        for wr_id in self.signaled.drain(..) {
            cq.push_back(Completion::success(self.qpn, wr_id));
        }
        self.staged = 0;
        Ok(())
    }

    fn set_error(&mut self) -> Result<(), Refused> {
        Ok(())
    }

    fn received(&mut self, _index: u32, len: u32) -> &[u8] {
        self.payload.resize(len as usize, 0);
        &self.payload[..len as usize]
    }

    fn repost_recv(&mut self, _wr_id: u64, _index: u32) -> Result<(), Refused> {
        Ok(())
    }
}

/// The CQ of [`NullQueue`]s.
#[derive(Debug, Clone, Default)]
pub struct NullCq(pub NullCompletions);

impl CompletionSource for NullCq {
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut q = self.0.borrow_mut();
        let n = out.len().min(q.len());
        for (slot, c) in out.iter_mut().zip(q.drain(..n)) {
            *slot = c;
        }
        n
    }
}
