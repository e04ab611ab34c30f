//! Host-staged RDMA: memory the NIC cannot reach directly (GPU memory without GPUDirect RDMA,
//! or a registration [`Agent::set_staged`] marked) moves through a registered host staging area.
//!
//! A transfer's byte stream is cut into chunks of [`STAGE_CHUNK`] bytes. Each chunk takes one
//! of [`STAGE_SLOTS`] slots of the staging area (a DRAM registration of the agent, visible to
//! no peer), and:
//! - WRITE: the copy leg copies the chunk's pieces into the slot, then the slot goes out by RDMA;
//! - READ: the slot is filled by RDMA, then the copy leg copies it into the chunk's pieces.
//!
//! Up to [`STAGE_SLOTS`] chunks are in flight at once, so one chunk's copy overlaps another's
//! RDMA, and memory stays bounded by the area. Copies run on blocking threads of the agent's
//! I/O runtime, never on an engine core or the caller's executor.
//!
//! Staged memory is reachable by this agent's own transfers; peers reach it by CUDA IPC only
//! (it has no NIC registration), so the side that has it initiates (READ rather than be
//! written).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;

use crate::runtime::{split_stream, LocalDescList, Op, RemoteDescList, TransferStats};
use crate::staging::{Copier, RegionCopier, StagingError};

use super::config::Visibility;
use super::handle::CallOptions;
use super::peers::Peer;
use super::snapshot::lock;
use super::{Agent, AgentError, Registration};

/// Bytes per chunk of a staged transfer (one slot of the staging area).
pub const STAGE_CHUNK: u64 = 4 << 20;
/// Slots of the staging area: chunks in flight at once.
pub const STAGE_SLOTS: usize = 4;

/// A staged registration's copy leg.
#[derive(Clone)]
pub(crate) struct StagedCopier(pub Arc<dyn Copier>);

impl std::fmt::Debug for StagedCopier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StagedCopier")
    }
}

/// What staged RDMA has done ([`Agent::staging_counters`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingCounters {
    /// Staged transfers that completed.
    pub transfers: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Chunks moved.
    pub chunks: u64,
    /// Time spent copying, summed over chunks.
    pub copy_time: Duration,
    /// Time spent on the wire (RDMA), summed over chunks.
    pub wire_time: Duration,
    /// Wall time of the staged transfers: less than `copy_time + wire_time` when copies overlap
    /// the wire.
    pub wall_time: Duration,
    /// The most slots in use at once (never more than [`STAGE_SLOTS`]).
    pub slots_high_water: usize,
}

/// What [`Agent::calibrate_staging`] measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct StagingCalibration {
    /// Bytes read each way.
    pub bytes: u64,
    /// The direct READ's time (`None`: the NIC cannot reach the memory directly).
    pub direct: Option<Duration>,
    /// The staged READ's time.
    pub staged: Duration,
    /// Whether the registration is staged from now on.
    pub staged_chosen: bool,
}

/// The automatic choice between direct and staged for one registration (GPU memory across
/// sockets from its NIC, or one armed by [`Agent::measure_staging`]): its next transfer of at
/// least [`STAGE_CHUNK`] bytes runs direct, the one after staged, both timed, then the faster
/// is kept.
#[derive(Clone)]
pub(crate) struct AutoStage {
    copier: Arc<dyn Copier>,
    direct: Option<(u64, Duration)>,
    staged: Option<(u64, Duration)>,
    /// A measured transfer is running.
    probing: bool,
    /// The choice, once made.
    decided: Option<StagingCalibration>,
}

impl AutoStage {
    /// Whether the choice is still to be made.
    pub(crate) fn undecided(&self) -> bool {
        self.decided.is_none()
    }
}

/// Which way a measured transfer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    Direct,
    Staged,
}

/// The registered staging area and its free slots.
pub(crate) struct StageArea {
    reg: Registration,
    free: Mutex<Vec<usize>>,
    permits: tokio::sync::Semaphore,
    /// A slot's RDMA ended without completing (failed or dropped): the NIC may still touch it
    /// until its connection flushes, so it is never handed out again, and the next staged
    /// transfer makes a new area. The old one stays registered while its in-flight work holds
    /// it (the in-flight table keeps the memory).
    retired: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for StageArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageArea").field("reg", &self.reg).finish()
    }
}

/// A slot, given back when dropped, unless a copy or RDMA on it may still be running.
struct Slot<'a> {
    area: &'a StageArea,
    index: usize,
    permit: Option<tokio::sync::SemaphorePermit<'a>>,
    /// A copy job or posted RDMA work on it has not finished (the transfer was dropped or
    /// failed midway): it is never handed out again.
    busy: bool,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        if self.busy {
            self.area
                .retired
                .store(true, std::sync::atomic::Ordering::SeqCst);
            // Transfers waiting for a slot of this area fail typed (the next ones make a new
            // area) rather than wait for slots that never come back.
            self.area.permits.close();
            if let Some(p) = self.permit.take() {
                p.forget();
            }
            tracing::warn!(
                slot = self.index,
                "staged transfer ended while its slot was in use: staging area retired"
            );
        } else {
            lock(&self.area.free).push(self.index);
        }
    }
}

/// Whether a failed transfer may have posted work (its memory may still be touched until the
/// connection flushes); errors raised before posting leave the slot reusable.
fn maybe_posted(e: &AgentError) -> bool {
    !matches!(
        e,
        AgentError::UnknownPeer(_)
            | AgentError::UnknownRegion { .. }
            | AgentError::NotGranted { .. }
            | AgentError::RemoteOutOfRange { .. }
            | AgentError::NoSideChannel(_)
            | AgentError::ConnectTimeout { .. }
            | AgentError::ConnectFailed { .. }
            | AgentError::Unreachable { .. }
            | AgentError::StaleMetadata(_)
            | AgentError::Transfer(crate::runtime::TransferError::InvalidDescriptor(_))
    )
}

impl StageArea {
    /// A free slot, waited for until `deadline`.
    async fn slot(&self, deadline: Instant) -> Result<Slot<'_>, AgentError> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let acquired =
            futures_lite::future::or(async { Some(self.permits.acquire().await) }, async {
                futures_timer::Delay::new(wait).await;
                None
            })
            .await;
        let permit = match acquired {
            Some(p) => p.map_err(|_| AgentError::Staging(StagingError::Closed))?,
            None => {
                return Err(AgentError::Transfer(
                    crate::runtime::TransferError::Timeout(wait),
                ))
            }
        };
        let index = lock(&self.free)
            .pop()
            .ok_or(AgentError::Staging(StagingError::Closed))?;
        Ok(Slot {
            area: self,
            index,
            permit: Some(permit),
            busy: false,
        })
    }

    fn in_use(&self) -> usize {
        STAGE_SLOTS - self.permits.available_permits()
    }
}

/// One chunk's timings.
#[derive(Debug, Default, Clone, Copy)]
struct ChunkTimes {
    copy: Duration,
    wire: Duration,
}

impl Agent {
    /// Marks `reg` staged: its transfers go through the host staging area, copied by `copier`
    /// (`None`: the region's own copy, `cuMemcpy` for GPU memory), or direct again with
    /// `staged = false`. GPU memory the NIC refused (no GPUDirect RDMA) is staged from its
    /// registration on.
    ///
    /// # Errors
    /// [`AgentError::UnknownLocalRegion`] for another agent's registration.
    pub fn set_staged(
        &self,
        reg: &Registration,
        staged: bool,
        copier: Option<Arc<dyn Copier>>,
    ) -> Result<(), AgentError> {
        if !reg.belongs_to(&self.inner) {
            return Err(AgentError::UnknownLocalRegion(reg.id()));
        }
        self.inner.set_staged_id(reg.id(), staged, copier);
        Ok(())
    }

    /// Measures whether `reg`'s transfers are faster direct or staged through host memory (GPU
    /// memory whose NIC is across sockets, where peer-to-peer reads can be slow), and keeps the
    /// faster: one READ of up to 16 MiB of `remote` (the peer's region) into the start of
    /// `reg` each way, after one to set the connection up. It overwrites those bytes of `reg`:
    /// run it before the memory holds data.
    ///
    /// # Errors
    /// [`AgentError::UnknownLocalRegion`] for another agent's registration; the transfers'
    /// errors (a direct READ the NIC refuses counts as slower, not as an error).
    pub async fn calibrate_staging(
        &self,
        reg: &Registration,
        peer: &str,
        remote: super::RemoteRef,
    ) -> Result<StagingCalibration, AgentError> {
        if !reg.belongs_to(&self.inner) {
            return Err(AgentError::UnknownLocalRegion(reg.id()));
        }
        let bytes = remote.len.min(reg.region().len()).min(16 << 20);
        let mut local = LocalDescList::new();
        local.push(reg.region(), 0, bytes);
        let remote = [super::RemoteRef {
            len: bytes,
            ..remote
        }];
        let before = self
            .inner
            .regs
            .load()
            .get(&reg.id())
            .and_then(|r| r.staged.as_ref().map(|c| Arc::clone(&c.0)));
        let reachable = reg.region().registration().is_some();
        let direct = if reachable {
            self.set_staged(reg, false, None)?;
            self.read(peer, &local, &remote).await?;
            let t = Instant::now();
            self.read(peer, &local, &remote)
                .await
                .ok()
                .map(|_| t.elapsed())
        } else {
            None
        };
        self.set_staged(reg, true, before.clone())?;
        let t = Instant::now();
        if let Err(e) = self.read(peer, &local, &remote).await {
            // As it was before, where it can be used at all.
            self.set_staged(reg, before.is_some() || !reachable, before)?;
            return Err(e);
        }
        let staged = t.elapsed();
        let staged_chosen = direct.is_none_or(|d| staged < d);
        if !staged_chosen {
            self.set_staged(reg, false, None)?;
        }
        tracing::info!(agent = %self.inner.name, region = reg.id(), bytes, ?direct, ?staged, staged_chosen, "staging calibrated");
        Ok(StagingCalibration {
            bytes,
            direct,
            staged,
            staged_chosen,
        })
    }

    /// Arms the automatic choice for `reg`: its next transfer of at least [`STAGE_CHUNK`] bytes
    /// runs direct, the one after staged through host memory (copied by `copier`, default the
    /// region's own copy), both timed, and the faster is kept ([`Self::staging_choice`]). GPU
    /// memory whose NIC is across sockets is armed at registration.
    ///
    /// # Errors
    /// [`AgentError::UnknownLocalRegion`] for another agent's registration.
    pub fn measure_staging(
        &self,
        reg: &Registration,
        copier: Option<Arc<dyn Copier>>,
    ) -> Result<(), AgentError> {
        if !reg.belongs_to(&self.inner) {
            return Err(AgentError::UnknownLocalRegion(reg.id()));
        }
        self.inner.arm_auto_stage(reg.id(), copier);
        Ok(())
    }

    /// The choice the automatic measurement made for `reg` (`None`: not measured, or not yet).
    pub fn staging_choice(&self, reg: &Registration) -> Option<StagingCalibration> {
        if !reg.belongs_to(&self.inner) {
            return None;
        }
        lock(&self.inner.auto_stage)
            .get(&reg.id())
            .and_then(|a| a.decided)
    }

    /// The measured transfer `local` is, if its registration's choice is being measured: the
    /// registration and which way it runs (staged is set for it first).
    pub(crate) fn staging_probe(&self, local: &LocalDescList) -> Option<(u64, Probe)> {
        if self
            .inner
            .auto_pending
            .load(std::sync::atomic::Ordering::Acquire)
            == 0
            || local.total_len() < STAGE_CHUNK
        {
            return None;
        }
        let r0 = local.regions().first()?;
        let id = *self
            .inner
            .regs
            .load()
            .iter()
            .find(|(_, g)| g.region.same(r0))?
            .0;
        let (probe, copier) = {
            let mut auto = lock(&self.inner.auto_stage);
            let a = auto.get_mut(&id)?;
            if a.probing || a.decided.is_some() {
                return None;
            }
            a.probing = true;
            match a.direct {
                None => (Probe::Direct, None),
                Some(_) => (Probe::Staged, Some(Arc::clone(&a.copier))),
            }
        };
        self.inner.set_staged_id(id, probe == Probe::Staged, copier);
        Some((id, probe))
    }

    /// Records a measured transfer (`took` for `bytes`, `None` if it failed); once both ways are
    /// timed, keeps the faster.
    pub(crate) fn staging_probed(&self, id: u64, probe: Probe, done: Option<(u64, Duration)>) {
        let decided = {
            let mut auto = lock(&self.inner.auto_stage);
            let Some(a) = auto.get_mut(&id) else { return };
            a.probing = false;
            match probe {
                Probe::Direct => a.direct = done,
                Probe::Staged => a.staged = done,
            }
            match (a.direct, a.staged) {
                (Some(d), Some(s)) => {
                    let rate = |(b, t): (u64, Duration)| b as f64 / t.as_secs_f64().max(1e-9);
                    let staged_chosen = rate(s) > rate(d);
                    let c = StagingCalibration {
                        bytes: s.0,
                        direct: Some(d.1),
                        staged: s.1,
                        staged_chosen,
                    };
                    a.decided = Some(c);
                    self.inner
                        .auto_pending
                        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    Some((c, Arc::clone(&a.copier)))
                }
                _ => None,
            }
        };
        match decided {
            Some((c, copier)) => {
                tracing::info!(agent = %self.inner.name, region = id, direct = ?c.direct, staged = ?c.staged, staged_chosen = c.staged_chosen, "staging chosen by measurement");
                self.inner.set_staged_id(id, c.staged_chosen, Some(copier));
            }
            // Not decided yet (or a measured transfer failed): direct until the next one.
            None => self.inner.set_staged_id(id, false, None),
        }
    }

    /// Whether `reg`'s transfers go through host memory.
    pub fn is_staged(&self, reg: &Registration) -> bool {
        reg.belongs_to(&self.inner)
            && self
                .inner
                .regs
                .load()
                .get(&reg.id())
                .is_some_and(|r| r.staged.is_some())
    }

    /// What staged RDMA has done.
    pub fn staging_counters(&self) -> StagingCounters {
        *lock(&self.inner.staging)
    }

    /// The copy leg of `local` if any of its regions is staged.
    pub(crate) fn staged_copier(&self, local: &LocalDescList) -> Option<Arc<dyn Copier>> {
        // The common case costs one load: no registration is staged.
        if self
            .inner
            .staged_regs
            .load(std::sync::atomic::Ordering::Acquire)
            == 0
        {
            return None;
        }
        let regs = self.inner.regs.load();
        local.regions().iter().find_map(|r0| {
            regs.values()
                .find(|g| g.region.same(r0))
                .and_then(|g| g.staged.as_ref())
                .map(|c| Arc::clone(&c.0))
        })
    }

    /// The staging area, registered on first use (and again after one was retired).
    async fn stage_area(&self) -> Result<Arc<StageArea>, AgentError> {
        {
            let mut cur = lock(&self.inner.stage_area);
            match cur.as_ref() {
                Some(a) if a.retired.load(std::sync::atomic::Ordering::SeqCst) => *cur = None,
                Some(a) => return Ok(Arc::clone(a)),
                None => {}
            }
        }
        let reg = self
            .register(
                (STAGE_CHUNK as usize) * STAGE_SLOTS,
                Visibility::Only(Vec::new()),
            )
            .await?;
        let area = Arc::new(StageArea {
            reg,
            free: Mutex::new((0..STAGE_SLOTS).rev().collect()),
            permits: tokio::sync::Semaphore::new(STAGE_SLOTS),
            retired: std::sync::atomic::AtomicBool::new(false),
        });
        // A concurrent first use may have made one too: the first one made is kept.
        Ok(Arc::clone(lock(&self.inner.stage_area).get_or_insert(area)))
    }

    /// A transfer whose local memory is staged: chunk by chunk through the staging area, up to
    /// [`STAGE_SLOTS`] chunks at once; the notification (if any) once every chunk completed.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn post_staged(
        &self,
        p: &Peer,
        peer: &str,
        op: Op,
        local: LocalDescList,
        remote: RemoteDescList,
        opts: &CallOptions,
        deadline: Instant,
        copier: Arc<dyn Copier>,
    ) -> Result<TransferStats, AgentError> {
        let total = local.total_len();
        if total != remote.total_len() {
            return Err(AgentError::Transfer(
                crate::runtime::TransferError::InvalidDescriptor(
                    crate::runtime::InvalidDescriptor::LengthMismatch {
                        local: total,
                        remote: remote.total_len(),
                    },
                ),
            ));
        }
        let area = self.stage_area().await?;
        let rt = self.object_runtime()?;
        // Wall time from here: the area's first registration and the I/O threads' start are
        // set-up, not transfer.
        let t0 = Instant::now();
        let chunks = total.div_ceil(STAGE_CHUNK).max(1) as usize;
        let parts = split_stream(&local, &remote, chunks, STAGE_CHUNK);
        if tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(agent = %self.inner.name, %peer, ?op, bytes = total, chunks, "staged transfer through host memory");
        }
        let inner_opts = CallOptions {
            notification: None,
            ..opts.clone()
        };
        let high = std::sync::atomic::AtomicUsize::new(0);
        // After a failure no new chunk starts; those in flight finish (their slots are then
        // free to reuse, or retired if their RDMA did not complete).
        let failed = std::sync::atomic::AtomicBool::new(false);
        let legs = futures_util::stream::iter(parts).map(|(l, r)| {
            let (area, rt, copier, inner_opts, high, failed) =
                (&area, &rt, &copier, &inner_opts, &high, &failed);
            async move {
                if failed.load(std::sync::atomic::Ordering::SeqCst) {
                    return Ok(None);
                }
                let mut slot = area.slot(deadline).await?;
                high.fetch_max(area.in_use(), std::sync::atomic::Ordering::Relaxed);
                let base = slot.index as u64 * STAGE_CHUNK;
                let len = l.total_len();
                let mut bounce = LocalDescList::with_capacity(1);
                bounce.push(area.reg.region(), base, len);
                let mut times = ChunkTimes::default();
                let copy = |dir: Op| {
                    let (copier, l, slot_region) =
                        (Arc::clone(copier), l.clone(), area.reg.region().clone());
                    async move {
                        let c0 = Instant::now();
                        let job = move || {
                            let mut at = base;
                            for d in l.descs() {
                                let region = &l.regions()[d.region as usize];
                                match dir {
                                    Op::Write => copier.device_to_region(
                                        region,
                                        d.offset,
                                        &slot_region,
                                        at,
                                        d.len,
                                    )?,
                                    _ => copier.region_to_device(
                                        &slot_region,
                                        at,
                                        region,
                                        d.offset,
                                        d.len,
                                    )?,
                                }
                                at += d.len;
                            }
                            Ok::<(), StagingError>(())
                        };
                        // The job ran to its end unless the I/O threads went away first.
                        match rt
                            .spawn(async move { tokio::task::spawn_blocking(job).await })
                            .await
                        {
                            None => (Err(AgentError::Stopped), false),
                            Some(Err(e)) => {
                                (Err(AgentError::Staging(StagingError::CopyThread(e))), true)
                            }
                            Some(Ok(r)) => {
                                (r.map(|()| c0.elapsed()).map_err(AgentError::Staging), true)
                            }
                        }
                    }
                };
                if op == Op::Write {
                    slot.busy = true;
                    let (r, finished) = copy(Op::Write).await;
                    slot.busy = !finished;
                    times.copy = r?;
                }
                let w0 = Instant::now();
                slot.busy = true;
                let posted =
                    Box::pin(self.post_on(p, peer, op, bounce, r, inner_opts, deadline)).await;
                slot.busy = posted.as_ref().err().is_some_and(maybe_posted);
                posted?;
                times.wire = w0.elapsed();
                if op != Op::Write {
                    slot.busy = true;
                    let (r, finished) = copy(Op::Read).await;
                    slot.busy = !finished;
                    times.copy = r?;
                }
                drop(slot);
                Ok::<Option<(u64, ChunkTimes)>, AgentError>(Some((len, times)))
            }
        });
        let mut done = legs.buffer_unordered(STAGE_SLOTS);
        let (mut bytes, mut copy_time, mut wire_time) = (0u64, Duration::ZERO, Duration::ZERO);
        let mut first_error = None;
        while let Some(r) = done.next().await {
            match r {
                Ok(Some((n, t))) => {
                    bytes += n;
                    copy_time += t.copy;
                    wire_time += t.wire;
                }
                Ok(None) => {}
                Err(e) => {
                    failed.store(true, std::sync::atomic::Ordering::SeqCst);
                    first_error.get_or_insert(e);
                }
            }
        }
        drop(done);
        if let Some(e) = first_error {
            return Err(e);
        }
        if let Some(msg) = opts.notification.as_deref() {
            self.notify_by(peer, msg, deadline).await?;
        }
        let wall = t0.elapsed();
        {
            let mut c = lock(&self.inner.staging);
            c.transfers += 1;
            c.bytes += bytes;
            c.chunks += chunks as u64;
            c.copy_time += copy_time;
            c.wire_time += wire_time;
            c.wall_time += wall;
            c.slots_high_water = c
                .slots_high_water
                .max(high.load(std::sync::atomic::Ordering::Relaxed));
        }
        let mut st = TransferStats::new(bytes, local.len(), chunks, chunks);
        st.staged_bytes = bytes;
        st.total = wall;
        Ok(st)
    }
}

impl super::Inner {
    /// Marks registration `id` staged (copied by `copier`, default the region's own copy) or
    /// direct.
    pub(crate) fn set_staged_id(&self, id: u64, staged: bool, copier: Option<Arc<dyn Copier>>) {
        let copier = staged.then(|| StagedCopier(copier.unwrap_or_else(|| Arc::new(RegionCopier))));
        tracing::debug!(agent = %self.name, region = id, staged, "registration staging set");
        self.regs.update(move |regs| {
            if let Some(r) = regs.get(&id) {
                let mut new = (**r).clone();
                new.staged = copier;
                regs.insert(id, Arc::new(new));
            }
            // Under the writers' lock: the count the transfer path looks at first.
            let n = regs.values().filter(|r| r.staged.is_some()).count();
            self.staged_regs
                .store(n, std::sync::atomic::Ordering::Release);
        });
    }

    /// Arms the measured choice of registration `id` ([`Agent::measure_staging`]).
    pub(crate) fn arm_auto_stage(&self, id: u64, copier: Option<Arc<dyn Copier>>) {
        let fresh = AutoStage {
            copier: copier.unwrap_or_else(|| Arc::new(RegionCopier)),
            direct: None,
            staged: None,
            probing: false,
            decided: None,
        };
        let was_pending = lock(&self.auto_stage)
            .insert(id, fresh)
            .is_some_and(|a| a.decided.is_none());
        if !was_pending {
            self.auto_pending
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        }
    }
}
