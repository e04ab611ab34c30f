//! Multi-rail RDMA: one engine per NIC, and a large transfer striped over the rails both sides
//! have: slices of [`STRIPE_SLICE`] bytes dealt round-robin, each rail's part on its own engine
//! and connection, all in flight at once.

use std::sync::Arc;

use crate::desc::{split_stream, LocalDescList, RemoteDesc, RemoteDescList};
use crate::engine::{ConnId, PreparedTransfer, TransferOptions, TransferStats};
use crate::error::TransferError;
use crate::handle::EngineHandle;
use crate::join::join_all;
use crate::Op;
use rixl_proto::TransferFailure;

/// Transfers of at least this many bytes are striped over the rails both sides have.
pub const STRIPE_MIN: u64 = 4 << 20;
/// Slice size of a striped transfer.
pub const STRIPE_SLICE: u64 = 1 << 20;

/// How memory is named on a rail other than 0: the same local memory's registration with that
/// rail's NIC, and the peer's key for the same region there.
pub trait RailKeys {
    /// `list` (built on rail-0 registrations) on `rail`'s registrations.
    ///
    /// # Errors
    /// [`TransferError::InvalidDescriptor`] for memory not registered on `rail`.
    fn local_on(&self, list: &LocalDescList, rail: usize) -> Result<LocalDescList, TransferError>;

    /// The peer's key on `rail` for the region whose rail-0 key is `rkey` (0: none).
    fn rkey_on(&self, rkey: u32, rail: usize) -> u32;
}

/// One rail's slices of a striped transfer, named with that rail's keys.
#[derive(Debug, Clone)]
pub struct RailSlice {
    /// The rail.
    pub rail: usize,
    /// Local pieces, on the rail's registrations.
    pub local: LocalDescList,
    /// Remote pieces, with the rail's keys.
    pub remote: RemoteDescList,
}

/// A rail's part with the connection it goes on.
#[derive(Debug, Clone)]
pub struct RailPart {
    /// The slices.
    pub slice: RailSlice,
    /// The connection to the peer on that rail.
    pub conn: ConnId,
}

/// A rail's part, checked and planned once on its engine.
#[derive(Debug, Clone)]
pub struct PreparedPart {
    /// The rail.
    pub rail: usize,
    /// The prepared transfer on that rail's engine.
    pub prepared: Arc<PreparedTransfer>,
}

/// The engines of an agent's rails (rail 0 first).
#[derive(Debug, Clone)]
pub struct Rails {
    engines: Vec<EngineHandle>,
}

impl Rails {
    /// Rails over `engines` (at least one).
    pub fn new(engines: Vec<EngineHandle>) -> Self {
        assert!(!engines.is_empty(), "a rail set needs an engine");
        Rails { engines }
    }

    /// Number of rails.
    pub fn len(&self) -> usize {
        self.engines.len()
    }

    /// Whether there is only rail 0 (never empty).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The engine of `rail` (rail 0's for one that does not exist).
    pub fn engine(&self, rail: usize) -> &EngineHandle {
        self.engines.get(rail).unwrap_or(&self.engines[0])
    }

    /// Every engine, rail 0 first.
    pub fn engines(&self) -> &[EngineHandle] {
        &self.engines
    }

    /// How many rails a transfer of `bytes` with a peer that has `peer_rails` uses: all the
    /// rails both have from [`STRIPE_MIN`] bytes on, else one.
    pub fn stripes(&self, bytes: u64, peer_rails: usize) -> usize {
        let shared = self.engines.len().min(peer_rails.max(1));
        if shared > 1 && bytes >= STRIPE_MIN {
            shared
        } else {
            1
        }
    }

    /// Splits a transfer over `rails` rails (slices of [`STRIPE_SLICE`] round-robin), each
    /// part renamed onto its rail's keys. Empty parts are left out.
    ///
    /// # Errors
    /// As [`RailKeys::local_on`].
    pub fn split(
        &self,
        local: &LocalDescList,
        remote: &RemoteDescList,
        rails: usize,
        keys: &impl RailKeys,
    ) -> Result<Vec<RailSlice>, TransferError> {
        let parts = split_stream(local, remote, rails.max(1), STRIPE_SLICE);
        let mut out = Vec::with_capacity(parts.len());
        for (rail, (l, r)) in parts.into_iter().enumerate() {
            if l.is_empty() {
                continue;
            }
            let (local, remote) = if rail == 0 {
                (l, r)
            } else {
                let remote =
                    r.0.iter()
                        .map(|d| RemoteDesc {
                            rkey: keys.rkey_on(d.rkey, rail),
                            ..*d
                        })
                        .collect();
                (keys.local_on(&l, rail)?, remote)
            };
            out.push(RailSlice {
                rail,
                local,
                remote,
            });
        }
        Ok(out)
    }

    /// Runs every part at once, each on its rail's engine; the sum of their results (the first
    /// error if any failed).
    ///
    /// # Errors
    /// The first part's error.
    pub async fn transfer(
        &self,
        op: Op,
        parts: Vec<RailPart>,
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        let futs: Vec<_> = parts
            .into_iter()
            .map(|p| {
                let engine = self.engine(p.slice.rail).clone();
                Box::pin(async move {
                    engine
                        .transfer_ranges(p.conn, op, p.slice.local, p.slice.remote, opts)
                        .await
                })
            })
            .collect();
        sum_stats(join_all(futs).await)
    }

    /// Checks and plans every part once on its rail's engine.
    ///
    /// # Errors
    /// The first part's error.
    pub async fn prepare(
        &self,
        op: Op,
        parts: Vec<RailPart>,
    ) -> Result<Vec<PreparedPart>, TransferError> {
        let mut out = Vec::with_capacity(parts.len());
        for p in parts {
            let rail = p.slice.rail;
            let prepared = self
                .engine(rail)
                .prepare_transfer(p.conn, op, p.slice.local, p.slice.remote)
                .await?;
            out.push(PreparedPart { rail, prepared });
        }
        Ok(out)
    }

    /// Posts every prepared part at once; the sum of their results.
    ///
    /// # Errors
    /// The first part's error.
    pub async fn post(
        &self,
        parts: &[PreparedPart],
        opts: TransferOptions,
    ) -> Result<TransferStats, TransferFailure> {
        let futs: Vec<_> = parts
            .iter()
            .map(|p| {
                let engine = self.engine(p.rail).clone();
                let prepared = Arc::clone(&p.prepared);
                Box::pin(async move { engine.post_ranges(&prepared, opts).await })
            })
            .collect();
        sum_stats(join_all(futs).await)
    }
}

/// The sum of a striped transfer's per-rail results (the first error if any failed).
///
/// # Errors
/// The first error.
pub fn sum_stats<E>(results: Vec<Result<TransferStats, E>>) -> Result<TransferStats, E> {
    let mut total = TransferStats::default();
    for r in results {
        let st = r?;
        total.bytes += st.bytes;
        total.descriptors += st.descriptors;
        total.work_requests += st.work_requests;
        total.doorbells += st.doorbells;
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bytes: u64, descriptors: usize, work_requests: usize) -> TransferStats {
        TransferStats::new(bytes, descriptors, work_requests, 1)
    }

    #[test]
    fn rail_results_add_up_and_a_failed_rail_fails_the_transfer() {
        let total =
            sum_stats::<TransferError>(vec![Ok(stats(3 << 20, 3, 3)), Ok(stats(2 << 20, 2, 2))])
                .expect("both rails ok");
        assert_eq!(
            (
                total.bytes,
                total.descriptors,
                total.work_requests,
                total.doorbells
            ),
            (5 << 20, 5, 5, 2)
        );
        let failed = sum_stats(vec![
            Ok(stats(1, 1, 1)),
            Err(TransferError::Timeout(std::time::Duration::from_secs(1))),
        ]);
        assert!(matches!(failed, Err(TransferError::Timeout(_))));
    }
}
