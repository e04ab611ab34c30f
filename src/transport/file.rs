//! The FILE tier: a registered file read or written on the agent's core (O_DIRECT, io_uring).
//!
//! Host memory goes straight between the regions and the engine's DMA buffers. Memory the
//! engine must not copy itself on its core (VRAM: a `cuMemcpy` there would stall every transfer
//! the core owns, and from unpinned memory) is staged: chunks are copied into pooled pinned
//! host buffers on the I/O threads ([`crate::staging`]), and each buffer is written by the
//! engine while the next chunk is copied (the reverse for reads). GPUDirect Storage (cuFile)
//! is not used: see `docs/gpu.md`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::agent::error::AgentError;
use crate::agent::FileRegistration;
use crate::gpudirect::gds::{Gds, GdsFile};
use crate::runtime::{
    FileDesc, FileError, InvalidDescriptor, LocalDescList, Op, TransferError, TransferStats,
};
use crate::staging::{self, BouncePool, Chunk, Copier, StagingError};

use super::Transport;

/// Bytes staged per engine I/O call (a multiple of every O_DIRECT alignment).
pub const STAGE_CHUNK: u64 = 4 << 20;
/// Staged chunks in flight at once (copies and writes together).
pub const STAGE_DEPTH: usize = 4;

/// FILE transfers (the file's engine does the I/O).
pub(crate) struct FileTransport<'a> {
    /// The agent's I/O threads, started when a transfer is staged.
    pub io: &'a dyn Fn() -> Result<Arc<crate::object::Runtime>, AgentError>,
}

/// Memory and the file pieces it pairs with, in order.
pub(crate) struct FileRequest<'a> {
    pub local: &'a LocalDescList,
    pub file: &'a FileRegistration,
    pub descs: &'a [FileDesc],
    /// Deadline (`None`: the engine's `transfer_timeout`).
    pub timeout: Option<std::time::Duration>,
    /// The engine's `transfer_timeout`.
    pub default_timeout: Duration,
}

impl Transport for FileTransport<'_> {
    type Request<'a> = FileRequest<'a>;

    async fn transfer(&self, op: Op, r: Self::Request<'_>) -> Result<TransferStats, AgentError> {
        let f = &r.file.inner;
        let stage = r.file.copier.clone().or_else(|| {
            r.local
                .regions()
                .iter()
                .any(crate::runtime::Region::is_gpu)
                .then(|| Arc::new(staging::RegionCopier) as Arc<dyn Copier>)
        });
        let Some(copier) = stage else {
            return Ok(f
                .engine
                .file_transfer(f.info.id, op, r.local.clone(), r.descs.to_vec(), r.timeout)
                .await?);
        };
        let io = (self.io)()?;
        let timeout = r.timeout.unwrap_or(r.default_timeout);
        let mut job = StagedFile::new(op, r.local, r.file, r.descs, copier, timeout)?;
        let all_gpu = r.local.regions().iter().all(crate::runtime::Region::is_gpu);
        if r.file.copier.is_none() && all_gpu {
            job.gds = f.gds_file();
        }
        tracing::debug!(
            ?op,
            bytes = job.total,
            chunks = job.chunks.len(),
            gds = job.gds.is_some(),
            "FILE transfer of memory the engine does not copy (GPUDirect Storage or staged)"
        );
        io.spawn(job.run())
            .await
            .unwrap_or(Err(AgentError::Staging(StagingError::ThreadGone)))
    }
}

/// A staged FILE transfer, checked and cut into chunks, owned by the I/O threads.
struct StagedFile {
    op: Op,
    file: FileRegistration,
    copier: Arc<dyn Copier>,
    pool: BouncePool,
    /// Each chunk's memory and its file pieces.
    chunks: Vec<(Chunk, Vec<FileDesc>)>,
    total: u64,
    descriptors: usize,
    timeout: Duration,
    /// GPUDirect Storage instead of staging, where it is present.
    gds: Option<Arc<GdsFile>>,
}

/// GPUDirect Storage for this process: loaded once, `None` where `libcufile` is absent, its
/// driver does not open, or `RIXL_GDS=0`.
pub(crate) fn gds() -> Option<Arc<Gds>> {
    static GDS: std::sync::OnceLock<Option<Arc<Gds>>> = std::sync::OnceLock::new();
    GDS.get_or_init(|| {
        if std::env::var("RIXL_GDS").as_deref() == Ok("0") {
            tracing::info!("GPUDirect Storage off (RIXL_GDS=0): VRAM is staged");
            return None;
        }
        match Gds::open() {
            Ok(g) => {
                tracing::info!("GPUDirect Storage (cuFile) present: VRAM FILE transfers use it");
                Some(g)
            }
            Err(e) => {
                tracing::info!(error = %e, "no GPUDirect Storage: VRAM FILE transfers are staged");
                None
            }
        }
    })
    .clone()
}

/// Pairs a chunk's memory pieces with its file pieces: `(piece, file offset)` runs of equal
/// length, in order.
fn runs(chunk: &Chunk, files: &[FileDesc]) -> Vec<(staging::Piece, u64)> {
    let mut out = Vec::new();
    let mut files = files.iter().copied();
    let mut file = files.next();
    for p in &chunk.pieces {
        let (mut off, mut left) = (p.offset, p.len);
        while left > 0 {
            let Some(f) = file.as_mut() else { return out };
            let take = left.min(f.len);
            out.push((
                staging::Piece {
                    region: p.region.clone(),
                    offset: off,
                    len: take,
                },
                f.offset,
            ));
            (off, left) = (off + take, left - take);
            (f.offset, f.len) = (f.offset + take, f.len - take);
            if f.len == 0 {
                file = files.next();
            }
        }
    }
    out
}

impl StagedFile {
    fn new(
        op: Op,
        local: &LocalDescList,
        file: &FileRegistration,
        descs: &[FileDesc],
        copier: Arc<dyn Copier>,
        timeout: Duration,
    ) -> Result<Self, AgentError> {
        let invalid = |e: InvalidDescriptor| AgentError::Transfer(TransferError::from(e));
        let total = rixl_proto::plan::check_local(
            |i| local.regions().get(i).map(|r| r.len()),
            local.descs(),
        )
        .map_err(invalid)?;
        let file_total = descs.iter().fold(0u64, |t, d| t.saturating_add(d.len));
        if descs.is_empty() {
            return Err(invalid(InvalidDescriptor::Empty { side: "file" }));
        }
        if file_total != total {
            return Err(invalid(InvalidDescriptor::LengthMismatch {
                local: total,
                remote: file_total,
            }));
        }
        let align = file.alignment().max(1);
        for (index, d) in descs.iter().enumerate() {
            // The engine checks its own I/Os again; cuFile does not, so check here for both.
            let inside = d
                .offset
                .checked_add(d.len)
                .is_some_and(|end| end <= file.size());
            if !inside || d.len == 0 {
                return Err(AgentError::Transfer(TransferError::File(
                    FileError::OutOfRange {
                        index,
                        offset: d.offset,
                        len: d.len,
                        size: file.size(),
                    },
                )));
            }
            // Chunks cut descriptors, so each must be aligned on its own (the direct path only
            // needs merged I/Os to be). The engine range-checks them again.
            if op == Op::Write && (!d.offset.is_multiple_of(align) || !d.len.is_multiple_of(align))
            {
                return Err(AgentError::Transfer(TransferError::File(
                    FileError::Unaligned {
                        index,
                        offset: d.offset,
                        len: d.len,
                        alignment: align,
                    },
                )));
            }
        }
        let starts = local.stream_starts();
        let mut chunks = Vec::new();
        let mut pos = 0u64;
        let mut cut = descs.iter().copied().peekable();
        let mut head: Option<FileDesc> = None;
        while pos < total {
            let len = (total - pos).min(STAGE_CHUNK);
            let mut pieces = Vec::new();
            let mut left = len;
            while left > 0 {
                let Some(d) = head.take().or_else(|| cut.next()) else {
                    break;
                };
                let take = d.len.min(left);
                pieces.push(FileDesc::new(d.offset, take));
                if take < d.len {
                    head = Some(FileDesc::new(d.offset + take, d.len - take));
                }
                left -= take;
            }
            chunks.push((staging::chunk_of(local, &starts, pos, len), pieces));
            pos += len;
        }
        let pool = file.inner.pool_for(local);
        Ok(StagedFile {
            op,
            file: file.clone(),
            copier,
            pool,
            chunks,
            total,
            descriptors: local.len(),
            timeout,
            gds: None,
        })
    }

    /// Moves every chunk with cuFile, `STAGE_DEPTH` chunks at once, each on a blocking thread.
    async fn direct(&self, gds: &Arc<GdsFile>) -> Result<(), AgentError> {
        let write = self.op == Op::Write;
        let all: Vec<_> = self.chunks.iter().map(|(c, d)| runs(c, d)).collect();
        let legs = all.into_iter().map(|runs| {
            let gds = Arc::clone(gds);
            async move {
                tokio::task::spawn_blocking(move || {
                    for (p, at) in runs {
                        let Some(mem) = p.region.gpu_memory() else {
                            continue;
                        };
                        let (off, len) = (p.offset as usize, p.len as usize);
                        if write {
                            gds.write(mem, off, len, at)?;
                        } else {
                            gds.read(mem, off, len, at)?;
                        }
                    }
                    Ok::<(), crate::gpudirect::gds::GdsError>(())
                })
                .await
                .map_err(|e| AgentError::Staging(StagingError::IoTask(e)))?
                .map_err(AgentError::Gds)
            }
        });
        staging::run_bounded(legs, STAGE_DEPTH).await
    }

    async fn run(self) -> Result<TransferStats, AgentError> {
        let t0 = Instant::now();
        let deadline = tokio::time::Instant::now() + self.timeout;
        let n = self.chunks.len();
        let work = async {
            match (&self.gds, self.op) {
                (Some(gds), _) => self.direct(gds).await,
                (None, Op::Write) => self.write().await,
                (None, Op::Read) => self.read().await,
            }
        };
        match tokio::time::timeout_at(deadline, work).await {
            Ok(r) => r?,
            Err(_) => return Err(TransferError::Timeout(self.timeout).into()),
        }
        let mut stats = TransferStats::new(self.total, self.descriptors, n, 0);
        stats.total = t0.elapsed();
        Ok(stats)
    }

    fn left(&self, t0: Instant) -> Option<Duration> {
        Some(self.timeout.saturating_sub(t0.elapsed()))
    }

    async fn write(&self) -> Result<(), AgentError> {
        let t0 = Instant::now();
        let f = &self.file.inner;
        let (mems, files): (Vec<Chunk>, Vec<Vec<FileDesc>>) = self.chunks.iter().cloned().unzip();
        let staged = staging::stage_out(&self.pool, Arc::clone(&self.copier), mems, STAGE_DEPTH);
        let n = files.len();
        let mut files = files.into_iter();
        let done = staging::drain(staged, STAGE_DEPTH, |bounce| {
            let descs = files.next().unwrap_or_default();
            let engine = f.engine.clone();
            let (id, left) = (f.info.id, self.left(t0));
            async move {
                engine
                    .file_write_bytes(id, bounce.into_bytes(), descs, left)
                    .await
                    .map_err(AgentError::from)
            }
        })
        .await?;
        if done.len() != n {
            // The copy stream ended early (its task died): the file is not all written.
            return Err(AgentError::Staging(StagingError::ThreadGone));
        }
        Ok(())
    }

    async fn read(&self) -> Result<(), AgentError> {
        let t0 = Instant::now();
        let f = &self.file.inner;
        let legs = self.chunks.iter().cloned().map(|(chunk, descs)| {
            let copier = Arc::clone(&self.copier);
            let engine = f.engine.clone();
            let id = f.info.id;
            let left = self.left(t0);
            async move {
                let (_, bytes) = engine.file_read_bytes(id, descs, left).await?;
                staging::copy_in(copier, chunk, bytes.into()).await?;
                Ok::<(), AgentError>(())
            }
        });
        staging::run_bounded(legs, STAGE_DEPTH).await
    }
}
