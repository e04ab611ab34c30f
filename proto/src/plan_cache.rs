//! Plans kept for transfers that repeat: prepared posting chosen automatically.
//!
//! A serving engine that re-sends the same small transfer (a fixed KV layout, a flag, a weight
//! shard to the same peer) would skip validation and planning on every post after the first if it
//! prepared the transfer. The cache gives that to plain transfers: a transfer on the same
//! connection, in the same direction, over the same regions and the same local and remote ranges
//! as one planned recently posts that plan (shared, not copied) instead of being checked and
//! planned again.
//!
//! A region is named by an identity its owner never gives to another region (the runtime numbers
//! regions from a counter), so a kept plan's local keys and addresses are those of the live region
//! the transfer names. A plan is only used while its connection keeps the epoch it was planned
//! under (the caller checks it, as it does for a prepared transfer).
//!
//! The cache learns whether it pays: after [`PLAN_CACHE_COLD_AFTER`] lookups in a row that found
//! nothing (transfers that never repeat, such as scattered KV blocks), it stops looking and
//! keeping, except for every [`PLAN_CACHE_PROBE_EVERY`]-th transfer, which looks and keeps as
//! before; a probe that finds its plan turns the cache back on.

use std::rc::Rc;

use smallvec::SmallVec;

use crate::desc::{LocalDesc, Op, RemoteDesc};
use crate::plan::Plan;
use crate::stats::ConnId;

/// Plans kept per engine.
pub const PLAN_CACHE_ENTRIES: usize = 16;
/// Transfers with more local or remote descriptors than this are not kept: their checks and
/// planning are shared by their many descriptors, and comparing them would cost about as much.
pub const PLAN_CACHE_MAX_DESCS: usize = 8;
/// Lookups in a row that found nothing after which the cache goes cold.
pub const PLAN_CACHE_COLD_AFTER: u32 = 64;
/// While cold, every this many transfers one looks and keeps (a probe).
pub const PLAN_CACHE_PROBE_EVERY: u32 = 64;

/// What names a transfer for the cache: two transfers of equal keys have the same plan (under
/// the same connection epoch).
#[derive(Debug, Clone)]
pub struct PlanKey<'a, R> {
    /// The connection.
    pub conn: ConnId,
    /// READ or WRITE.
    pub op: Op,
    /// The identities of the regions `local` indexes, in order; never given to another region
    /// by their owner.
    pub regions: R,
    /// The local descriptors.
    pub local: &'a [LocalDesc],
    /// The remote descriptors.
    pub remote: &'a [RemoteDesc],
}

impl<R: ExactSizeIterator<Item = u64> + Clone> PlanKey<'_, R> {
    /// Whether the cache takes transfers of this size.
    fn small(&self) -> bool {
        self.local.len() <= PLAN_CACHE_MAX_DESCS && self.remote.len() <= PLAN_CACHE_MAX_DESCS
    }
}

/// What a kept plan was planned for.
#[derive(Debug, Clone, Default)]
struct Entry {
    conn: ConnId,
    op: Option<Op>,
    epoch: u64,
    regions: SmallVec<[u64; 2]>,
    local: SmallVec<[LocalDesc; 2]>,
    remote: SmallVec<[RemoteDesc; 2]>,
    plan: Rc<Plan>,
}

impl Entry {
    fn matches<R>(&self, key: &PlanKey<'_, R>) -> bool
    where
        R: ExactSizeIterator<Item = u64> + Clone,
    {
        self.op == Some(key.op)
            && self.conn == key.conn
            && self.local.len() == key.local.len()
            && self.remote.len() == key.remote.len()
            && self.regions.len() == key.regions.len()
            && self.local.as_slice() == key.local
            && self.remote.as_slice() == key.remote
            && self.regions.iter().copied().eq(key.regions.clone())
    }
}

/// What a lookup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A kept plan, to post as it is.
    Hit {
        /// The connection epoch it was planned under.
        epoch: u64,
        /// The plan (shared with the cache: a transfer posting it holds it while it posts).
        plan: Rc<Plan>,
    },
    /// Nothing kept matched: plan it, then [`PlanCache::keep`] it.
    Miss,
    /// The cache is cold or the transfer too large: plan it and do not keep it.
    Skip,
}

/// Recently planned small transfers (see the module docs).
#[derive(Debug, Default)]
pub struct PlanCache {
    entries: Vec<Entry>,
    /// Next entry to replace (oldest first).
    next: usize,
    /// Lookups in a row that found nothing.
    misses: u32,
    /// Transfers seen while cold.
    seen_cold: u32,
}

impl PlanCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether it stopped looking (see the module docs).
    pub fn cold(&self) -> bool {
        self.misses >= PLAN_CACHE_COLD_AFTER
    }

    /// Plans kept.
    pub fn len(&self) -> usize {
        self.entries.iter().filter(|e| e.op.is_some()).count()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Looks for a plan of this transfer.
    pub fn lookup<R>(&mut self, key: &PlanKey<'_, R>) -> Lookup
    where
        R: ExactSizeIterator<Item = u64> + Clone,
    {
        if !key.small() {
            return Lookup::Skip;
        }
        if self.cold() {
            self.seen_cold = self.seen_cold.wrapping_add(1);
            if !self.seen_cold.is_multiple_of(PLAN_CACHE_PROBE_EVERY) {
                return Lookup::Skip;
            }
        }
        match self.entries.iter().find(|e| e.matches(key)) {
            Some(e) => {
                self.misses = 0;
                Lookup::Hit {
                    epoch: e.epoch,
                    plan: Rc::clone(&e.plan),
                }
            }
            None => {
                self.misses = self.misses.saturating_add(1);
                Lookup::Miss
            }
        }
    }

    /// Keeps `plan`, planned for this transfer under connection epoch `epoch`, in place of the
    /// oldest kept plan (or of a plan kept for the same transfer under an older epoch).
    pub fn keep<R>(&mut self, key: &PlanKey<'_, R>, epoch: u64, plan: &Plan)
    where
        R: ExactSizeIterator<Item = u64> + Clone,
    {
        if !key.small() {
            return;
        }
        let i = match self.entries.iter().position(|e| e.matches(key)) {
            Some(i) => i,
            None if self.entries.len() < PLAN_CACHE_ENTRIES => {
                self.entries.push(Entry::default());
                self.entries.len() - 1
            }
            None => {
                let i = self.next;
                self.next = (self.next + 1) % PLAN_CACHE_ENTRIES;
                i
            }
        };
        let e = &mut self.entries[i];
        e.conn = key.conn;
        e.op = Some(key.op);
        e.epoch = epoch;
        e.regions.clear();
        e.regions.extend(key.regions.clone());
        e.local.clear();
        e.local.extend_from_slice(key.local);
        e.remote.clear();
        e.remote.extend_from_slice(key.remote);
        match Rc::get_mut(&mut e.plan) {
            // No transfer is posting the old plan: its allocations are reused.
            Some(kept) => copy_plan(kept, plan),
            None => e.plan = Rc::new(plan.clone()),
        }
    }

    /// Drops every plan kept for `conn` (it was removed, and its id may be reused).
    pub fn forget(&mut self, conn: ConnId) {
        for e in self.entries.iter_mut().filter(|e| e.conn == conn) {
            e.op = None;
        }
    }
}

/// Copies `from` into `to`, reusing `to`'s allocations.
fn copy_plan(to: &mut Plan, from: &Plan) {
    to.wrs.clear();
    to.wrs.extend_from_slice(&from.wrs);
    to.sges.clear();
    to.sges.extend_from_slice(&from.sges);
    to.bytes = from.bytes;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::RegionInfo;
    use crate::plan::{plan, Limits};

    const LIMITS: Limits = Limits {
        max_sge: 4,
        max_msg: 1 << 20,
    };
    const REGION: RegionInfo = RegionInfo {
        addr: 0x1000,
        len: 1 << 16,
        lkey: 7,
    };

    fn ld(offset: u64, len: u64) -> LocalDesc {
        LocalDesc {
            region: 0,
            offset,
            len,
        }
    }

    fn rd(addr: u64, len: u64) -> RemoteDesc {
        RemoteDesc { addr, len, rkey: 9 }
    }

    fn planned(local: &[LocalDesc], remote: &[RemoteDesc]) -> Plan {
        plan(&[REGION], local, remote, LIMITS).expect("valid")
    }

    type Ids = std::array::IntoIter<u64, 1>;

    fn key<'a>(
        conn: u32,
        op: Op,
        id: u64,
        local: &'a [LocalDesc],
        remote: &'a [RemoteDesc],
    ) -> PlanKey<'a, Ids> {
        PlanKey {
            conn: ConnId(conn),
            op,
            regions: [id].into_iter(),
            local,
            remote,
        }
    }

    #[test]
    fn a_repeated_transfer_gets_the_plan_it_was_planned_with() {
        let mut c = PlanCache::new();
        let (local, remote) = ([ld(0, 64), ld(128, 64)], [rd(0x9000, 128)]);
        let k = key(1, Op::Write, 11, &local, &remote);
        assert_eq!(c.lookup(&k), Lookup::Miss);
        let p = planned(&local, &remote);
        c.keep(&k, 3, &p);
        assert_eq!(
            c.lookup(&k),
            Lookup::Hit {
                epoch: 3,
                plan: Rc::new(p)
            }
        );
    }

    #[test]
    fn another_region_connection_direction_or_range_misses() {
        let mut c = PlanCache::new();
        let (local, remote) = ([ld(0, 64)], [rd(0x9000, 64)]);
        c.keep(
            &key(1, Op::Write, 11, &local, &remote),
            1,
            &planned(&local, &remote),
        );
        let other_rkey = [RemoteDesc {
            rkey: 10,
            ..remote[0]
        }];
        for k in [
            key(2, Op::Write, 11, &local, &remote),
            key(1, Op::Read, 11, &local, &remote),
            key(1, Op::Write, 12, &local, &remote),
            key(1, Op::Write, 11, &[ld(64, 64)], &remote),
            key(1, Op::Write, 11, &local, &[rd(0x9040, 64)]),
            key(1, Op::Write, 11, &local, &other_rkey),
        ] {
            assert_eq!(c.lookup(&k), Lookup::Miss, "{k:?}");
        }
        let k = key(1, Op::Write, 11, &local, &remote);
        assert!(matches!(c.lookup(&k), Lookup::Hit { epoch: 1, .. }));
    }

    #[test]
    fn large_lists_are_not_kept() {
        let mut c = PlanCache::new();
        let n = PLAN_CACHE_MAX_DESCS as u64 + 1;
        let local: Vec<_> = (0..n).map(|i| ld(i * 64, 64)).collect();
        let remote = [rd(0x9000, n * 64)];
        let k = key(1, Op::Write, 1, &local, &remote);
        c.keep(&k, 1, &planned(&local, &remote));
        assert!(c.is_empty());
        assert_eq!(c.lookup(&k), Lookup::Skip);
    }

    #[test]
    fn the_oldest_plan_makes_room_and_a_replanned_transfer_replaces_its_own() {
        let mut c = PlanCache::new();
        let remote = [rd(0x9000, 64)];
        for i in 0..=PLAN_CACHE_ENTRIES as u64 {
            let local = [ld(i * 64, 64)];
            let k = key(1, Op::Write, 1, &local, &remote);
            c.keep(&k, 1, &planned(&local, &remote));
        }
        assert_eq!(c.len(), PLAN_CACHE_ENTRIES);
        // The first was replaced by the last; the second is still kept.
        let first = [ld(0, 64)];
        let k = key(1, Op::Write, 1, &first, &remote);
        assert_eq!(c.lookup(&k), Lookup::Miss);
        let second = [ld(64, 64)];
        let k = key(1, Op::Write, 1, &second, &remote);
        assert!(matches!(c.lookup(&k), Lookup::Hit { epoch: 1, .. }));
        // Kept again under a new epoch: the same entry, not a second one.
        c.keep(&k, 2, &planned(&second, &remote));
        assert_eq!(c.len(), PLAN_CACHE_ENTRIES);
        assert!(matches!(c.lookup(&k), Lookup::Hit { epoch: 2, .. }));
    }

    #[test]
    fn transfers_that_never_repeat_turn_it_cold_and_a_probe_that_hits_warms_it() {
        let mut c = PlanCache::new();
        let remote = [rd(0x9000, 64)];
        let repeated = [ld(0, 64)];
        let k = key(1, Op::Write, 1, &repeated, &remote);
        c.keep(&k, 1, &planned(&repeated, &remote));
        for i in 1..=u64::from(PLAN_CACHE_COLD_AFTER) {
            let local = [ld(i * 64, 64)];
            let other = key(1, Op::Write, 1, &local, &remote);
            assert_eq!(c.lookup(&other), Lookup::Miss);
        }
        assert!(c.cold());
        // Cold: the repeated transfer is skipped until the probe's turn comes.
        let mut skipped = 0;
        loop {
            match c.lookup(&k) {
                Lookup::Skip => skipped += 1,
                Lookup::Hit { epoch, .. } => {
                    assert_eq!(epoch, 1);
                    break;
                }
                Lookup::Miss => panic!("the plan is kept"),
            }
        }
        assert_eq!(skipped, PLAN_CACHE_PROBE_EVERY - 1);
        assert!(!c.cold());
    }

    #[test]
    fn a_forgotten_connection_keeps_no_plans() {
        let mut c = PlanCache::new();
        let (local, remote) = ([ld(0, 64)], [rd(0x9000, 64)]);
        let k = key(4, Op::Read, 1, &local, &remote);
        c.keep(&k, 1, &planned(&local, &remote));
        c.forget(ConnId(4));
        assert_eq!(c.lookup(&k), Lookup::Miss);
        assert!(c.is_empty());
    }
}
