//! What the agent knows of its peers: their metadata (loaded from a blob, the side channel or
//! etcd), their regions, and the connections made to them. Read on every transfer from an
//! immutable snapshot (no lock); loading, connecting and invalidating publish a new one.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::nvlink::ipc::IpcHandle;
use crate::nvlink::plan::{Export, PeerGpus};
use crate::runtime::{ConnId, RemoteDesc, RemoteDescList};

use super::config::RemoteRef;
use super::conns::{Conns, Direction, NewConn};
use super::estimate::RateModel;
use super::grants::GrantKeys;
use super::metadata::{AgentMetadata, RegionInfo};
use super::{link, sidechannel, Agent, AgentError, Inner};

/// One peer as the agent knows it (a snapshot entry: replaced, never changed in place).
#[derive(Debug, Clone, Default)]
pub(crate) struct Peer {
    pub metadata: Option<Arc<AgentMetadata>>,
    /// Its regions by id.
    pub regions: HashMap<u64, RegionInfo>,
    /// Its regions by their rail-0 key (multi-rail striping renames keys per rail).
    pub by_rkey: HashMap<u32, RegionInfo>,
    /// Whether some of its regions are reachable by CUDA IPC only (bound to no rail).
    pub ipc_only: bool,
    /// Its GPUs and VRAM exports (the same-node CUDA IPC path).
    pub gpus: PeerGpus,
    /// Connections by rail (rail 0 also carries notifications).
    pub conns: Conns,
    /// Transfer-time models (READ, WRITE) fed by completed transfers; kept across metadata
    /// updates.
    pub rates: Arc<std::sync::Mutex<[RateModel; 2]>>,
}

/// Peers by name.
pub(crate) type PeerMap = HashMap<String, Arc<Peer>>;

/// A region reference that names one of the peer's regions, with its remote key: what a
/// prepared request checks again at every post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RegionKey {
    pub region: u64,
    pub rkey: u32,
}

/// Remote references resolved against a peer's metadata.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub remote: RemoteDescList,
    /// The peer's metadata generation they were resolved against.
    pub generation: u64,
}

impl Peer {
    fn with_metadata(&self, md: AgentMetadata) -> Peer {
        let regions: HashMap<u64, RegionInfo> = md.regions.iter().map(|r| (r.id, *r)).collect();
        let exports = md
            .ipc
            .iter()
            .filter_map(|x| {
                let r = regions.get(&x.region)?;
                Some(Export {
                    region: x.region,
                    addr: r.addr,
                    len: r.len,
                    gpu: x.gpu,
                    handle: IpcHandle(x.handle),
                })
            })
            .collect();
        Peer {
            by_rkey: regions.values().map(|r| (r.rkey, *r)).collect(),
            ipc_only: regions.values().any(|r| r.bound == 0),
            gpus: PeerGpus {
                node: md.node.clone(),
                process: md.process,
                exports,
            },
            regions,
            metadata: Some(Arc::new(md)),
            conns: self.conns.clone(),
            rates: Arc::clone(&self.rates),
        }
    }

    /// Where its side channel listens (`name` is the peer's, for the error).
    ///
    /// # Errors
    /// [`AgentError::NoSideChannel`] without metadata or without an address in it.
    pub fn side_channel(&self, name: &str) -> Result<String, AgentError> {
        self.metadata
            .as_ref()
            .map(|m| m.address.clone())
            .filter(|a| !a.is_empty())
            .ok_or_else(|| AgentError::NoSideChannel(name.to_string()))
    }

    /// Its metadata's generation, if loaded.
    pub fn generation(&self) -> Option<u64> {
        self.metadata.as_ref().map(|m| m.generation)
    }

    /// The connection transfers on `rail` use, if made.
    pub fn conn(&self, rail: usize) -> Option<ConnId> {
        self.conns.get(rail)
    }

    /// Moves descriptors resolved against `old` (an earlier incarnation's metadata) to this
    /// metadata: the same region ids and offsets, this metadata's addresses and keys.
    ///
    /// # Errors
    /// [`AgentError::StaleMetadata`] for a key `old` does not know, then as [`Self::resolve`].
    pub fn translate(
        &self,
        old: &Peer,
        remote: &RemoteDescList,
        name: &str,
    ) -> Result<RemoteDescList, AgentError> {
        let refs = remote
            .0
            .iter()
            .map(|d| {
                let stale = || AgentError::StaleMetadata(name.to_string());
                let info = old.by_rkey.get(&d.rkey).ok_or_else(stale)?;
                Ok(RemoteRef {
                    region: info.id,
                    offset: d.addr.checked_sub(info.addr).ok_or_else(stale)?,
                    len: d.len,
                })
            })
            .collect::<Result<Vec<_>, AgentError>>()?;
        self.resolve(name, &refs, None)
    }

    /// Maps region references to remote descriptors, checking ranges; with `keys`, collects the
    /// region and key of every region they use.
    fn resolve(
        &self,
        name: &str,
        remote: &[RemoteRef],
        mut keys: Option<&mut Vec<RegionKey>>,
    ) -> Result<RemoteDescList, AgentError> {
        let mut out = Vec::with_capacity(remote.len());
        for (index, r) in remote.iter().enumerate() {
            let info = self
                .regions
                .get(&r.region)
                .ok_or_else(|| AgentError::unknown_region(name, r.region))?;
            match r.offset.checked_add(r.len) {
                Some(end) if end <= info.len => {}
                _ => {
                    return Err(AgentError::RemoteOutOfRange {
                        index,
                        region: r.region,
                        offset: r.offset,
                        len: r.len,
                        region_len: info.len,
                    })
                }
            }
            if let Some(keys) = keys.as_deref_mut() {
                if !keys.iter().any(|k| k.region == r.region) {
                    keys.push(RegionKey {
                        region: r.region,
                        rkey: info.rkey,
                    });
                }
            }
            out.push(RemoteDesc {
                addr: info.addr + r.offset,
                len: r.len,
                rkey: info.rkey,
            });
        }
        Ok(RemoteDescList(out))
    }
}

/// Partial metadata `update` merged into `known` (the same agent generation): its regions added
/// or replaced, its removed regions forgotten, the rest kept.
fn merge(known: &AgentMetadata, mut update: AgentMetadata) -> AgentMetadata {
    let replaced =
        |id: u64| update.removed.contains(&id) || update.regions.iter().any(|r| r.id == id);
    let mut regions: Vec<RegionInfo> = known
        .regions
        .iter()
        .filter(|r| !replaced(r.id))
        .copied()
        .collect();
    let mut ipc: Vec<_> = known
        .ipc
        .iter()
        .filter(|x| !replaced(x.region))
        .copied()
        .collect();
    regions.append(&mut update.regions);
    ipc.append(&mut update.ipc);
    AgentMetadata {
        regions,
        ipc,
        partial: false,
        removed: Vec::new(),
        ..update
    }
}

impl Agent {
    /// Loads a peer's metadata blob; returns the peer's name. A blob with a new generation (the
    /// peer restarted) replaces the old one and drops the old connection. A partial blob
    /// ([`Self::local_partial_metadata`]) of the generation already loaded is merged into it.
    ///
    /// ```no_run
    /// # fn f(prefill: &rixl::agent::Agent, decode: &rixl::agent::Agent)
    /// #     -> Result<(), rixl::agent::AgentError> {
    /// // Metadata moved by any means (here: in-process); scoped for the reader.
    /// let blob = decode.local_metadata("prefill")?;
    /// assert_eq!(prefill.load_remote_metadata(&blob)?, "decode");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::Metadata`] for a truncated, forged or incompatible blob.
    pub fn load_remote_metadata(&self, blob: &[u8]) -> Result<String, AgentError> {
        self.inner.load_metadata(blob)
    }

    /// Forgets a peer and closes its connection.
    pub async fn invalidate_remote(&self, peer: &str) {
        let conns = self
            .inner
            .peers
            .update(|peers| peers.remove(peer))
            .map(|p| Peer::clone(&p).conns.take())
            .unwrap_or_default();
        self.inner.ipc.forget_peer(peer);
        self.inner.links.forget(peer);
        // Its windows go first: its grants end now, whatever its connections still do.
        self.inner.grants.revoke_peer(peer);
        for (rail, c) in conns {
            self.inner.close_conn(rail, c).await;
        }
    }

    /// Serves this agent's metadata and connection set-up on `addr` (a TCP side channel);
    /// returns the bound address.
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] if it cannot listen.
    pub fn listen(&self, addr: &str) -> Result<SocketAddr, AgentError> {
        sidechannel::listen(&self.inner, addr)
    }

    /// Fetches a peer's metadata from its side channel and loads it; returns the peer's name.
    ///
    /// ```no_run
    /// # fn f(prefill: &rixl::agent::Agent) -> Result<(), rixl::agent::AgentError> {
    /// let peer = prefill.fetch_remote_metadata("decode-host:7000")?;
    /// println!("{peer} exports its regions to us");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`AgentError::SideChannel`] or [`AgentError::Metadata`].
    pub fn fetch_remote_metadata(&self, addr: &str) -> Result<String, AgentError> {
        let deadline = std::time::Instant::now() + self.inner.connect_timeout;
        let blob = sidechannel::fetch_metadata(&self.inner, addr, None, deadline)?;
        self.load_remote_metadata(&blob)
    }

    /// Joins a membership service: publishes this agent's metadata (regions visible to all)
    /// under `<namespace>/<name>` in etcd on a lease of `ttl` kept alive, PUT again whenever it
    /// changes, and watches the namespace: peers that appear (or re-join with new metadata) are
    /// loaded, peers whose key disappears and whose side channel no longer answers are
    /// invalidated. `endpoints` is one or more `host:port`, comma-separated (the members of an
    /// etcd cluster). Call [`Self::listen`] first so the published metadata carries the
    /// side-channel address. An etcd outage does not touch the data path: see the outage policy
    /// in `docs/reliability.md`. [`Self::shutdown`] revokes the lease.
    ///
    /// # Errors
    /// [`AgentError::Etcd`] with the last error if no member accepts the first join within
    /// 15 s (members are tried in turn), [`AgentError::EtcdTimeout`] if the control thread does
    /// not answer, [`AgentError::InvalidEtcdEndpoints`].
    pub fn join_etcd(
        &self,
        endpoints: &str,
        namespace: &str,
        ttl: std::time::Duration,
    ) -> Result<(), AgentError> {
        super::etcd::join(&self.inner, self.clone(), endpoints, namespace, ttl)
    }

    /// Checks that `peer`'s metadata is loaded and grants us every region of `regions` (NIXL's
    /// `checkRemoteMD`): what a caller waits on after sending partial metadata or joining.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`] if nothing of the peer is loaded,
    /// [`AgentError::UnknownRegion`] for the first region it does not grant us.
    pub fn check_remote_metadata(&self, peer: &str, regions: &[u64]) -> Result<(), AgentError> {
        let p = self.inner.peer(peer)?;
        match regions.iter().find(|id| !p.regions.contains_key(id)) {
            Some(&missing) => Err(AgentError::unknown_region(peer, missing)),
            None => Ok(()),
        }
    }

    /// The time a READ or WRITE of `local` with `remote` should take with `peer` now (NIXL's
    /// `estimateXferCost`), from a model of the link that every completed transfer with the
    /// peer keeps current (a fixed cost, a cost per byte and one per descriptor, fitted with
    /// recent transfers weighing most). Nothing is posted.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], the checks of [`Self::write`] on `remote`, or
    /// [`AgentError::NoEstimate`] before enough transfers with the peer have completed.
    pub fn estimate(
        &self,
        op: crate::runtime::Op,
        local: &crate::runtime::LocalDescList,
        remote: &[RemoteRef],
        peer: &str,
    ) -> Result<std::time::Duration, AgentError> {
        self.inner.resolve(peer, remote, None)?;
        let p = self.inner.peer(peer)?;
        let models = super::snapshot::lock(&p.rates);
        let m = &models[op_index(op)];
        m.estimate(local.total_len(), local.len())
            .ok_or_else(|| AgentError::NoEstimate {
                peer: peer.to_string(),
                samples: m.samples(),
            })
    }

    /// Whether a connection to `peer` is made (on rail 0; [`Self::connect`] or a first transfer
    /// makes it).
    pub fn is_connected(&self, peer: &str) -> bool {
        self.inner
            .peers
            .load()
            .get(peer)
            .is_some_and(|p| p.conn(0).is_some())
    }

    /// Connects to `peer` now, on every rail (NIXL's `makeConnection`), so the first transfer
    /// pays no connection set-up. Rails already connected are kept; concurrent callers and
    /// transfers share the connections made.
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], or a side-channel or connection error.
    pub async fn connect(&self, peer: &str) -> Result<(), AgentError> {
        let p = self.inner.peer(peer)?;
        let rails = self.inner.rails.len().min(self.inner.peer_rails(&p)).max(1);
        let deadline = std::time::Instant::now() + self.inner.connect_timeout;
        for rail in 0..rails {
            link::ensure(&self.inner, peer, rail, Some(deadline)).await?;
        }
        Ok(())
    }

    /// Names of the peers whose metadata is loaded.
    pub fn peers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .inner
            .peers
            .load()
            .iter()
            .filter(|(_, p)| p.metadata.is_some())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }
}

/// The model slot of `op`.
pub(crate) fn op_index(op: crate::runtime::Op) -> usize {
    match op {
        crate::runtime::Op::Read => 0,
        crate::runtime::Op::Write => 1,
    }
}

impl Inner {
    /// Feeds a completed transfer with `peer` into its model (skipped if another thread holds
    /// the model right now: the hot path never waits for it).
    pub(crate) fn record_rate(
        &self,
        peer: &Peer,
        op: crate::runtime::Op,
        bytes: u64,
        descriptors: usize,
        took: std::time::Duration,
    ) {
        if let Ok(mut m) = peer.rates.try_lock() {
            m[op_index(op)].record(bytes, descriptors, took);
        }
    }

    /// `peer` with its metadata loaded.
    pub(crate) fn peer(&self, peer: &str) -> Result<Arc<Peer>, AgentError> {
        self.peers
            .load()
            .get(peer)
            .filter(|p| p.metadata.is_some())
            .cloned()
            .ok_or_else(|| AgentError::unknown_peer(peer))
    }

    /// Whether `peer` is known at all (metadata or a connection).
    pub(crate) fn knows(&self, peer: &str) -> bool {
        self.peers.load().contains_key(peer)
    }

    /// Loads a peer's metadata blob (see [`Agent::load_remote_metadata`]).
    ///
    /// # Errors
    /// As [`Agent::load_remote_metadata`].
    pub(crate) fn load_metadata(&self, blob: &[u8]) -> Result<String, AgentError> {
        self.load_metadata_as(blob, None)
    }

    /// Loads a peer's metadata blob that must be `expect`'s (when given): checked before
    /// anything is loaded.
    ///
    /// # Errors
    /// As [`Agent::load_remote_metadata`]; [`AgentError::WrongPeer`] for another agent's blob.
    pub(crate) fn load_metadata_as(
        &self,
        blob: &[u8],
        expect: Option<&str>,
    ) -> Result<String, AgentError> {
        let md = AgentMetadata::decode(blob, &self.identity.key)?;
        let name = md.name.clone();
        if let Some(expected) = expect.filter(|e| *e != name) {
            return Err(AgentError::WrongPeer {
                expected: expected.to_string(),
                found: name,
            });
        }
        let (stale, rejoined) = self.peers.update(|peers| {
            let old = peers.get(&name).cloned().unwrap_or_default();
            let rejoined = old.generation().is_some_and(|g| g != md.generation);
            let md = match (&old.metadata, md.partial) {
                (Some(known), true) if !rejoined => merge(known, md),
                _ => md,
            };
            let mut p = old.with_metadata(md);
            // The old incarnation's connections; one the new incarnation already made to us
            // (its CONNECT may come before its metadata) is kept.
            let stale = if rejoined {
                p.conns.take_except(p.generation())
            } else {
                Vec::new()
            };
            peers.insert(name.clone(), Arc::new(p));
            (stale, rejoined)
        });
        if rejoined {
            self.ipc.forget_peer(&name);
            // A new incarnation gets a fresh set-up: no backoff left from the old one.
            self.links.forget(&name);
        }
        for (rail, c) in stale {
            futures_lite::future::block_on(self.close_conn(rail, c));
        }
        tracing::debug!(agent = %self.name, peer = %name, "loaded remote metadata");
        Ok(name)
    }

    /// Maps a peer's region references to remote descriptors, checking ranges; with `keys`,
    /// collects the region and key of every region they use (for prepared requests).
    pub(crate) fn resolve(
        &self,
        peer: &str,
        remote: &[RemoteRef],
        keys: Option<&mut Vec<RegionKey>>,
    ) -> Result<Resolved, AgentError> {
        let guard = self.peers.load();
        let p = guard
            .get(peer)
            .filter(|p| p.metadata.is_some())
            .ok_or_else(|| AgentError::unknown_peer(peer))?;
        Ok(Resolved {
            remote: p.resolve(peer, remote, keys)?,
            generation: p.generation().unwrap_or(0),
        })
    }

    /// The peer's metadata generation.
    pub(crate) fn peer_generation(&self, peer: &str) -> Result<u64, AgentError> {
        Ok(self.peer(peer)?.generation().unwrap_or(0))
    }

    /// Whether the peer's metadata is still `generation` and still grants every region of
    /// `keys` with the same key.
    pub(crate) fn check_keys(
        &self,
        peer: &str,
        generation: u64,
        keys: &[RegionKey],
    ) -> Result<(), AgentError> {
        let guard = self.peers.load();
        let p = guard
            .get(peer)
            .ok_or_else(|| AgentError::unknown_peer(peer))?;
        let same = p.generation() == Some(generation)
            && keys
                .iter()
                .all(|k| p.regions.get(&k.region).map(|r| r.rkey) == Some(k.rkey));
        if same {
            Ok(())
        } else {
            Err(AgentError::StaleMetadata(peer.to_string()))
        }
    }

    /// Rails `peer` has (1 when unknown).
    pub(crate) fn peer_rails(&self, peer: &Peer) -> usize {
        peer.metadata
            .as_ref()
            .map_or(1, |m| usize::from(m.rails.max(1)))
    }

    /// Records `made` as the `dir` connection to `peer` on `rail`; returns the one it replaces.
    pub(crate) fn set_conn(
        &self,
        peer: &str,
        dir: Direction,
        rail: usize,
        made: NewConn,
    ) -> Option<ConnId> {
        let NewConn {
            conn,
            generation,
            qpns,
            keys,
        } = made;
        let keys = keys.map(Arc::new);
        self.peers.update(|peers| {
            let mut p = peers.get(peer).map(|p| Peer::clone(p)).unwrap_or_default();
            let generation = generation.or(p.generation()).unwrap_or(0);
            let old = p.conns.set(dir, rail, conn, generation, qpns, keys.clone());
            peers.insert(peer.to_string(), Arc::new(p));
            old
        })
    }

    /// Records `peer`'s grant keys on `conn` (`rail`); whether the connection is still there.
    pub(crate) fn set_keys(&self, peer: &str, rail: usize, conn: ConnId, keys: GrantKeys) -> bool {
        let keys = Arc::new(keys);
        self.peers.update(|peers| {
            let Some(p) = peers.get(peer) else {
                return false;
            };
            let mut p = Peer::clone(p);
            let set = p.conns.set_keys(rail, conn, Arc::clone(&keys));
            if set {
                peers.insert(peer.to_string(), Arc::new(p));
            }
            set
        })
    }

    /// Removes `conn` from `peer`'s connections on `rail`; whether it was there.
    pub(crate) fn remove_conn(&self, peer: &str, rail: usize, conn: ConnId) -> bool {
        self.peers.update(|peers| {
            let Some(p) = peers.get(peer) else {
                return false;
            };
            let mut p = Peer::clone(p);
            let removed = p.conns.remove(rail, conn);
            if removed {
                peers.insert(peer.to_string(), Arc::new(p));
            }
            removed
        })
    }

    /// Connections to every peer (both directions, all rails): what the engines should hold.
    pub(crate) fn conn_count(&self) -> usize {
        self.peers.load().values().map(|p| p.conns.len()).sum()
    }
}
