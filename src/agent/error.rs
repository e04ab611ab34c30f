//! Errors of the agent.

use crate::runtime::{FileError, RuntimeError, TransferError};

use super::metadata::MetadataError;

/// Errors of the agent.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AgentError {
    /// The engine failed to start or a control operation failed.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// A transfer failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
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
    /// The side channel failed.
    #[error("side channel: {0}")]
    SideChannel(String),
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
    /// A CUDA IPC copy (same-node GPU path) failed.
    #[error(transparent)]
    Ipc(#[from] crate::nvlink::ipc::IpcError),
}

impl AgentError {
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
