//! Prepared posting, chosen automatically: a small transfer whose descriptors were seen before
//! reuses the plan checked and made the first time, as a [`super::PreparedTransfer`] would.
//!
//! A plan depends only on the connection (its limits, fixed for its epoch), the operation, the
//! local regions (their address, length, key and engine, fixed for a region's life), the local
//! descriptors and the remote ones. The cache keys on exactly those: the connection and its
//! epoch, the operation, each region's identity ([`RegionIdentity`]: it keeps the handle's
//! allocation but not the region, so a released region deregisters as before and no later
//! region can take its address), and the descriptors by value. A hit is then the plan the
//! transfer would have made; the connection's liveness, its epoch and the notification are
//! still checked on every post.
//!
//! Only transfers of at most [`PLAN_CACHE_MAX_DESCS`] descriptors on each side are cached
//! (a long scattered list costs more to compare than the planning it would save, and is rarely
//! the same twice). A plan is stored the second time its key is seen within a short window, so
//! descriptors that never repeat cost a fingerprint and one comparison, and no allocation.

use std::rc::Rc;

use rixl_proto::{ConnId, LocalDesc, Op, Plan, RemoteDesc};
use smallvec::SmallVec;

use crate::desc::{LocalDescList, RegionIdentity, RemoteDescList};

/// Transfers of at most this many local and remote descriptors have their plans cached.
pub(crate) const PLAN_CACHE_MAX_DESCS: usize = 4;

/// Plans kept (direct-mapped by fingerprint).
const ENTRIES: usize = 32;

/// Fingerprints remembered to spot a key's second sighting.
const SEEN: usize = 64;

struct Entry {
    fingerprint: u64,
    conn: ConnId,
    epoch: u64,
    op: Op,
    regions: SmallVec<[RegionIdentity; 2]>,
    local: SmallVec<[LocalDesc; PLAN_CACHE_MAX_DESCS]>,
    remote: SmallVec<[RemoteDesc; PLAN_CACHE_MAX_DESCS]>,
    plan: Rc<Plan>,
}

/// A transfer's key, borrowed from its descriptor lists.
pub(crate) struct Key<'a> {
    conn: ConnId,
    op: Op,
    local: &'a LocalDescList,
    remote: &'a RemoteDescList,
    fingerprint: u64,
}

/// The engine's cache of small transfers' plans.
pub(crate) struct PlanCache {
    entries: Vec<Option<Entry>>,
    seen: [u64; SEEN],
}

impl Default for PlanCache {
    fn default() -> Self {
        PlanCache {
            entries: (0..ENTRIES).map(|_| None).collect(),
            seen: [0; SEEN],
        }
    }
}

/// One step of the fingerprint's mixing (a multiply-rotate hash over the key's words).
fn mix(h: u64, x: u64) -> u64 {
    (h ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29)
}

impl<'a> Key<'a> {
    /// The key of a transfer, or `None` when it is too large to cache.
    pub(crate) fn of(
        conn: ConnId,
        op: Op,
        local: &'a LocalDescList,
        remote: &'a RemoteDescList,
    ) -> Option<Self> {
        if local.len() > PLAN_CACHE_MAX_DESCS || remote.0.len() > PLAN_CACHE_MAX_DESCS {
            return None;
        }
        let mut h = mix(u64::from(conn.0), op as u64 + 1);
        for r in local.regions() {
            h = mix(h, RegionIdentity::addr_of(r) as u64);
        }
        for d in local.descs() {
            h = mix(mix(mix(h, u64::from(d.region)), d.offset), d.len);
        }
        for d in &remote.0 {
            h = mix(mix(mix(h, d.addr), d.len), u64::from(d.rkey));
        }
        Some(Key {
            conn,
            op,
            local,
            remote,
            fingerprint: h | 1,
        })
    }
}

impl Entry {
    fn matches(&self, k: &Key<'_>) -> bool {
        self.fingerprint == k.fingerprint
            && self.conn == k.conn
            && self.op == k.op
            && self.local.as_slice() == k.local.descs()
            && self.remote.as_slice() == k.remote.0.as_slice()
            && self.regions.len() == k.local.regions().len()
            && self
                .regions
                .iter()
                .zip(k.local.regions())
                .all(|(id, r)| id.is(r))
    }
}

impl PlanCache {
    fn slot(fingerprint: u64, n: usize) -> usize {
        (fingerprint >> 7) as usize % n
    }

    /// The cached plan of `k` and the epoch it was made in.
    pub(crate) fn get(&self, k: &Key<'_>) -> Option<(u64, Rc<Plan>)> {
        match &self.entries[Self::slot(k.fingerprint, ENTRIES)] {
            Some(e) if e.matches(k) => Some((e.epoch, Rc::clone(&e.plan))),
            _ => None,
        }
    }

    /// `plan` was made for `k` in `epoch`: kept if `k` was seen recently (its second sighting),
    /// else remembered as seen. Returns whether it was kept.
    pub(crate) fn offer(&mut self, k: &Key<'_>, epoch: u64, plan: &Plan) -> bool {
        let seen = &mut self.seen[Self::slot(k.fingerprint, SEEN)];
        if *seen != k.fingerprint {
            *seen = k.fingerprint;
            return false;
        }
        let slot = &mut self.entries[Self::slot(k.fingerprint, ENTRIES)];
        // Reuse the evicted plan's vectors when no transfer holds them any more.
        let mut old = slot.take().map(|e| e.plan);
        let plan = match old.as_mut().and_then(Rc::get_mut) {
            Some(p) => {
                p.clone_from(plan);
                old.take().unwrap_or_default()
            }
            None => Rc::new(plan.clone()),
        };
        *slot = Some(Entry {
            fingerprint: k.fingerprint,
            conn: k.conn,
            epoch,
            op: k.op,
            regions: k.local.regions().iter().map(|r| r.identity()).collect(),
            local: k.local.descs().iter().copied().collect(),
            remote: k.remote.0.iter().copied().collect(),
            plan,
        });
        true
    }

    /// Forgets every plan.
    #[cfg(test)]
    fn clear(&mut self) {
        self.entries.iter_mut().for_each(|e| *e = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::Region;

    fn list(r: &Region, offset: u64, len: u64) -> LocalDescList {
        let mut l = LocalDescList::new();
        l.push(r, offset, len);
        l
    }

    fn remote(addr: u64) -> RemoteDescList {
        RemoteDescList(vec![RemoteDesc {
            addr,
            len: 64,
            rkey: 9,
        }])
    }

    fn plan(bytes: u64) -> Plan {
        Plan {
            bytes,
            ..Plan::default()
        }
    }

    #[test]
    fn plan_cache_keeps_a_plan_on_its_second_sighting_and_matches_every_field() {
        let region = Region::unregistered(4096).unwrap();
        let mut cache = PlanCache::default();
        let (l, r) = (list(&region, 0, 64), remote(0x1000));
        let k = Key::of(ConnId(1), Op::Write, &l, &r).unwrap();
        assert!(cache.get(&k).is_none());
        assert!(
            !cache.offer(&k, 7, &plan(64)),
            "first sighting: only remembered"
        );
        assert!(cache.get(&k).is_none());
        assert!(cache.offer(&k, 7, &plan(64)), "second sighting: kept");
        let (epoch, p) = cache.get(&k).expect("hit");
        assert_eq!((epoch, p.bytes), (7, 64));
        // Every part of the key matters.
        let other = Region::unregistered(4096).unwrap();
        let misses = [
            (ConnId(2), Op::Write, list(&region, 0, 64), remote(0x1000)),
            (ConnId(1), Op::Read, list(&region, 0, 64), remote(0x1000)),
            (ConnId(1), Op::Write, list(&region, 64, 64), remote(0x1000)),
            (ConnId(1), Op::Write, list(&region, 0, 32), remote(0x1000)),
            (ConnId(1), Op::Write, list(&region, 0, 64), remote(0x2000)),
            (ConnId(1), Op::Write, list(&other, 0, 64), remote(0x1000)),
        ];
        for (conn, op, l, r) in &misses {
            let k = Key::of(*conn, *op, l, r).unwrap();
            assert!(
                cache.get(&k).is_none(),
                "{conn:?} {op:?} {:?} {r:?}",
                l.descs()
            );
        }
        cache.clear();
        assert!(cache.get(&k).is_none());
    }

    #[test]
    fn plan_cache_never_matches_a_region_that_took_a_released_ones_place() {
        let mut cache = PlanCache::default();
        let r = remote(0x1000);
        let first = Region::unregistered(4096).unwrap();
        let l = list(&first, 0, 64);
        let k = Key::of(ConnId(0), Op::Write, &l, &r).unwrap();
        cache.offer(&k, 1, &plan(64));
        cache.offer(&k, 1, &plan(64));
        assert!(cache.get(&k).is_some());
        drop(k);
        drop(l);
        drop(first);
        // New regions of the same size cannot reuse the released handle's allocation while the
        // cache names it, so none of them matches.
        for _ in 0..64 {
            let again = Region::unregistered(4096).unwrap();
            let l = list(&again, 0, 64);
            let k = Key::of(ConnId(0), Op::Write, &l, &r).unwrap();
            assert!(cache.get(&k).is_none());
        }
    }

    #[test]
    fn plan_cache_skips_long_lists() {
        let region = Region::unregistered(1 << 16).unwrap();
        let mut l = LocalDescList::new();
        for i in 0..(PLAN_CACHE_MAX_DESCS as u64 + 1) {
            l.push(&region, i * 64, 64);
        }
        let r = RemoteDescList(vec![RemoteDesc {
            addr: 0,
            len: 64 * (PLAN_CACHE_MAX_DESCS as u64 + 1),
            rkey: 1,
        }]);
        assert!(Key::of(ConnId(0), Op::Write, &l, &r).is_none());
    }
}
