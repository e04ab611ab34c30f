//! Grants enforced by the NIC: a peer reaches a region of ours only through a type-2 memory
//! window bound on the queue pair of its own connection, with the rights its visibility gives
//! it ([`Visibility::access_for`](super::Visibility)).
//!
//! - Our regions are registered without remote access (their own rkeys reach nothing; the
//!   metadata's keys only name them, flags bit 1 says so).
//! - Accepting a peer's connection binds a window per region it may reach on that connection
//!   and returns the keys in the `CONNECT` reply. A peer asks for the keys of a connection it
//!   did not set up, or of regions registered later, with an authenticated `GRANTS` request;
//!   the windows it lacks are bound then.
//! - Revoking a grant ([`Agent::revoke`]), releasing a region, invalidating a peer or closing a
//!   connection deallocates the windows at once: the next access with their keys completes
//!   with a remote access error.
//!
//! The table is taken on set-ups, `GRANTS` requests and revocations: never on a transfer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::runtime::{Access, ConnId, Grant, GrantSpec, RailPart, Region, RemoteDescList};

use super::peers::Peer;
use super::sidechannel;
use super::snapshot::lock;
use super::{Agent, AgentError, Inner, Registration};

/// The most grant keys a reply carries (12 bytes each).
pub(crate) const MAX_KEYS: usize = 1 << 20;

/// A peer's keys for our regions on one connection, as the peer holds them: region id to the
/// rkey of the window bound for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct GrantKeys {
    pub by_region: HashMap<u64, u32>,
}

impl GrantKeys {
    /// `count u32 | (region u64, rkey u32) per key`, big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let mut keys: Vec<(&u64, &u32)> = self.by_region.iter().collect();
        keys.sort_unstable();
        let mut out = Vec::with_capacity(4 + 12 * keys.len());
        out.extend_from_slice(&(keys.len() as u32).to_be_bytes());
        for (region, rkey) in keys {
            out.extend_from_slice(&region.to_be_bytes());
            out.extend_from_slice(&rkey.to_be_bytes());
        }
        out
    }

    /// Decodes [`Self::encode`]'s bytes: the count must match the length exactly (checked before
    /// anything is allocated).
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] for a malformed list.
    pub fn decode(b: &[u8]) -> Result<Self, AgentError> {
        let bad = || AgentError::SideChannel("malformed grant keys".into());
        let (count, rest) = b.split_first_chunk::<4>().ok_or_else(bad)?;
        let count = u32::from_be_bytes(*count) as usize;
        if count > MAX_KEYS || rest.len() != count * 12 {
            return Err(bad());
        }
        let mut by_region = HashMap::with_capacity(count);
        for k in rest.chunks_exact(12) {
            let (region, rkey) = k.split_at(8);
            let region = u64::from_be_bytes(region.try_into().map_err(|_| bad())?);
            let rkey = u32::from_be_bytes(rkey.try_into().map_err(|_| bad())?);
            if by_region.insert(region, rkey).is_some() {
                return Err(bad());
            }
        }
        Ok(GrantKeys { by_region })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ConnKey {
    rail: usize,
    conn: ConnId,
}

/// The windows bound for one peer on one of our connections.
#[derive(Debug)]
struct ConnGrants {
    peer: String,
    by_region: HashMap<u64, Grant>,
}

/// How grants have been made and ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrantCounters {
    /// Windows bound (one per region, peer and connection).
    pub bound: u64,
    /// Windows deallocated (revoked, released, or their connection closed).
    pub revoked: u64,
    /// Windows bound now.
    pub live: u64,
}

/// Every window this agent has bound, by connection.
#[derive(Debug, Default)]
pub(crate) struct GrantTable {
    conns: Mutex<HashMap<ConnKey, ConnGrants>>,
    bound: std::sync::atomic::AtomicU64,
    revoked: std::sync::atomic::AtomicU64,
}

impl GrantTable {
    fn count_revoked(&self, n: usize) {
        self.revoked
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Deallocates the windows of connection `conn` on `rail` (it is closing).
    pub fn forget_conn(&self, rail: usize, conn: ConnId) {
        let gone = lock(&self.conns).remove(&ConnKey { rail, conn });
        if let Some(g) = gone {
            self.count_revoked(g.by_region.len());
        }
    }

    /// Deallocates the windows of `region` (for `peer` only, or for every peer).
    pub fn revoke_region(&self, region: u64, peer: Option<&str>) -> usize {
        let mut gone = Vec::new();
        for g in lock(&self.conns).values_mut() {
            if peer.is_none_or(|p| p == g.peer) {
                gone.extend(g.by_region.remove(&region));
            }
        }
        self.count_revoked(gone.len());
        gone.len()
    }

    /// Deallocates every window of `peer`.
    pub fn revoke_peer(&self, peer: &str) -> usize {
        let mut n = 0;
        lock(&self.conns).retain(|_, g| {
            if g.peer == peer {
                n += g.by_region.len();
                false
            } else {
                true
            }
        });
        self.count_revoked(n);
        n
    }

    /// Deallocates every window (the agent is shutting down).
    pub fn revoke_all(&self) {
        let all = std::mem::take(&mut *lock(&self.conns));
        self.count_revoked(all.values().map(|g| g.by_region.len()).sum());
    }

    pub fn counters(&self) -> GrantCounters {
        let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        let live = lock(&self.conns)
            .values()
            .map(|g| g.by_region.len() as u64)
            .sum();
        GrantCounters {
            bound: get(&self.bound),
            revoked: get(&self.revoked),
            live,
        }
    }
}

/// A region `peer` may reach on `rail`, with its rights.
struct Wanted {
    id: u64,
    region: Region,
    access: Access,
}

impl Inner {
    /// What `peer` may reach of ours on `rail` now.
    fn wanted(&self, peer: &str, rail: usize) -> Vec<Wanted> {
        self.regs
            .load()
            .iter()
            .filter_map(|(&id, r)| {
                let access = r.visibility.access_for(peer)?;
                let region = if rail == 0 {
                    r.region.clone()
                } else {
                    r.rails.get(rail - 1)?.clone()
                };
                region.registration()?;
                Some(Wanted { id, region, access })
            })
            .collect()
    }

    /// Grants `peer` on our connection `conn` (`rail`) every region it may reach that has no
    /// window there yet (or one with other rights), drops the windows of regions it may no
    /// longer reach, and returns the keys of all. Without NIC grants: no keys.
    ///
    /// # Errors
    /// [`AgentError::Runtime`] if a window cannot be bound (the connection failed, or the
    /// device has no memory windows).
    pub(crate) async fn grant_conn(
        &self,
        peer: &str,
        rail: usize,
        conn: ConnId,
    ) -> Result<GrantKeys, AgentError> {
        if !self.nic_grants {
            return Ok(GrantKeys::default());
        }
        let key = ConnKey { rail, conn };
        let missing: Vec<Wanted> = {
            let table = lock(&self.grants.conns);
            let have = table.get(&key);
            self.wanted(peer, rail)
                .into_iter()
                .filter(|w| {
                    have.and_then(|g| g.by_region.get(&w.id)).map(Grant::access) != Some(w.access)
                })
                .collect()
        };
        let mut made = Vec::new();
        if !missing.is_empty() {
            let specs = missing
                .iter()
                .map(|w| GrantSpec {
                    region: w.region.clone(),
                    access: w.access,
                })
                .collect();
            made = self.rails.engine(rail).grant(conn, specs).await?;
            self.grants
                .bound
                .fetch_add(made.len() as u64, std::sync::atomic::Ordering::Relaxed);
        }
        // Checked again after the binds: a revocation, a release or a close that ran meanwhile
        // wins (its windows go now).
        let wanted: HashMap<u64, Access> = self
            .wanted(peer, rail)
            .into_iter()
            .map(|w| (w.id, w.access))
            .collect();
        let live = self
            .peers
            .load()
            .get(peer)
            .is_some_and(|p| p.conns.holds(rail, conn));
        let mut dropped = Vec::new();
        let keys = {
            let mut table = lock(&self.grants.conns);
            if !live {
                dropped.extend(made);
                dropped.extend(
                    table
                        .remove(&key)
                        .into_iter()
                        .flat_map(|g| g.by_region.into_values()),
                );
                GrantKeys::default()
            } else {
                let entry = table.entry(key).or_insert_with(|| ConnGrants {
                    peer: peer.to_string(),
                    by_region: HashMap::new(),
                });
                for (w, g) in missing.iter().zip(made) {
                    match entry.by_region.get(&w.id) {
                        // A concurrent request bound the same grant first: its key stands.
                        Some(old) if old.access() == g.access() => dropped.push(g),
                        _ => dropped.extend(entry.by_region.insert(w.id, g)),
                    }
                }
                let (keep, gone): (HashMap<u64, Grant>, HashMap<u64, Grant>) =
                    std::mem::take(&mut entry.by_region)
                        .into_iter()
                        .partition(|(id, g)| wanted.get(id) == Some(&g.access()));
                entry.by_region = keep;
                dropped.extend(gone.into_values());
                GrantKeys {
                    by_region: entry
                        .by_region
                        .iter()
                        .map(|(&id, g)| (id, g.rkey()))
                        .collect(),
                }
            }
        };
        self.grants.count_revoked(dropped.len());
        drop(dropped);
        tracing::debug!(agent = %self.name, %peer, rail, conn = conn.0, bound = missing.len(), keys = ?keys.by_region, "granted");
        if !live {
            return Err(AgentError::SideChannel(format!(
                "connection {} on rail {rail} to {peer} closed while granting",
                conn.0
            )));
        }
        Ok(keys)
    }

    /// Closes our connection `conn` on `rail`: its windows first (their grants end at once),
    /// then the queue pair.
    pub(crate) async fn close_conn(&self, rail: usize, conn: ConnId) {
        self.grants.forget_conn(rail, conn);
        self.rails.engine(rail).close_connection(conn).await;
    }
}

impl Inner {
    /// `parts` (named with the peer's metadata keys) on their connections: each key replaced
    /// by our grant key on the part's connection. `p` is the peer as loaded after its
    /// connections were made; keys it lacks are looked for in the newest snapshot, then asked
    /// for once per part (`GRANTS`), by `deadline`. Unchanged for a peer without NIC grants.
    ///
    /// # Errors
    /// [`AgentError::NotGranted`] for a region the peer does not grant us on that connection;
    /// [`AgentError::StaleMetadata`] for a key its metadata no longer has; the side channel's
    /// errors.
    pub(crate) async fn on_grants(
        self: &Arc<Self>,
        peer: &str,
        p: &Arc<Peer>,
        mut parts: Vec<RailPart>,
        deadline: Instant,
    ) -> Result<Vec<RailPart>, AgentError> {
        if !p.metadata.as_ref().is_some_and(|m| m.grants) {
            return Ok(parts);
        }
        let mut p = Arc::clone(p);
        for part in &mut parts {
            let (rail, conn) = (part.slice.rail, part.conn);
            let mut done = false;
            for fresh in [false, true] {
                if fresh {
                    p = self.peer(peer)?;
                }
                if let Some(keys) = p.conns.keys(rail, conn) {
                    if rekey(&p, peer, &mut part.slice.remote, keys)?.is_ok() {
                        done = true;
                        break;
                    }
                }
            }
            if !done {
                let keys = self.fetch_grants(&p, peer, rail, conn, deadline).await?;
                let now = rekey(&p, peer, &mut part.slice.remote, &keys)?;
                self.set_keys(peer, rail, conn, keys);
                now.map_err(|region| AgentError::NotGranted {
                    peer: peer.to_string(),
                    region,
                })?;
            }
        }
        Ok(parts)
    }

    /// Our keys on `peer`'s connection `conn` of `rail`, asked for on the side channel (on a
    /// control thread: the exchange is blocking TCP), by `deadline`.
    async fn fetch_grants(
        self: &Arc<Self>,
        p: &Peer,
        peer: &str,
        rail: usize,
        conn: ConnId,
        deadline: Instant,
    ) -> Result<GrantKeys, AgentError> {
        let addr = p.side_channel(peer)?;
        let qpn = p
            .conns
            .qpns(rail, conn)
            .ok_or_else(|| AgentError::StaleMetadata(peer.to_string()))?
            .peer;
        let me = Arc::clone(self);
        let who = peer.to_string();
        let (tx, rx) = futures_channel::oneshot::channel();
        std::thread::Builder::new()
            .name("rixl-grants".into())
            .spawn(move || {
                let _ = tx.send(sidechannel::request_grants(
                    &me, &who, &addr, rail, qpn, deadline,
                ));
            })
            .map_err(AgentError::ControlThread)?;
        rx.await.unwrap_or(Err(AgentError::Stopped))
    }
}

/// Puts `remote` (named with the peer's metadata keys) on `keys`: each key replaced by the key
/// of its region there, in place. `Ok(Err(region))`, with `remote` untouched, for the first
/// region `keys` lacks.
fn rekey(
    p: &Peer,
    peer: &str,
    remote: &mut RemoteDescList,
    keys: &GrantKeys,
) -> Result<Result<(), u64>, AgentError> {
    // Consecutive descriptors mostly share a region: one lookup per run.
    let mut last: Option<(u32, u32)> = None;
    let mut key_of = |from: u32| -> Result<Result<u32, u64>, AgentError> {
        if let Some((f, to)) = last {
            if f == from {
                return Ok(Ok(to));
            }
        }
        let info = p
            .by_rkey
            .get(&from)
            .ok_or_else(|| AgentError::StaleMetadata(peer.to_string()))?;
        Ok(match keys.by_region.get(&info.id) {
            Some(&to) => {
                last = Some((from, to));
                Ok(to)
            }
            None => Err(info.id),
        })
    };
    // Checked whole first, so that a list with a region lacking stays as it was.
    for d in &remote.0 {
        if let Err(region) = key_of(d.rkey)? {
            return Ok(Err(region));
        }
    }
    for d in &mut remote.0 {
        if let Ok(to) = key_of(d.rkey)? {
            d.rkey = to;
        }
    }
    Ok(Ok(()))
}

impl Agent {
    /// Grants `peer` `access` to `reg` (adds it to the registration's visibility, or changes
    /// its rights): the peer sees the region in our metadata, and its window is bound when it
    /// asks for its keys. A change of rights deallocates the peer's windows with the old ones
    /// before this returns.
    ///
    /// # Errors
    /// [`AgentError::UnnamedRegion`] for a region every peer sees ([`super::Visibility::All`],
    /// [`super::Visibility::ReadOnly`]): rights per agent need one registered with
    /// [`super::Visibility::Only`] or [`super::Visibility::Granted`]; [`AgentError::UnknownLocalRegion`] for
    /// one released.
    pub fn grant(&self, reg: &Registration, peer: &str, access: Access) -> Result<(), AgentError> {
        let before = self.set_access(reg, peer, Some(access))?;
        if before.is_some_and(|b| b != access) {
            // Windows with the old rights must not outlive the change.
            self.inner.grants.revoke_region(reg.id(), Some(peer));
        }
        Ok(())
    }

    /// Revokes `peer`'s grant of `reg`: it leaves the metadata we give `peer`, and the windows
    /// bound for it are deallocated before this returns: the next access with their keys
    /// completes with a remote access error (and fails the connection it came on). Returns how
    /// many windows were deallocated.
    ///
    /// # Errors
    /// As [`Self::grant`].
    pub fn revoke(&self, reg: &Registration, peer: &str) -> Result<usize, AgentError> {
        self.set_access(reg, peer, None)?;
        Ok(self.inner.grants.revoke_region(reg.id(), Some(peer)))
    }

    /// Sets `peer`'s rights to `reg`; returns its rights before.
    fn set_access(
        &self,
        reg: &Registration,
        peer: &str,
        access: Option<Access>,
    ) -> Result<Option<Access>, AgentError> {
        let id = reg.id();
        let outcome = self.inner.regs.update(|regs| {
            let r = regs.get(&id).ok_or(AgentError::UnknownLocalRegion(id))?;
            let before = r.visibility.access_for(peer);
            let visibility = r
                .visibility
                .with_access(peer, access)
                .ok_or(AgentError::UnnamedRegion(id))?;
            let mut n = super::registry::Reg::clone(r);
            n.visibility = visibility;
            regs.insert(id, Arc::new(n));
            Ok(before)
        });
        if outcome.is_ok() {
            self.inner.metadata_changed();
        }
        outcome
    }

    /// How this agent's NIC grants have been made and ended.
    pub fn grant_counters(&self) -> GrantCounters {
        self.inner.grants.counters()
    }
}

/// Test hooks (feature `failpoints`): a member that oversteps its grants.
#[cfg(feature = "failpoints")]
impl Agent {
    /// Posts a WRITE of `local` to `addr` under `rkey` on our rail-0 connection to `peer`,
    /// past every check of this agent: what a rogue member could post with raw verbs. For tests
    /// that the NIC enforces grants. A failed connection is retired, as after any transfer.
    ///
    /// # Errors
    /// As [`Self::write`]; the NIC's refusal is a [`crate::runtime::TransferError::RemoteAccess`].
    pub async fn write_unchecked(
        &self,
        peer: &str,
        local: &crate::runtime::LocalDescList,
        addr: u64,
        rkey: u32,
    ) -> Result<crate::runtime::TransferStats, AgentError> {
        let deadline = Instant::now() + self.inner.connect_timeout;
        let conn = super::link::ensure(&self.inner, peer, 0, Some(deadline)).await?;
        let remote = RemoteDescList(vec![crate::runtime::RemoteDesc {
            addr,
            len: local.total_len(),
            rkey,
        }]);
        let r = self
            .inner
            .rails
            .engine(0)
            .transfer(
                conn,
                crate::runtime::Op::Write,
                local.clone(),
                remote,
                crate::runtime::TransferOptions::default(),
            )
            .await;
        if r.is_err() {
            self.inner.retire_failed(peer, &[(0, conn)]).await;
        }
        Ok(r?)
    }

    /// Our grant keys (region id to rkey) on the rail-0 connection to `peer` transfers use.
    pub fn grant_keys_of(&self, peer: &str) -> Option<HashMap<u64, u32>> {
        let p = self.inner.peer(peer).ok()?;
        let conn = p.conn(0)?;
        p.conns.keys(0, conn).map(|k| k.by_region.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grant_keys_round_trip_and_malformed_lists_are_refused() {
        let k = GrantKeys {
            by_region: [(1, 0x100), (7, 0x2ff)].into_iter().collect(),
        };
        let b = k.encode();
        assert_eq!(GrantKeys::decode(&b).expect("decodes"), k);
        assert!(GrantKeys::decode(&b[..b.len() - 1]).is_err(), "short");
        assert!(GrantKeys::decode(&[0, 0]).is_err(), "no count");
        let mut huge = b.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(
            GrantKeys::decode(&huge).is_err(),
            "a count beyond the bytes"
        );
        let mut dup = b.clone();
        dup[16..24].copy_from_slice(&1u64.to_be_bytes());
        assert!(GrantKeys::decode(&dup).is_err(), "a region twice");
    }
}
