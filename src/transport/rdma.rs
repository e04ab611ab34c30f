//! RDMA over the agent's rails: one part on rail 0, or a striped transfer's parts all at once.

use crate::agent::error::AgentError;
use crate::runtime::{Op, RailPart, Rails, TransferOptions, TransferStats};

use super::Transport;

/// The agent's rails.
pub(crate) struct RdmaTransport<'a> {
    pub rails: &'a Rails,
}

/// A transfer's parts, one per rail it uses, each on its rail's connection.
pub(crate) struct RdmaRequest {
    pub parts: Vec<RailPart>,
    /// The engine's options (the per-call deadline).
    pub opts: TransferOptions,
    /// Descriptors of the whole transfer (its local list), for naming failed ones.
    pub descriptors: usize,
}

impl Transport for RdmaTransport<'_> {
    type Request<'a> = RdmaRequest;

    async fn transfer(
        &self,
        op: Op,
        request: Self::Request<'_>,
    ) -> Result<TransferStats, AgentError> {
        let parts = request.parts.len();
        self.rails
            .transfer(op, request.parts, request.opts)
            .await
            .map_err(|f| AgentError::from_failure(f, parts, request.descriptors))
    }
}
