//! The transports a transfer can take, behind one trait: RDMA over the agent's rails (striping
//! lives in [`crate::runtime::Rails`]), CUDA IPC between GPU memory of two processes on one node
//! (planning and caches live in [`crate::nvlink::plan`]), and the FILE tier. The agent picks one
//! per descriptor pair; each transport here only adapts its crate's API to the agent's errors.

mod file;
mod ipc;
mod rdma;

pub(crate) use file::{gds, FileRequest, FileTransport, STAGE_CHUNK, STAGE_DEPTH};
pub(crate) use ipc::{IpcRequest, IpcTransport};
pub(crate) use rdma::{RdmaRequest, RdmaTransport};

use crate::agent::error::AgentError;
use crate::runtime::{Op, TransferStats};

/// A way to move one transfer's bytes.
pub(crate) trait Transport {
    /// One transfer's descriptors, as this transport takes them.
    type Request<'a>;

    /// Moves `request`'s bytes in `op`'s direction and returns what it did.
    async fn transfer(
        &self,
        op: Op,
        request: Self::Request<'_>,
    ) -> Result<TransferStats, AgentError>;
}
