//! The null NIC the core benches run against: a queue pair whose requests are built into a real
//! verbs [`SendBatch`] (the `ibv_send_wr`/`ibv_sge` arrays the doorbell would hand the NIC) and
//! whose posting clears the batch, with a completion per signaled request either at the
//! doorbell or held until [`NullNic::complete`] (the NIC's round trip).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::rc::Rc;

use rixl_proto::{
    Completion, CompletionSource, ConnId, ConnParams, Core, CoreConfig, SendFlags, SendOp,
    SendQueue, Sge,
};
use rixl_verbs::SendBatch;

/// The completions of the null queue pairs.
#[derive(Default)]
pub struct NullNic {
    /// Signaled requests complete at the doorbell (else they are held).
    pub at_doorbell: Cell<bool>,
    held: RefCell<Vec<u64>>,
    cq: RefCell<VecDeque<Completion>>,
}

impl NullNic {
    /// A NIC whose requests complete at the doorbell.
    pub fn completing_at_doorbell() -> Rc<Self> {
        let nic = Rc::new(NullNic::default());
        nic.at_doorbell.set(true);
        nic
    }

    /// The held requests complete.
    pub fn complete(&self) {
        let mut cq = self.cq.borrow_mut();
        cq.extend(
            self.held
                .borrow_mut()
                .drain(..)
                .map(|w| Completion::success(1, w)),
        );
    }
}

/// A queue pair of the null NIC; its slots keep `K` alive.
pub struct NullQp<K> {
    batch: SendBatch,
    signaled: Vec<u64>,
    nic: Rc<NullNic>,
    /// Every receive buffer reads as zeros.
    payload: Vec<u8>,
    keep: PhantomData<K>,
}

impl<K> SendQueue for NullQp<K> {
    type Keep = K;
    type Error = std::convert::Infallible;

    fn qpn(&self) -> u32 {
        1
    }

    fn push(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags) {
        self.batch.push(wr_id, op, sges, flags);
        if flags.signaled {
            self.signaled.push(wr_id);
        }
    }

    fn post(&mut self, keeps: &[&K]) -> Result<(), Self::Error> {
        std::hint::black_box((keeps.len(), self.batch.len()));
        self.batch.clear();
        if self.nic.at_doorbell.get() {
            let mut cq = self.nic.cq.borrow_mut();
            cq.extend(self.signaled.drain(..).map(|w| Completion::success(1, w)));
        } else {
            self.nic.held.borrow_mut().extend(self.signaled.drain(..));
        }
        Ok(())
    }

    fn set_error(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }

    fn received(&mut self, _index: u32, len: u32) -> &[u8] {
        self.payload.resize(len as usize, 0);
        &self.payload[..len as usize]
    }

    fn repost_recv(&mut self, _wr_id: u64, _index: u32) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The null NIC's completion queue.
pub struct NullCq<'a>(pub &'a NullNic);

impl CompletionSource for NullCq<'_> {
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut q = self.0.cq.borrow_mut();
        let n = out.len().min(q.len());
        for (o, c) in out.iter_mut().zip(q.drain(..n)) {
            *o = c;
        }
        n
    }
}

/// A core (default configuration) with one connected queue pair of `nic`: 512 send slots, 16
/// scatter/gather entries, 220 inline bytes.
pub fn connected_core<K>(nic: &Rc<NullNic>) -> (Core<NullQp<K>>, ConnId) {
    let mut core = Core::new(CoreConfig::default());
    let conn = core.add_connection(
        NullQp {
            batch: SendBatch::with_capacity(64, 4),
            signaled: Vec::new(),
            nic: Rc::clone(nic),
            payload: Vec::new(),
            keep: PhantomData,
        },
        ConnParams {
            send_queue_depth: 512,
            max_send_sge: 16,
            max_inline: 220,
            recv_buffers: 0,
        },
    );
    core.connected(conn, 1 << 31);
    (core, conn)
}
