//! Transfers with peers: one-shot READ/WRITE addressed by the peer's region ids, requests
//! prepared once and posted many times, and index selections of prepared lists. The agent picks
//! the transport per descriptor pair (CUDA IPC for same-node GPU memory where the topology says
//! so, RDMA otherwise) and holds none of their logic.

use std::sync::Arc;
use std::time::Instant;

use crate::nvlink::plan::IpcPlan;
use crate::runtime::{
    ConnId, FileDesc, LocalDescList, Op, PreparedPart, RailPart, RailSlice, Rails, Region,
    RemoteDesc, RemoteDescList, TransferStats,
};
use crate::transport::{
    FileRequest, FileTransport, IpcRequest, IpcTransport, RdmaRequest, RdmaTransport, Transport,
};

use super::config::RemoteRef;
use super::files::FileRegistration;
use super::handle::{CallOptions, Transfer};
use super::peers::{Peer, RegionKey};
use super::registry::{RailMap, Registration};
use super::{link, Agent, AgentError};

/// Local descriptors prepared once; requests select entries by index (NIXL's prep + make).
#[derive(Debug, Clone, Default)]
pub struct PreparedLocal {
    list: LocalDescList,
}

impl PreparedLocal {
    /// Appends `len` bytes at `offset` of `reg`.
    pub fn push(&mut self, reg: &Registration, offset: u64, len: u64) {
        self.list.push(reg.region(), offset, len);
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    fn select(&self, idx: &[usize]) -> Result<LocalDescList, AgentError> {
        let (descs, regions) = (self.list.descs(), self.list.regions());
        let mut out = LocalDescList::with_capacity(idx.len());
        for &i in idx {
            let d = descs.get(i).ok_or(AgentError::BadIndex {
                index: i,
                len: descs.len(),
            })?;
            out.push(&regions[d.region as usize], d.offset, d.len);
        }
        Ok(out)
    }
}

/// A peer's descriptors, resolved and range-checked once against its metadata.
#[derive(Debug, Clone)]
pub struct PreparedRemote {
    peer: String,
    generation: u64,
    descs: Vec<RemoteDesc>,
}

impl PreparedRemote {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.descs.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.descs.is_empty()
    }

    fn select(&self, idx: &[usize]) -> Result<RemoteDescList, AgentError> {
        idx.iter()
            .map(|&i| {
                self.descs.get(i).copied().ok_or(AgentError::BadIndex {
                    index: i,
                    len: self.descs.len(),
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(RemoteDescList)
    }
}

/// A transfer with a peer checked and planned once by [`Agent::prepare_request`], posted any
/// number of times by [`Agent::post_request`] (NIXL's prepared transfer request). Cloning it
/// is cheap (the prepared work is shared).
#[derive(Debug, Clone)]
pub struct TransferRequest {
    peer: String,
    op: Op,
    /// The peer's metadata generation it was made from.
    generation: u64,
    /// Every peer region it uses, with its key, checked at each post.
    keys: Vec<RegionKey>,
    bytes: u64,
    descriptors: usize,
    path: RequestPath,
}

impl TransferRequest {
    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// READ or WRITE.
    pub fn op(&self) -> Op {
        self.op
    }

    /// Bytes moved by one post.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Rails one post uses (0 on the same-node GPU path).
    pub fn rails(&self) -> usize {
        match &self.path {
            RequestPath::Rdma(parts) => parts.len(),
            RequestPath::Planned { .. } => 0,
        }
    }
}

#[derive(Debug, Clone)]
enum RequestPath {
    /// RDMA: one prepared transfer per rail it uses (rail 0 alone unless striped).
    Rdma(Vec<PreparedPart>),
    /// The same-node GPU path (CUDA IPC copies), planned at each post.
    Planned {
        local: LocalDescList,
        remote: RemoteDescList,
    },
}

/// The transport a descriptor pair takes.
enum Route {
    Rdma,
    CudaIpc(IpcPlan),
}

impl Agent {
    /// RDMA WRITE of `local` to the peer's regions. Between GPU memory of two processes on one
    /// node, where the topology says so, the pieces are device copies over CUDA IPC instead.
    /// Pieces may land in any order: destinations that overlap end up with either piece's bytes
    /// (or a mix).
    ///
    /// ```no_run
    /// # async fn f(prefill: &rixl::agent::Agent, kv: &rixl::agent::Registration, decode_kv: u64)
    /// #     -> Result<(), rixl::agent::AgentError> {
    /// use rixl::agent::RemoteRef;
    /// use rixl::runtime::LocalDescList;
    /// const BLOCK: u64 = 16 << 10;
    /// // Blocks 3 and 7 of our cache into blocks 0 and 1 of decode's region `decode_kv`.
    /// let mut local = LocalDescList::new();
    /// let mut remote = Vec::new();
    /// for (i, src) in [3u64, 7].into_iter().enumerate() {
    ///     local.push(kv.region(), src * BLOCK, BLOCK);
    ///     remote.push(RemoteRef { region: decode_kv, offset: i as u64 * BLOCK, len: BLOCK });
    /// }
    /// let stats = prefill.write("decode", &local, &remote).await?;
    /// assert_eq!(stats.bytes, 2 * BLOCK);
    /// # Ok(()) }
    /// ```
    ///
    /// The [`Transfer`] may also be polled from a step loop ([`Transfer::status`]), cancelled,
    /// or dropped (which cancels it).
    ///
    /// # Errors
    /// [`AgentError::UnknownPeer`], [`AgentError::UnknownRegion`],
    /// [`AgentError::RemoteOutOfRange`] (before anything is posted), or a transfer error.
    pub fn write(&self, peer: &str, local: &LocalDescList, remote: &[RemoteRef]) -> Transfer {
        self.transfer_with(peer, Op::Write, local, remote, CallOptions::default())
    }

    /// RDMA READ of the peer's regions into `local`.
    ///
    /// ```no_run
    /// # async fn f(actor: &rixl::agent::Agent, weights: &rixl::agent::Registration, learner_w: u64)
    /// #     -> Result<(), rixl::agent::AgentError> {
    /// use rixl::agent::RemoteRef;
    /// use rixl::runtime::LocalDescList;
    /// // Pull the learner's whole weight region into ours.
    /// let len = weights.region().len();
    /// let mut local = LocalDescList::new();
    /// local.push(weights.region(), 0, len);
    /// let remote = [RemoteRef { region: learner_w, offset: 0, len }];
    /// actor.read("learner", &local, &remote).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn read(&self, peer: &str, local: &LocalDescList, remote: &[RemoteRef]) -> Transfer {
        self.transfer_with(peer, Op::Read, local, remote, CallOptions::default())
    }

    /// A READ or WRITE; with `notification`, the peer receives it (from its notification
    /// stream) after every descriptor of the transfer has completed.
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn transfer(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &[RemoteRef],
        notification: Option<&[u8]>,
    ) -> Transfer {
        let opts = CallOptions::notifying(notification);
        self.transfer_with(peer, op, local, remote, opts)
    }

    /// A READ or WRITE with per-call options: a deadline, a notification.
    ///
    /// ```no_run
    /// # async fn f(decode: &rixl::agent::Agent, local: &rixl::runtime::LocalDescList,
    /// #     remote: &[rixl::agent::RemoteRef]) -> Result<(), rixl::agent::AgentError> {
    /// use std::time::Duration;
    /// use rixl::agent::{CallOptions, TransferStatus};
    /// use rixl::runtime::Op;
    /// let opts = CallOptions::new().timeout(Duration::from_millis(200)).notification(&b"req-7"[..]);
    /// let mut t = decode.transfer_with("prefill", Op::Read, local, remote, opts);
    /// // A step loop without an async context:
    /// while t.status() == TransferStatus::Pending {
    ///     // ... run a model step ...
    /// }
    /// let stats = t.await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn transfer_with(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &[RemoteRef],
        opts: CallOptions,
    ) -> Transfer {
        let remote = match self.inner.resolve(peer, remote, None) {
            Ok(r) => r.remote,
            Err(e) => return Transfer::failed(e),
        };
        let (agent, peer, local) = (self.clone(), peer.to_string(), local.clone());
        Transfer::new(async move { agent.post(&peer, op, local, remote, opts).await })
    }

    /// The transport of `local` with `remote` in `peer`'s memory: CUDA IPC when every local
    /// region is GPU memory and the IPC path accepts the pair, RDMA otherwise.
    fn route(&self, peer: &Peer, local: &LocalDescList, remote: &RemoteDescList) -> Route {
        if local.is_empty() || !local.regions().iter().all(Region::is_gpu) {
            return Route::Rdma;
        }
        let Some(gpu) = local.regions()[0].gpu_memory() else {
            return Route::Rdma;
        };
        match self
            .inner
            .ipc
            .plan(gpu.gpu().ordinal() as u32, &peer.gpus, &remote.0)
        {
            Some(plan) => Route::CudaIpc(plan),
            None => Route::Rdma,
        }
    }

    /// Picks the transport, connects lazily, runs the transfer, then sends the notification
    /// (after every descriptor completed): the shared tail of [`Self::transfer`] and
    /// [`Self::transfer_indices`].
    async fn post(
        &self,
        peer: &str,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: CallOptions,
    ) -> Result<TransferStats, AgentError> {
        let t0 = std::time::Instant::now();
        let deadline = self.inner.deadline(&opts, t0);
        let p = self.inner.peer(peer)?;
        let (bytes, descriptors) = (local.total_len(), local.len());
        let probe = self.staging_probe(&local);
        let r = self
            .post_on(&p, peer, op, local, remote, &opts, deadline)
            .await;
        if let Some((id, way)) = probe {
            let done = r.as_ref().ok().map(|_| (bytes, t0.elapsed()));
            self.staging_probed(id, way, done);
        }
        if r.is_ok() {
            self.inner
                .record_rate(&p, op, bytes, descriptors, t0.elapsed());
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn post_on(
        &self,
        p: &Peer,
        peer: &str,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: &CallOptions,
        deadline: Instant,
    ) -> Result<TransferStats, AgentError> {
        let notification = opts.notification.as_deref();
        if let Route::CudaIpc(plan) = self.route(p, &local, &remote) {
            let transport = IpcTransport {
                paths: &self.inner.ipc,
                engine: self.inner.rails.engine(0),
            };
            let request = IpcRequest {
                peer,
                plan,
                local: &local,
                remote: &remote,
            };
            let st = transport.transfer(op, request).await?;
            if let Some(msg) = notification {
                self.notify_by(peer, msg, deadline).await?;
            }
            return Ok(st);
        }
        if let Some(region) = super::nics::ipc_only_target(p, &remote) {
            return Err(AgentError::NotRdmaReachable {
                peer: peer.to_string(),
                region,
            });
        }
        if let Some(copier) = self.staged_copier(&local) {
            return Box::pin(self.post_staged(p, peer, op, local, remote, opts, deadline, copier))
                .await;
        }
        let conn = link::ensure(&self.inner, peer, 0, Some(deadline)).await?;
        // The set-up may have loaded the peer's new metadata (it restarted): the descriptors
        // move to its new keys.
        let now = self.inner.peer(peer)?;
        let (p, remote) = if now.generation() == p.generation() {
            (p, remote)
        } else {
            let moved = now.translate(p, &remote, peer)?;
            (&*now, moved)
        };
        let descriptors = local.len();
        let lanes = self.inner.lanes_for(p, &local, &remote);
        let striped = lanes.len() > 1;
        let parts = if lanes != [0] {
            self.rail_parts(peer, p, &local, &remote, &lanes, deadline)
                .await?
        } else {
            vec![RailPart {
                slice: RailSlice {
                    rail: 0,
                    local,
                    remote,
                },
                conn,
            }]
        };
        if striped {
            tracing::debug!(agent = %self.inner.name, %peer, rails = ?lanes, "striped transfer");
        }
        let parts = self.inner.on_grants(peer, &now, parts, deadline).await?;
        let transport = RdmaTransport {
            rails: &self.inner.rails,
        };
        let used: Vec<(usize, ConnId)> = parts.iter().map(|p| (p.slice.rail, p.conn)).collect();
        let request = RdmaRequest {
            parts,
            opts: opts.engine(deadline),
            descriptors,
        };
        let mut st = match transport.transfer(op, request).await {
            Ok(st) => st,
            Err(e) => {
                self.inner.retire_failed(peer, &used).await;
                return Err(e);
            }
        };
        st.descriptors = descriptors;
        if let Some(msg) = notification {
            self.notify_checked(peer, conn, msg).await?;
        }
        Ok(st)
    }

    /// A transfer's parts on `lanes` (rail indexes), each on its rail's keys and connection
    /// (connecting rails on first use).
    async fn rail_parts(
        &self,
        peer: &str,
        p: &Peer,
        local: &LocalDescList,
        remote: &RemoteDescList,
        lanes: &[usize],
        deadline: Instant,
    ) -> Result<Vec<RailPart>, AgentError> {
        let slices = {
            let regs = self.inner.regs.load();
            let map = RailMap {
                regs: &regs,
                peer_by_rkey: &p.by_rkey,
                grants: p.metadata.as_ref().is_some_and(|m| m.grants),
            };
            Rails::split(local, remote, lanes, &map)?
        };
        let mut parts = Vec::with_capacity(slices.len());
        for slice in slices {
            let conn = link::ensure(&self.inner, peer, slice.rail, Some(deadline)).await?;
            parts.push(RailPart { slice, conn });
        }
        Ok(parts)
    }

    /// Copies `local` (DRAM) into the file at `file_descs` (paired in order, same total length).
    /// Adjacent file descriptors are merged into larger I/Os; writes must be aligned to
    /// [`FileRegistration::alignment`] after merging.
    ///
    /// # Errors
    /// [`AgentError::Transfer`] with an invalid descriptor or a [`crate::runtime::FileError`]
    /// (unaligned, out of range, deleted file, no space, ...), or a timeout.
    pub async fn write_file(
        &self,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_file(Op::Write, local, file, file_descs, None)
            .await
    }

    /// Reads the file at `file_descs` into `local` (any alignment).
    ///
    /// # Errors
    /// As [`Self::write_file`], and [`crate::runtime::FileError::ShortRead`] for a file truncated
    /// after it was registered.
    pub async fn read_file(
        &self,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
    ) -> Result<TransferStats, AgentError> {
        self.transfer_file(Op::Read, local, file, file_descs, None)
            .await
    }

    /// A FILE transfer (`Op::Write`: memory to file) with an optional deadline (default: the
    /// engine's `transfer_timeout`).
    ///
    /// # Errors
    /// As [`Self::write_file`].
    pub async fn transfer_file(
        &self,
        op: Op,
        local: &LocalDescList,
        file: &FileRegistration,
        file_descs: &[FileDesc],
        timeout: Option<std::time::Duration>,
    ) -> Result<TransferStats, AgentError> {
        let request = FileRequest {
            local,
            file,
            descs: file_descs,
            timeout,
            default_timeout: self.inner.transfer_timeout,
        };
        let io = || self.object_runtime();
        FileTransport { io: &io }.transfer(op, request).await
    }

    /// Checks, resolves and plans a READ or WRITE with `peer` once, for [`Self::post_request`]
    /// to post any number of times (NIXL's `createXferReq` + `postXferReq`): weights sent to
    /// the same actor every step, a fixed KV layout, a layer-by-layer stream. Validation,
    /// region lookup, the path choice, multi-rail striping and work-request planning are done
    /// here; a post only checks that the peer's metadata is still the one it was made from and
    /// rings the doorbells. Connections are made here if needed.
    ///
    /// The request keeps its local regions registered while it lives. It is bound to the
    /// peer's metadata and connections as they are now: once the peer re-joins (new metadata),
    /// drops a region it uses, or its connection fails, posting it gives a typed error
    /// ([`AgentError::StaleMetadata`], or a [`crate::runtime::TransferError::Connection`]) and
    /// it must be prepared again.
    ///
    /// # Errors
    /// As [`Self::write`]: [`AgentError::UnknownPeer`], [`AgentError::UnknownRegion`],
    /// [`AgentError::RemoteOutOfRange`], invalid local descriptors, or a connection error.
    pub async fn prepare_request(
        &self,
        peer: &str,
        op: Op,
        local: &LocalDescList,
        remote: &[RemoteRef],
    ) -> Result<TransferRequest, AgentError> {
        let mut keys = Vec::new();
        let resolved = self.inner.resolve(peer, remote, Some(&mut keys))?;
        let p = self.inner.peer(peer)?;
        let unreachable = super::nics::ipc_only_target(&p, &resolved.remote);
        let path = match self.route(&p, local, &resolved.remote) {
            Route::CudaIpc(_) => RequestPath::Planned {
                local: local.clone(),
                remote: resolved.remote,
            },
            Route::Rdma if unreachable.is_some() => {
                return Err(AgentError::NotRdmaReachable {
                    peer: peer.to_string(),
                    region: unreachable.unwrap_or_default(),
                });
            }
            // Staged memory goes through the staging area at every post.
            Route::Rdma if self.staged_copier(local).is_some() => RequestPath::Planned {
                local: local.clone(),
                remote: resolved.remote,
            },
            Route::Rdma => {
                let lanes = self.inner.lanes_for(&p, local, &resolved.remote);
                let deadline = Instant::now() + self.inner.connect_timeout;
                let parts = if lanes != [0] {
                    self.rail_parts(peer, &p, local, &resolved.remote, &lanes, deadline)
                        .await?
                } else {
                    let conn = link::ensure(&self.inner, peer, 0, Some(deadline)).await?;
                    vec![RailPart {
                        slice: RailSlice {
                            rail: 0,
                            local: local.clone(),
                            remote: resolved.remote,
                        },
                        conn,
                    }]
                };
                let now = self.inner.peer(peer)?;
                let parts = self.inner.on_grants(peer, &now, parts, deadline).await?;
                RequestPath::Rdma(self.inner.rails.prepare(op, parts).await?)
            }
        };
        Ok(TransferRequest {
            peer: peer.to_string(),
            op,
            generation: resolved.generation,
            keys,
            bytes: local.total_len(),
            descriptors: local.len(),
            path,
        })
    }

    /// Posts a prepared request once more and waits for it; with `notification`, the peer
    /// receives it after every descriptor has completed (as [`Self::transfer`]).
    ///
    /// # Errors
    /// [`AgentError::StaleMetadata`] if the peer's metadata changed since the request was
    /// prepared (it re-joined, or no longer has a region the request uses: nothing is posted),
    /// [`AgentError::UnknownPeer`] if the peer was invalidated; otherwise as [`Self::transfer`].
    pub fn post_request(&self, req: &TransferRequest, notification: Option<&[u8]>) -> Transfer {
        let opts = CallOptions::notifying(notification);
        self.post_request_with(req, opts)
    }

    /// [`Self::post_request`] with per-call options (a deadline, a notification).
    ///
    /// # Errors
    /// As [`Self::post_request`].
    pub fn post_request_with(&self, req: &TransferRequest, opts: CallOptions) -> Transfer {
        if let Err(e) = self.inner.check_keys(&req.peer, req.generation, &req.keys) {
            return Transfer::failed(e);
        }
        let (agent, req) = (self.clone(), req.clone());
        Transfer::new(async move { agent.repost(req, opts).await })
    }

    async fn repost(
        &self,
        req: TransferRequest,
        opts: CallOptions,
    ) -> Result<TransferStats, AgentError> {
        let parts = match req.path {
            RequestPath::Planned { local, remote } => {
                return self.post(&req.peer, req.op, local, remote, opts).await;
            }
            RequestPath::Rdma(parts) => parts,
        };
        let t0 = Instant::now();
        let deadline = self.inner.deadline(&opts, t0);
        let mut st = match self.inner.rails.post(&parts, opts.engine(deadline)).await {
            Ok(st) => st,
            Err(f) => {
                let used: Vec<(usize, ConnId)> =
                    parts.iter().map(|p| (p.rail, p.prepared.conn())).collect();
                self.inner.retire_failed(&req.peer, &used).await;
                return Err(AgentError::from_failure(f, parts.len(), req.descriptors));
            }
        };
        st.descriptors = req.descriptors;
        if let Ok(p) = self.inner.peer(&req.peer) {
            self.inner
                .record_rate(&p, req.op, req.bytes, req.descriptors, t0.elapsed());
        }
        if let Some(msg) = opts.notification.as_deref() {
            let conn = link::ensure(&self.inner, &req.peer, 0, Some(deadline)).await?;
            self.notify_checked(&req.peer, conn, msg).await?;
        }
        Ok(st)
    }

    /// Resolves and checks `remote` against `peer`'s metadata once, for index-based requests.
    ///
    /// # Errors
    /// As the checks of [`Self::write`].
    pub fn prepare_remote(
        &self,
        peer: &str,
        remote: &[RemoteRef],
    ) -> Result<PreparedRemote, AgentError> {
        let resolved = self.inner.resolve(peer, remote, None)?;
        Ok(PreparedRemote {
            peer: peer.to_string(),
            generation: resolved.generation,
            descs: resolved.remote.0,
        })
    }

    /// A transfer made from index selections of prepared lists (the two selections pair up in
    /// order and must describe the same total length).
    ///
    /// # Errors
    /// [`AgentError::BadIndex`], [`AgentError::StaleMetadata`], or as [`Self::transfer`].
    pub fn transfer_indices(
        &self,
        op: Op,
        local: &PreparedLocal,
        local_idx: &[usize],
        remote: &PreparedRemote,
        remote_idx: &[usize],
        notification: Option<&[u8]>,
    ) -> Transfer {
        let opts = CallOptions::notifying(notification);
        self.transfer_indices_with(op, local, local_idx, remote, remote_idx, opts)
    }

    /// [`Self::transfer_indices`] with per-call options (a deadline, a notification).
    ///
    /// # Errors
    /// As [`Self::transfer_indices`].
    pub fn transfer_indices_with(
        &self,
        op: Op,
        local: &PreparedLocal,
        local_idx: &[usize],
        remote: &PreparedRemote,
        remote_idx: &[usize],
        opts: CallOptions,
    ) -> Transfer {
        let selected = || -> Result<(LocalDescList, RemoteDescList), AgentError> {
            if self.inner.peer_generation(&remote.peer)? != remote.generation {
                return Err(AgentError::StaleMetadata(remote.peer.clone()));
            }
            Ok((local.select(local_idx)?, remote.select(remote_idx)?))
        };
        let (l, r) = match selected() {
            Ok(x) => x,
            Err(e) => return Transfer::failed(e),
        };
        let (agent, peer) = (self.clone(), remote.peer.clone());
        Transfer::new(async move { agent.post(&peer, op, l, r, opts).await })
    }
}

/// A request is made on one thread and posted from any (an agent is shared by a serving
/// engine's threads): checked when this compiles.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<TransferRequest>();
    send_sync::<Arc<TransferRequest>>();
};
