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
    /// Bytes that went through host memory (staged RDMA: GPU memory without GPUDirect, or a
    /// registration marked staged), copied on the way.
    pub staged_bytes: u64,
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

/// How far a transfer got when it failed, in bytes of its stream (the local list read in
/// order). RC completes a queue pair's requests in order, so a prefix is known complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    /// Bytes known to have completed: every request up to the last one that completed
    /// successfully before the error.
    pub completed_bytes: u64,
    /// Bytes whose requests were posted (`u64::MAX`: all of them may have been, as for a
    /// coalesced transfer).
    pub posted_bytes: u64,
}

/// Which descriptors of a failed transfer did what: `0..completed` completed,
/// `completed..posted` failed (or may have: their outcome is unknown), `posted..total` were
/// never posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DescriptorRanges {
    /// Descriptors known to have completed.
    pub completed: usize,
    /// End of the descriptors whose work was posted.
    pub posted: usize,
    /// Descriptors in the transfer.
    pub total: usize,
}

impl DescriptorRanges {
    /// Maps `progress` to the descriptors of lengths `lens` (in list order).
    pub fn of(progress: Progress, lens: impl IntoIterator<Item = u64>) -> Self {
        let (mut completed, mut posted, mut total) = (0, 0, 0);
        let mut at = 0u64;
        for len in lens {
            let end = at.saturating_add(len);
            if end <= progress.completed_bytes {
                completed += 1;
            }
            if at < progress.posted_bytes {
                posted += 1;
            }
            at = end;
            total += 1;
        }
        DescriptorRanges {
            completed,
            posted: posted.max(completed),
            total,
        }
    }

    /// Every descriptor failed or unknown (a striped transfer's parts cannot be told apart).
    pub fn all_failed(total: usize) -> Self {
        DescriptorRanges {
            completed: 0,
            posted: total,
            total,
        }
    }

    /// The descriptors whose work failed (or whose outcome is unknown).
    pub fn failed(&self) -> std::ops::Range<usize> {
        self.completed..self.posted
    }

    /// The descriptors never posted.
    pub fn not_posted(&self) -> std::ops::Range<usize> {
        self.posted..self.total
    }
}

/// A transfer that failed after it started: the error and how far it got.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error} (descriptors {}..{} failed, {}..{} not posted)", .descriptors.completed, .descriptors.posted, .descriptors.posted, .descriptors.total)]
pub struct TransferFailure {
    /// What failed.
    #[source]
    pub error: crate::error::TransferError,
    /// Which descriptors completed, failed, or were never posted.
    pub descriptors: DescriptorRanges,
}

impl TransferFailure {
    /// A failure before anything was posted: all `descriptors` not posted.
    pub fn before_posting(error: crate::error::TransferError, descriptors: usize) -> Self {
        TransferFailure {
            error,
            descriptors: DescriptorRanges {
                completed: 0,
                posted: 0,
                total: descriptors,
            },
        }
    }

    /// A failure whose progress is unknown (the transfer's task panicked): none of
    /// `descriptors` is known to have completed, and any may have been posted (posted work
    /// drained before the memory was released).
    pub fn unknown(error: crate::error::TransferError, descriptors: usize) -> Self {
        TransferFailure {
            error,
            descriptors: DescriptorRanges {
                completed: 0,
                posted: descriptors,
                total: descriptors,
            },
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
    /// Device async events handled (port changes, queue pair and device faults).
    pub async_events: u64,
    /// Connections failed by an async event.
    pub event_failures: u64,
    /// Tasks on the engine's core that panicked and were contained (each failed only what it
    /// owned; the engine carried on).
    pub task_panics: u64,
    /// Times the progress task panicked and was restarted (each failed every connection of
    /// the engine, which are replaced on the next transfers).
    pub progress_restarts: u64,
    /// Receive buffers held back because a connection's reader was over `INBOX_LIMIT`
    /// messages behind (its sender met receiver-not-ready back-pressure).
    pub receives_held_back: u64,
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
