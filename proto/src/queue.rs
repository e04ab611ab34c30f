//! The small traits the core drives: a send queue it builds and posts batches on, a completion
//! source it reaps, and a clock its driver reads for the deadline passes. `rixl-runtime`
//! implements them over verbs; [`crate::harness`] implements them with a fake NIC and a virtual
//! clock.

use std::time::Instant;

use crate::wire::{Completion, SendFlags, SendOp, Sge};

/// One queue pair's send side (and its receive buffers), as the core uses it.
pub trait SendQueue {
    /// What an in-flight slot keeps alive until the NIC is done with it (registered memory).
    type Keep;
    /// A refused post or state change.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The queue pair's number (completions name it).
    fn qpn(&self) -> u32;

    /// Appends a work request to the batch being built.
    fn push(&mut self, wr_id: u64, op: SendOp, sges: &[Sge], flags: SendFlags);

    /// Posts the requests pushed since the last post with one doorbell; `keeps` hold every local
    /// entry's memory. Afterwards no request is pending, whether it worked or not.
    ///
    /// # Errors
    /// The post was refused: nothing of the batch counts as posted.
    fn post(&mut self, keeps: &[&Self::Keep]) -> Result<(), Self::Error>;

    /// Posts one request with a doorbell of its own (nothing else is pushed); `keep` holds its
    /// memory. By default [`Self::push`] and [`Self::post`]; a queue may build it directly.
    ///
    /// # Errors
    /// The post was refused: nothing was posted.
    fn post_one(
        &mut self,
        wr_id: u64,
        op: SendOp,
        sge: Sge,
        flags: SendFlags,
        keep: &Self::Keep,
    ) -> Result<(), Self::Error> {
        self.push(wr_id, op, std::slice::from_ref(&sge), flags);
        self.post(&[keep])
    }

    /// Moves the queue pair to the error state: the NIC flushes its outstanding work.
    ///
    /// # Errors
    /// The state change was refused.
    fn set_error(&mut self) -> Result<(), Self::Error>;

    /// The first `len` bytes of receive buffer `index`, after a receive completed into it (the
    /// buffer is not posted again until the core is done with them).
    fn received(&mut self, index: u32, len: u32) -> &[u8];

    /// Posts receive buffer `index` again, under `wr_id`.
    ///
    /// # Errors
    /// The post was refused.
    fn repost_recv(&mut self, wr_id: u64, index: u32) -> Result<(), Self::Error>;
}

/// Where completions come from (a completion queue shared by the core's queue pairs).
pub trait CompletionSource {
    /// Fills the front of `out` with completions; returns how many.
    fn poll(&mut self, out: &mut [Completion]) -> usize;
}

/// The clock a driver reads for the core's deadline passes ([`crate::Core::expire`] takes its
/// `now`; the core keeps no clock): the system's in the engine, a virtual one in the harness.
pub trait Clock {
    /// Now.
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}
