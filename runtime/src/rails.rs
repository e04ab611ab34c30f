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

    /// The rails a transfer of `bytes` goes on, given the rails its memory prefers (first
    /// preferred; see [`lanes`]): the first alone below [`STRIPE_MIN`] bytes, all of them from
    /// there on.
    pub fn stripes(&self, bytes: u64, preferred: &[usize]) -> Vec<usize> {
        match preferred {
            [] => vec![0],
            [first, ..] if bytes < STRIPE_MIN => vec![*first],
            all => all.to_vec(),
        }
    }

    /// Splits a transfer over `lanes` (rail indexes; slices of [`STRIPE_SLICE`] dealt
    /// round-robin), each part renamed onto its rail's keys. Empty parts are left out.
    ///
    /// # Errors
    /// As [`RailKeys::local_on`].
    pub fn split(
        local: &LocalDescList,
        remote: &RemoteDescList,
        lanes: &[usize],
        keys: &impl RailKeys,
    ) -> Result<Vec<RailSlice>, TransferError> {
        let lanes = if lanes.is_empty() { &[0][..] } else { lanes };
        let parts = split_stream(local, remote, lanes.len(), STRIPE_SLICE);
        let mut out = Vec::with_capacity(parts.len());
        for (&rail, (l, r)) in lanes.iter().zip(parts) {
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
        // One part (every transfer below the striping size): no boxed future, no join.
        let parts = match <[RailPart; 1]>::try_from(parts) {
            Ok([p]) => {
                let engine = self.engine(p.slice.rail);
                return counts_of(
                    engine
                        .transfer_ranges(p.conn, op, p.slice.local, p.slice.remote, opts)
                        .await,
                );
            }
            Err(parts) => parts,
        };
        // Every part is started before the caller spins for the replies, once, for all.
        let first = self.engine(parts.first().map_or(0, |p| p.slice.rail));
        let futs: Vec<_> = parts
            .into_iter()
            .map(|p| {
                let engine = self.engine(p.slice.rail).clone();
                Box::pin(async move {
                    engine
                        .transfer_ranges_unspun(p.conn, op, p.slice.local, p.slice.remote, opts)
                        .await
                })
            })
            .collect();
        sum_stats(first.spin_for_reply(join_all(futs)).await)
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
        if let [p] = parts {
            return counts_of(self.engine(p.rail).post_ranges(&p.prepared, opts).await);
        }
        let first = self.engine(parts.first().map_or(0, |p| p.rail));
        let futs: Vec<_> = parts
            .iter()
            .map(|p| {
                let engine = self.engine(p.rail).clone();
                let prepared = Arc::clone(&p.prepared);
                Box::pin(async move { engine.post_ranges_unspun(&prepared, opts).await })
            })
            .collect();
        sum_stats(first.spin_for_reply(join_all(futs)).await)
    }
}

/// The rails a transfer between local memory bound to `local` and remote memory bound to
/// `remote` may use (rail indexes, first preferred), when both agents have `shared` rails
/// (matched by index): the local binding's rails the remote memory is bound to as well; where
/// they have none in common, the local binding's (every region is registered on every rail, so
/// the peer's memory is reachable there, only farther from it); where the local binding has
/// none below `shared`, rail 0.
pub fn lanes(local: &[usize], remote: &[usize], shared: usize) -> Vec<usize> {
    let shared = shared.max(1);
    let both: Vec<usize> = local
        .iter()
        .copied()
        .filter(|r| *r < shared && (remote.is_empty() || remote.contains(r)))
        .collect();
    if !both.is_empty() {
        return both;
    }
    let mine: Vec<usize> = local.iter().copied().filter(|r| *r < shared).collect();
    if mine.is_empty() {
        vec![0]
    } else {
        mine
    }
}

/// The sum of a striped transfer's per-rail results (the first error if any failed).
///
/// # Errors
/// The first error.
pub fn sum_stats<E>(results: Vec<Result<TransferStats, E>>) -> Result<TransferStats, E> {
    let mut total = TransferStats::default();
    for r in results {
        add_counts(&mut total, &r?);
    }
    Ok(total)
}

/// Adds the counts of `st` (not its timings) to `total`.
fn add_counts(total: &mut TransferStats, st: &TransferStats) {
    total.bytes += st.bytes;
    total.descriptors += st.descriptors;
    total.work_requests += st.work_requests;
    total.doorbells += st.doorbells;
}

/// The counts of one part's stats, as [`sum_stats`] gives them for several.
fn counts_of<E>(r: Result<TransferStats, E>) -> Result<TransferStats, E> {
    let mut total = TransferStats::default();
    add_counts(&mut total, &r?);
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::Region;

    fn stats(bytes: u64, descriptors: usize, work_requests: usize) -> TransferStats {
        TransferStats::new(bytes, descriptors, work_requests, 1)
    }

    /// Rails without NICs: each rail's "registration" of a region is another host region of the
    /// same length (its twin), and the peer's key on rail `r` is the rail-0 key plus `r << 24`.
    struct TwinKeys {
        /// For each rail-0 region, its twin on rails 1.. (index `rail - 1`).
        twins: Vec<(Region, Vec<Region>)>,
    }

    impl RailKeys for TwinKeys {
        fn local_on(
            &self,
            list: &LocalDescList,
            rail: usize,
        ) -> Result<LocalDescList, TransferError> {
            let mut out = LocalDescList::new();
            for d in list.descs() {
                let r0 = &list.regions()[d.region as usize];
                let twin = self
                    .twins
                    .iter()
                    .find(|(r, _)| r.same(r0))
                    .and_then(|(_, t)| t.get(rail - 1))
                    .ok_or(TransferError::InvalidDescriptor(
                        crate::InvalidDescriptor::ForeignRegion { index: 0 },
                    ))?;
                out.push(twin, d.offset, d.len);
            }
            Ok(out)
        }

        fn rkey_on(&self, rkey: u32, rail: usize) -> u32 {
            rkey + ((rail as u32) << 24)
        }
    }

    fn host(len: usize) -> Region {
        Region::host(rixl_verbs::HostBuffer::new(len).expect("host memory"), 1)
    }

    #[test]
    fn vram_rails_lanes_follow_both_bindings() {
        // Both bound to rail 2 of 4: rail 2 alone.
        assert_eq!(lanes(&[2], &[2], 4), [2]);
        // Local bound to rails 1 and 0 (1 preferred), remote to 0: the common rail.
        assert_eq!(lanes(&[1, 0], &[0], 4), [0]);
        // Nothing in common: the local binding (the peer's memory is registered there too).
        assert_eq!(lanes(&[3], &[0, 1], 4), [3]);
        // The peer has fewer rails than the local binding names: those it has, else rail 0.
        assert_eq!(lanes(&[3, 1], &[], 2), [1]);
        assert_eq!(lanes(&[3], &[3], 2), [0]);
        assert_eq!(lanes(&[], &[], 1), [0]);
    }

    #[test]
    fn vram_rails_a_striped_transfer_goes_on_each_rails_own_registrations() {
        // Four rails; a 6 MiB region bound to rails 3 and 1 (3 preferred) on both sides.
        let len = 6usize << 20;
        let r0 = host(len);
        let twins: Vec<Region> = (1..4).map(|_| host(len)).collect();
        let keys = TwinKeys {
            twins: vec![(r0.clone(), twins.clone())],
        };
        let mut local = LocalDescList::new();
        local.push(&r0, 0, len as u64);
        let remote = RemoteDescList(vec![RemoteDesc {
            addr: 0x10_0000,
            len: len as u64,
            rkey: 7,
        }]);
        let lanes = lanes(&[3, 1], &[1, 3], 4);
        assert_eq!(lanes, [3, 1]);
        let rails = Rails::split(&local, &remote, &lanes, &keys).expect("split");
        assert_eq!(rails.len(), 2);
        let mut bytes = 0;
        for part in &rails {
            let twin = &twins[part.rail - 1];
            // Every local piece is on the rail's own registration, never on rail 0's.
            assert!(part.local.regions().iter().all(|r| r.same(twin)));
            assert!(part
                .remote
                .0
                .iter()
                .all(|d| d.rkey == 7 + ((part.rail as u32) << 24)));
            bytes += part.local.total_len();
            assert_eq!(part.local.total_len(), part.remote.total_len());
        }
        assert_eq!(bytes, len as u64, "every byte on exactly one rail");
        assert_eq!(rails[0].rail, 3, "the preferred rail takes the first slice");
        // Memory with no registration on a rail is refused, typed, not posted.
        let lone = host(4096);
        let mut foreign = LocalDescList::new();
        foreign.push(&lone, 0, 4096);
        let r = Rails::split(
            &foreign,
            &RemoteDescList(vec![RemoteDesc {
                addr: 0,
                len: 4096,
                rkey: 1,
            }]),
            &[2],
            &keys,
        );
        assert!(matches!(
            r,
            Err(TransferError::InvalidDescriptor(
                crate::InvalidDescriptor::ForeignRegion { .. }
            ))
        ));
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
