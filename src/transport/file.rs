//! The FILE tier: a registered file read or written on the agent's core (O_DIRECT, io_uring).

use crate::agent::error::AgentError;
use crate::agent::registry::FileRegistration;
use crate::runtime::{FileDesc, LocalDescList, Op, TransferStats};

use super::Transport;

/// FILE transfers (the file's engine does the I/O).
pub(crate) struct FileTransport;

/// Memory and the file pieces it pairs with, in order.
pub(crate) struct FileRequest<'a> {
    pub local: &'a LocalDescList,
    pub file: &'a FileRegistration,
    pub descs: &'a [FileDesc],
    /// Deadline (`None`: the engine's `transfer_timeout`).
    pub timeout: Option<std::time::Duration>,
}

impl Transport for FileTransport {
    type Request<'a> = FileRequest<'a>;

    async fn transfer(&self, op: Op, r: Self::Request<'_>) -> Result<TransferStats, AgentError> {
        let f = &r.file.inner;
        Ok(f.engine
            .file_transfer(f.info.id, op, r.local.clone(), r.descs.to_vec(), r.timeout)
            .await?)
    }
}
