//! Errors of the agent.

use crate::runtime::{FileError, RuntimeError, TransferError};

use super::auth::AuthError;
use super::metadata::MetadataError;

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The engine failed to start or a control operation failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A transfer failed before any of its work was posted (nothing was sent).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// A transfer failed after its work began: which descriptors (indices into the local list)
    /// completed, failed (or may have: their outcome is unknown), or were never posted. A
    /// serving engine marks exactly `descriptors.failed()` and `descriptors.not_posted()`
    /// invalid and recomputes them. A transfer striped over several rails names every posted
    /// descriptor failed.
    #[error("{source}: descriptors {}..{} failed, {}..{} not posted", .descriptors.completed, .descriptors.posted, .descriptors.posted, .descriptors.total)]
    Incomplete {
        /// What failed.
        #[source]
        source: TransferError,
        /// Which descriptors completed, failed, or were never posted.
        descriptors: crate::runtime::DescriptorRanges,
    },
    /// Metadata was rejected.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// No metadata of this peer is loaded (never loaded, or invalidated).
    #[error("unknown peer {0:?}")]
    UnknownPeer(String),
    /// The peer's metadata has no such region (or does not grant it to us).
    #[error("peer {peer:?} has no region {region} visible to us")]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// The region id.
        region: u64,
    },
    /// The peer does not grant us the region on the connection a transfer uses (NIC grants):
    /// it is not, or no longer, visible to us (revoked or released).
    #[error("peer {peer:?} does not grant us region {region}")]
    NotGranted {
        /// The peer.
        peer: String,
        /// The region id.
        region: u64,
    },
    /// Rights per agent were asked for a region every peer sees ([`super::Visibility::All`],
    /// [`super::Visibility::ReadOnly`]).
    #[error("region {0} is visible to every peer: rights per agent need Visibility::Only or Visibility::Granted")]
    UnnamedRegion(u64),
    /// The topology named by `RIXL_TOPOLOGY_XML` could not be read.
    #[error("topology: {0}")]
    Topology(#[from] crate::topology::TopologyError),
    /// A peer's region that no NIC reaches (GPU memory without GPUDirect RDMA) was the target
    /// of an RDMA transfer: it is reachable by CUDA IPC from its own node only.
    #[error("region {region} of {peer:?} is reachable by CUDA IPC only (no NIC registration)")]
    NotRdmaReachable {
        /// The peer.
        peer: String,
        /// Its region id.
        region: u64,
    },
    /// A NIC binding named a NIC this agent did not open ([`super::Agent::bind`]).
    #[error("no NIC {nic:?} among this agent's NICs {have:?}")]
    UnknownNic {
        /// The name asked for (empty: none was named).
        nic: String,
        /// The agent's NICs, one per rail.
        have: Vec<String>,
    },
    /// This agent has no such region reachable by the reader (not registered, released, or
    /// scoped to other agents).
    #[error("no local region {0} is registered and visible to the reader")]
    UnknownLocalRegion(u64),
    /// A remote descriptor reaches outside the peer's region.
    #[error("remote descriptor {index}: offset {offset} + length {len} exceeds region {region} of {region_len} bytes")]
    RemoteOutOfRange {
        /// Position in the list.
        index: usize,
        /// Region id.
        region: u64,
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Region length.
        region_len: u64,
    },
    /// The side channel failed (the peer answered with an error, or garbage).
    #[error("side channel: {0}")]
    SideChannel(String),
    /// The side channel could not be reached or timed out.
    #[error("side channel {addr}: {source}")]
    SideChannelIo {
        /// The peer's side-channel address.
        addr: String,
        /// The socket error (`TimedOut` or `WouldBlock` past the deadline).
        #[source]
        source: std::io::Error,
    },
    /// Identity: no or a bad cluster key, a peer that failed authentication, or ours refused.
    #[error(transparent)]
    Auth(#[from] AuthError),
    /// A side-channel line was over its size limit; the connection was closed.
    #[error("side channel {addr}: a message over the {limit}-byte limit; connection closed")]
    MessageTooLarge {
        /// The other side's address.
        addr: String,
        /// The limit.
        limit: usize,
    },
    /// The peer's metadata carries no side-channel address: connections cannot be set up.
    #[error("peer {0:?} has no side-channel address")]
    NoSideChannel(String),
    /// The side channel at a peer's address answered with another agent's metadata.
    #[error("the side channel of {expected:?} answered as {found:?}")]
    WrongPeer {
        /// The peer asked for.
        expected: String,
        /// The agent that answered.
        found: String,
    },
    /// A connection set-up did not finish within the call's deadline (it goes on for the next
    /// caller, bounded by `connect_timeout`).
    #[error("connecting to {peer:?} (rail {rail}) took longer than the deadline ({after:?})")]
    ConnectTimeout {
        /// The peer.
        peer: String,
        /// The rail.
        rail: usize,
        /// How long the caller waited.
        after: std::time::Duration,
    },
    /// A connection set-up failed; every caller that waited for it gets the same error.
    #[error("connecting to {peer:?} (rail {rail}) failed: {source}")]
    ConnectFailed {
        /// The peer.
        peer: String,
        /// The rail.
        rail: usize,
        /// Why.
        #[source]
        source: std::sync::Arc<AgentError>,
    },
    /// The last set-up to the peer failed and its backoff outlasts the caller's deadline.
    #[error("{peer:?} (rail {rail}) is unreachable: retrying in {retry_in:?} after: {source}")]
    Unreachable {
        /// The peer.
        peer: String,
        /// The rail.
        rail: usize,
        /// When the next set-up may start.
        retry_in: std::time::Duration,
        /// The last set-up's error.
        #[source]
        source: std::sync::Arc<AgentError>,
    },
    /// etcd refused or failed a request of the first join.
    #[error("etcd: {0}")]
    Etcd(#[source] etcd_client::Error),
    /// The first join did not finish in time (etcd unreachable).
    #[error("joining etcd took longer than {0:?}")]
    EtcdTimeout(std::time::Duration),
    /// No etcd endpoint was given.
    #[error("no etcd endpoint given (host:port, comma-separated)")]
    InvalidEtcdEndpoints,
    /// A control thread (or its runtime) could not be started.
    #[error("cannot start a control thread: {0}")]
    ControlThread(#[source] std::io::Error),
    /// The agent was shut down.
    #[error("the agent was shut down")]
    Stopped,
    /// An index selects no entry of a prepared list.
    #[error("index {index} is out of a prepared list of {len} entries")]
    BadIndex {
        /// The index.
        index: usize,
        /// The list's length.
        len: usize,
    },
    /// A prepared remote list was made from metadata the peer has since replaced (it re-joined).
    #[error("prepared list for {0:?} is stale: the peer's metadata changed")]
    StaleMetadata(String),
    /// A notification is larger than the engine's message size.
    #[error("notification of {0} bytes exceeds the message size")]
    NotificationTooLarge(usize),
    /// A FILE registration failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// Staging through bounce buffers failed (the copy leg of a VRAM transfer).
    #[error(transparent)]
    Staging(#[from] crate::staging::StagingError),
    /// A GPUDirect Storage (cuFile) read or write failed.
    #[error(transparent)]
    Gds(#[from] crate::gpudirect::gds::GdsError),
    /// An OBJECT registration or transfer failed.
    #[error(transparent)]
    Object(#[from] crate::object::ObjectError),
    /// The NIC refused to register caller memory: `EFAULT` for an unmapped range or read-only
    /// memory (every registration allows local and remote writes), `ENOMEM` past the memlock
    /// limit.
    #[error("memory at {addr:#x} ({len} bytes) cannot be registered: {source}")]
    BadMemory {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// The registration's OS error.
        #[source]
        source: std::io::Error,
    },
    /// A registration would overlap a live one without either containing the other (see the
    /// registration cache in [`crate::agent::Agent::register_host`]).
    #[error("memory at {addr:#x} ({len} bytes) partly overlaps the live registration of {existing_len} bytes at {existing:#x}; register the union or disjoint ranges")]
    OverlappingRegistration {
        /// Start address asked for.
        addr: u64,
        /// Length asked for.
        len: u64,
        /// Start of the live registration.
        existing: u64,
        /// Its length.
        existing_len: u64,
    },
    /// Too few transfers with the peer have completed for [`crate::agent::Agent::estimate`].
    #[error("no estimate for {peer:?} yet: {samples} transfers completed")]
    NoEstimate {
        /// The peer.
        peer: String,
        /// Transfers its model has seen (of this direction).
        samples: u64,
    },
    /// The transfer was cancelled ([`crate::agent::Transfer::cancel`]).
    #[error("the transfer was cancelled")]
    Cancelled,
    /// The transfer's result was already taken.
    #[error("the transfer's result was already taken")]
    ResultTaken,
    /// A CUDA IPC copy (same-node GPU path) failed.
    #[error(transparent)]
    Ipc(#[from] crate::nvlink::ipc::IpcError),
}

impl AgentError {
    /// The transfer error, whether the transfer failed before or after posting began.
    pub fn transfer_error(&self) -> Option<&TransferError> {
        match self {
            AgentError::Transfer(e) | AgentError::Incomplete { source: e, .. } => Some(e),
            _ => None,
        }
    }

    /// A transfer's failure as the agent reports it: [`AgentError::Incomplete`] once some of
    /// its work was posted, [`AgentError::Transfer`] otherwise. `parts` is the number of rails
    /// it was striped over and `descriptors` the length of its local list.
    pub(crate) fn from_failure(
        f: crate::runtime::TransferFailure,
        parts: usize,
        descriptors: usize,
    ) -> Self {
        if f.descriptors.posted == 0 && f.descriptors.completed == 0 {
            return AgentError::Transfer(f.error);
        }
        let descriptors = if parts == 1 {
            f.descriptors
        } else {
            crate::runtime::DescriptorRanges::all_failed(descriptors)
        };
        AgentError::Incomplete {
            source: f.error,
            descriptors,
        }
    }

    /// `peer` has no region `region` visible to us.
    pub(crate) fn unknown_region(peer: &str, region: u64) -> Self {
        AgentError::UnknownRegion {
            peer: peer.to_string(),
            region,
        }
    }

    /// No metadata of `peer` is loaded.
    pub(crate) fn unknown_peer(peer: &str) -> Self {
        AgentError::UnknownPeer(peer.to_string())
    }
}
