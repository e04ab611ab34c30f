//! CUDA IPC between GPU memory of two processes on one node: the plan's pieces become device
//! copies on the local GPU's stream, enqueued from the calling thread and awaited on the engine's
//! core like RDMA work.

use std::collections::HashMap;
use std::sync::Arc;

use crate::agent::error::AgentError;
use crate::nvlink::ipc::DeviceRange;
use crate::nvlink::plan::{copies, CopyPlanError, IpcPaths, IpcPlan};
use crate::runtime::{
    EngineHandle, InvalidDescriptor, LocalDescList, Op, PostError, RemoteDescList, SharedError,
    TransferError, TransferStats,
};

use super::Transport;

/// The process's CUDA IPC path and the engine that awaits its copies.
pub(crate) struct IpcTransport<'a> {
    pub paths: &'a IpcPaths,
    pub engine: &'a EngineHandle,
}

/// A same-node GPU transfer with `peer`.
pub(crate) struct IpcRequest<'a> {
    pub peer: &'a str,
    pub plan: IpcPlan,
    pub local: &'a LocalDescList,
    pub remote: &'a RemoteDescList,
}

impl Transport for IpcTransport<'_> {
    type Request<'a> = IpcRequest<'a>;

    async fn transfer(&self, op: Op, r: Self::Request<'_>) -> Result<TransferStats, AgentError> {
        let stream = self.paths.stream(r.plan.local_gpu)?;
        let gpu = stream.gpu();
        // The peer's exports this transfer touches, opened once each (and cached per peer).
        let mut theirs: HashMap<u64, Arc<dyn DeviceRange>> = HashMap::new();
        for e in &r.plan.exports {
            let m: Arc<dyn DeviceRange> = self.paths.import(r.peer, e, gpu)?;
            theirs.insert(e.region, m);
        }
        let mine: Vec<Arc<dyn DeviceRange>> = r
            .local
            .regions()
            .iter()
            .map(|x| Arc::new(x.clone()) as Arc<dyn DeviceRange>)
            .collect();
        let copies = copies(op, r.local.descs(), &r.remote.0, &r.plan, &mine, &theirs).map_err(
            |e| match e {
                CopyPlanError::LengthMismatch { local, remote } => {
                    AgentError::Transfer(TransferError::InvalidDescriptor(
                        InvalidDescriptor::LengthMismatch { local, remote },
                    ))
                }
                CopyPlanError::UnknownRegion { region } => {
                    AgentError::unknown_region(r.peer, region)
                }
                other => AgentError::Transfer(TransferError::Post(PostError::CopyPlan(
                    SharedError::new(other),
                ))),
            },
        )?;
        let n = copies.len();
        self.engine.device_copies(stream, copies).await?;
        tracing::debug!(peer = %r.peer, copies = n, "CUDA IPC transfer");
        Ok(TransferStats::new(r.local.total_len(), r.local.len(), n, 0))
    }
}
