//! What callers pass in and get back: transfer options and statistics, an engine's counters,
//! connection ids and received messages.

use std::time::Duration;

/// Identifies a connection of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(pub u32);

/// Per-transfer options.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct TransferOptions {
    /// Deadline; `None` uses the engine's default transfer timeout.
    pub timeout: Option<Duration>,
    /// Deliver this immediate value to the peer after all data landed (the last work request
    /// becomes an RDMA WRITE_WITH_IMM; WRITE only). The peer receives it as
    /// [`Message::Immediate`].
    pub notify_imm: Option<u32>,
}

/// What a finished transfer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct TransferStats {
    /// Bytes moved.
    pub bytes: u64,
    /// Descriptors in the local list.
    pub descriptors: usize,
    /// Work requests posted.
    pub work_requests: usize,
    /// Doorbells rung (post calls).
    pub doorbells: usize,
    /// Time to validate and plan.
    pub prepare: Duration,
    /// Time from the first to the last post.
    pub post: Duration,
    /// Total time of the future.
    pub total: Duration,
}

impl TransferStats {
    /// What a transfer moved, with no timings (set `prepare`, `post` and `total` if measured).
    pub fn new(bytes: u64, descriptors: usize, work_requests: usize, doorbells: usize) -> Self {
        TransferStats {
            bytes,
            descriptors,
            work_requests,
            doorbells,
            ..TransferStats::default()
        }
    }
}

/// Counters of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct EngineCounters {
    /// CQ polls that returned completions.
    pub polls: u64,
    /// Completions reaped.
    pub completions: u64,
    /// CQ polls that returned nothing.
    pub empty_polls: u64,
    /// Times the progress task parked (nothing in flight).
    pub parks: u64,
    /// Completion events waited for (event mode).
    pub event_waits: u64,
    /// Completions for freed slots (ignored).
    pub stale_completions: u64,
    /// Transfers that completed successfully.
    pub transfers_ok: u64,
    /// Transfers that failed.
    pub transfers_failed: u64,
    /// Transfers whose futures went away before their result (cancelled, dropped or
    /// forgotten): their requests not yet posted were never posted.
    pub transfers_abandoned: u64,
    /// Work requests posted.
    pub work_requests: u64,
    /// Doorbells rung.
    pub doorbells: u64,
    /// Small transfers queued for a coalesced post (with coalescing on; the others were posted
    /// at once).
    pub queued: u64,
}

/// A message received on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Message {
    /// A SEND's payload (with its immediate value, if any).
    Data(Vec<u8>, Option<u32>),
    /// The immediate value of an RDMA WRITE_WITH_IMM: the writer's data has landed.
    Immediate(u32),
}
