//! Staging through pooled host bounce buffers: memory the I/O cannot touch directly (VRAM, for
//! the object store and for files without GDS) is copied into a bounce buffer, and the I/O moves
//! the buffer. The two legs overlap: while one chunk's bytes are on the wire, the next chunk is
//! copied into another buffer (double buffering, or deeper).
//!
//! - [`BouncePool`] holds at most [`BouncePool::capacity`] buffers of [`BouncePool::buffer_len`]
//!   bytes, so staging memory stays bounded however large the transfer. A GPU node fills it with
//!   pinned (page-locked) host memory, where the device's copy engine runs at full speed; a host
//!   without a GPU with plain memory.
//! - A [`Copier`] is the copy leg: [`RegionCopier`] copies with the region's own copy
//!   (`cuMemcpy` for VRAM, `memcpy` for DRAM). Tests inject a slower or counting one, so the same
//!   pipeline is exercised on a host with host memory standing in for the device.
//! - [`stage_out`] copies chunks into buffers, in order, `depth` at a time, on blocking threads
//!   (a device copy never stalls the I/O runtime); [`copy_in`] is the reverse leg of a read.
//!
//! Everything here runs on the agent's I/O control thread (a tokio runtime), never on an
//! engine core.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::stream::{self, Stream, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::gpudirect::PinnedHostMemory;
use crate::runtime::{LocalDescList, Region};

/// A staging error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingError {
    /// The copy between a region and a bounce buffer failed.
    #[error("copying {len} bytes at {offset} of a {kind} region: {source}")]
    Copy {
        /// Offset into the region.
        offset: u64,
        /// Bytes.
        len: u64,
        /// "GPU" or "host".
        kind: &'static str,
        /// The copy's error.
        #[source]
        source: crate::verbs::Error,
    },
    /// Pinned host memory could not be allocated for the pool.
    #[error("allocating a {len}-byte pinned bounce buffer: {source}")]
    Pinned {
        /// Bytes asked for.
        len: usize,
        /// The driver's error.
        #[source]
        source: crate::gpudirect::Error,
    },
    /// A copy thread ended without finishing (it panicked, or the runtime is shutting down).
    #[error("a staging copy thread ended early: {0}")]
    CopyThread(#[source] tokio::task::JoinError),
    /// The pool was closed.
    #[error("the bounce pool is closed")]
    Closed,
    /// An I/O task ended without finishing (it panicked, or the runtime is shutting down).
    #[error("a staging I/O task ended early: {0}")]
    IoTask(#[source] tokio::task::JoinError),
    /// The I/O threads went away before the transfer finished.
    #[error("the staging I/O threads went away")]
    ThreadGone,
    /// A chunk does not fit one bounce buffer.
    #[error("a chunk of {len} bytes does not fit the pool's {buffer_len}-byte buffers")]
    Oversized {
        /// The chunk's bytes.
        len: u64,
        /// The pool's buffer size.
        buffer_len: usize,
    },
    /// Fewer bytes arrived than the chunk they fill.
    #[error("{got} bytes arrived for a chunk of {expected}")]
    Short {
        /// The chunk's bytes.
        expected: u64,
        /// Bytes that arrived.
        got: u64,
    },
}

/// The copy leg: between a region and host bytes.
pub trait Copier: Send + Sync + 'static {
    /// Copies `dst.len()` bytes at `offset` of `region` into `dst`.
    ///
    /// # Errors
    /// [`StagingError::Copy`].
    fn device_to_host(
        &self,
        region: &Region,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), StagingError>;

    /// Copies `src` into `region` at `offset`.
    ///
    /// # Errors
    /// [`StagingError::Copy`].
    fn host_to_device(&self, src: &[u8], region: &Region, offset: u64) -> Result<(), StagingError>;

    /// Copies `len` bytes at `offset` of `region` into host region `dst` at `dst_offset` (a
    /// registered bounce slot of staged RDMA). By default through a temporary buffer;
    /// [`RegionCopier`] copies once.
    ///
    /// # Errors
    /// [`StagingError::Copy`].
    fn device_to_region(
        &self,
        region: &Region,
        offset: u64,
        dst: &Region,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), StagingError> {
        let mut tmp = vec![0u8; len as usize];
        self.device_to_host(region, offset, &mut tmp)?;
        dst.write_at(dst_offset, &tmp)
            .map_err(|e| copy_error(dst, dst_offset, tmp.len(), e))
    }

    /// Copies `len` bytes at `src_offset` of host region `src` (a bounce slot) into `region` at
    /// `offset`. By default through a temporary buffer; [`RegionCopier`] copies once.
    ///
    /// # Errors
    /// [`StagingError::Copy`].
    fn region_to_device(
        &self,
        src: &Region,
        src_offset: u64,
        region: &Region,
        offset: u64,
        len: u64,
    ) -> Result<(), StagingError> {
        let mut tmp = vec![0u8; len as usize];
        src.read_at(src_offset, &mut tmp)
            .map_err(|e| copy_error(src, src_offset, tmp.len(), e))?;
        self.host_to_device(&tmp, region, offset)
    }
}

/// The region's own copy: `cuMemcpy` for GPU memory, `memcpy` for host memory.
#[derive(Debug, Default, Clone, Copy)]
pub struct RegionCopier;

fn copy_error(
    region: &Region,
    offset: u64,
    len: usize,
    source: crate::verbs::Error,
) -> StagingError {
    StagingError::Copy {
        offset,
        len: len as u64,
        kind: if region.is_gpu() { "GPU" } else { "host" },
        source,
    }
}

impl Copier for RegionCopier {
    fn device_to_host(
        &self,
        region: &Region,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), StagingError> {
        let len = dst.len();
        region
            .read_at(offset, dst)
            .map_err(|e| copy_error(region, offset, len, e))
    }

    fn host_to_device(&self, src: &[u8], region: &Region, offset: u64) -> Result<(), StagingError> {
        region
            .write_at(offset, src)
            .map_err(|e| copy_error(region, offset, src.len(), e))
    }

    fn device_to_region(
        &self,
        region: &Region,
        offset: u64,
        dst: &Region,
        dst_offset: u64,
        len: u64,
    ) -> Result<(), StagingError> {
        region
            .copy_to(offset, dst, dst_offset, len)
            .map_err(|e| copy_error(region, offset, len as usize, e))
    }

    fn region_to_device(
        &self,
        src: &Region,
        src_offset: u64,
        region: &Region,
        offset: u64,
        len: u64,
    ) -> Result<(), StagingError> {
        src.copy_to(src_offset, region, offset, len)
            .map_err(|e| copy_error(region, offset, len as usize, e))
    }
}

/// `len` bytes at `offset` of `region`.
#[derive(Clone)]
pub struct Piece {
    /// The memory.
    pub region: Region,
    /// Offset into it.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Piece")
            .field("gpu", &self.region.is_gpu())
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

/// The pieces of memory that fill one bounce buffer, in order.
#[derive(Debug, Clone, Default)]
pub struct Chunk {
    /// The pieces.
    pub pieces: Vec<Piece>,
}

impl Chunk {
    /// Bytes in the chunk.
    pub fn len(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Whether the chunk has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

enum BounceMemory {
    Host(Box<[u8]>),
    Pinned(PinnedHostMemory),
}

impl BounceMemory {
    fn bytes(&self) -> &[u8] {
        match self {
            BounceMemory::Host(b) => b,
            BounceMemory::Pinned(p) => p.as_slice(),
        }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            BounceMemory::Host(b) => b,
            BounceMemory::Pinned(p) => p.as_mut_slice(),
        }
    }
}

/// Where a pool's buffers come from.
#[derive(Clone)]
pub enum BounceSource {
    /// Plain host memory.
    Host,
    /// Pinned host memory of this GPU's context.
    Pinned(Arc<crate::gpudirect::Gpu>),
}

impl std::fmt::Debug for BounceSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BounceSource::Host => f.write_str("Host"),
            BounceSource::Pinned(_) => f.write_str("Pinned"),
        }
    }
}

struct PoolInner {
    buffer_len: usize,
    capacity: usize,
    source: BounceSource,
    free: Mutex<Vec<BounceMemory>>,
    permits: Arc<Semaphore>,
    allocated: AtomicUsize,
    in_use: AtomicUsize,
    high_water: AtomicUsize,
    copies: AtomicU64,
}

/// At most `capacity` bounce buffers of `buffer_len` bytes, allocated on first use and reused.
/// Cheap to clone (shared).
#[derive(Clone)]
pub struct BouncePool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for BouncePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BouncePool")
            .field("buffer_len", &self.inner.buffer_len)
            .field("capacity", &self.inner.capacity)
            .field("source", &self.inner.source)
            .field("counters", &self.counters())
            .finish()
    }
}

/// What a pool has done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct PoolCounters {
    /// Buffers allocated (never more than the capacity).
    pub allocated: usize,
    /// Buffers handed out now.
    pub in_use: usize,
    /// The most buffers handed out at once.
    pub high_water: usize,
    /// Chunks copied through the pool.
    pub copies: u64,
}

impl BouncePool {
    /// A pool of at most `capacity` (at least 1) buffers of `buffer_len` (at least 1) bytes.
    pub fn new(buffer_len: usize, capacity: usize, source: BounceSource) -> Self {
        let capacity = capacity.max(1);
        BouncePool {
            inner: Arc::new(PoolInner {
                buffer_len: buffer_len.max(1),
                capacity,
                source,
                free: Mutex::new(Vec::new()),
                permits: Arc::new(Semaphore::new(capacity)),
                allocated: AtomicUsize::new(0),
                in_use: AtomicUsize::new(0),
                high_water: AtomicUsize::new(0),
                copies: AtomicU64::new(0),
            }),
        }
    }

    /// Size of each buffer.
    pub fn buffer_len(&self) -> usize {
        self.inner.buffer_len
    }

    /// The most buffers the pool holds.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// The counters.
    pub fn counters(&self) -> PoolCounters {
        let i = &self.inner;
        PoolCounters {
            allocated: i.allocated.load(Ordering::Relaxed),
            in_use: i.in_use.load(Ordering::Relaxed),
            high_water: i.high_water.load(Ordering::Relaxed),
            copies: i.copies.load(Ordering::Relaxed),
        }
    }

    /// A buffer, waiting while all of them are handed out.
    ///
    /// # Errors
    /// [`StagingError::Pinned`] if a new pinned buffer cannot be allocated;
    /// [`StagingError::Closed`].
    pub async fn acquire(&self) -> Result<Bounce, StagingError> {
        let permit = Arc::clone(&self.inner.permits)
            .acquire_owned()
            .await
            .map_err(|_| StagingError::Closed)?;
        let reused = self
            .inner
            .free
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let mem = match reused {
            Some(m) => m,
            None => {
                let len = self.inner.buffer_len;
                let m = match &self.inner.source {
                    BounceSource::Host => BounceMemory::Host(vec![0u8; len].into_boxed_slice()),
                    BounceSource::Pinned(gpu) => BounceMemory::Pinned(
                        PinnedHostMemory::alloc(gpu, len)
                            .map_err(|source| StagingError::Pinned { len, source })?,
                    ),
                };
                self.inner.allocated.fetch_add(1, Ordering::Relaxed);
                m
            }
        };
        let now = self.inner.in_use.fetch_add(1, Ordering::Relaxed) + 1;
        self.inner.high_water.fetch_max(now, Ordering::Relaxed);
        Ok(Bounce {
            mem: Some(mem),
            len: 0,
            pool: Arc::clone(&self.inner),
            _permit: permit,
        })
    }
}

/// A host pool and, made the first time a GPU's memory is staged, a pinned one: the pool a
/// transfer's memory should be staged through. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct StagingPools {
    host: BouncePool,
    pinned: Arc<Mutex<Option<BouncePool>>>,
}

impl StagingPools {
    /// Pools of at most `capacity` buffers of `buffer_len` bytes each.
    pub fn new(buffer_len: usize, capacity: usize) -> Self {
        StagingPools {
            host: BouncePool::new(buffer_len, capacity, BounceSource::Host),
            pinned: Arc::new(Mutex::new(None)),
        }
    }

    /// The host pool.
    pub fn host(&self) -> &BouncePool {
        &self.host
    }

    /// The pool for `local`: pinned memory of the first GPU region's context, or the host
    /// pool.
    pub fn pool_for(&self, local: &LocalDescList) -> BouncePool {
        let gpu = local
            .regions()
            .iter()
            .find_map(|r| r.gpu_memory().map(|g| Arc::clone(g.gpu())));
        let Some(gpu) = gpu else {
            return self.host.clone();
        };
        self.pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert_with(|| {
                BouncePool::new(
                    self.host.buffer_len(),
                    self.host.capacity(),
                    BounceSource::Pinned(gpu),
                )
            })
            .clone()
    }
}

/// A bounce buffer on loan from a [`BouncePool`]; it goes back when dropped (also when it was
/// turned into [`bytes::Bytes`] and the last of those is dropped).
pub struct Bounce {
    mem: Option<BounceMemory>,
    len: usize,
    pool: Arc<PoolInner>,
    _permit: OwnedSemaphorePermit,
}

impl std::fmt::Debug for Bounce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounce").field("len", &self.len).finish()
    }
}

impl Bounce {
    /// The staged bytes.
    pub fn as_bytes(&self) -> &[u8] {
        self.mem.as_ref().map_or(&[], |m| &m.bytes()[..self.len])
    }

    /// The staged bytes as [`bytes::Bytes`] (no copy); the buffer returns to the pool when the
    /// last clone is dropped.
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }

    /// Copies `chunk` into the buffer with `copier` (blocking: call on a blocking thread).
    fn fill(&mut self, copier: &dyn Copier, chunk: &Chunk) -> Result<(), StagingError> {
        let Some(mem) = self.mem.as_mut() else {
            return Err(StagingError::Closed);
        };
        let buf = mem.bytes_mut();
        let mut pos = 0usize;
        for p in &chunk.pieces {
            let n = p.len as usize;
            copier.device_to_host(&p.region, p.offset, &mut buf[pos..pos + n])?;
            pos += n;
        }
        self.len = pos;
        Ok(())
    }
}

impl AsRef<[u8]> for Bounce {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(m);
        }
        self.pool.in_use.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The memory of stream bytes `stream..stream+len` of `local` (`starts` from
/// [`LocalDescList::stream_starts`]), as a chunk.
pub fn chunk_of(local: &LocalDescList, starts: &[u64], stream: u64, len: u64) -> Chunk {
    let regions = local.regions();
    let pieces = local
        .stream_pieces(starts, stream, len)
        .into_iter()
        .map(|(r, offset, len)| Piece {
            region: regions[r].clone(),
            offset,
            len,
        })
        .collect();
    Chunk { pieces }
}

/// Copies `chunks` into bounce buffers of `pool` with `copier`, up to `depth` copies at once on
/// blocking threads, and yields the filled buffers in chunk order. A chunk longer than the
/// pool's buffers is [`StagingError::Oversized`].
///
/// The consumer overlaps the I/O leg: while it sends one buffer, the next ones are being copied.
/// Memory stays within the pool's capacity: a copy waits for a buffer the I/O has given back.
pub fn stage_out(
    pool: &BouncePool,
    copier: Arc<dyn Copier>,
    chunks: Vec<Chunk>,
    depth: usize,
) -> impl Stream<Item = Result<Bounce, StagingError>> + Send + 'static {
    let pool = pool.clone();
    stream::iter(chunks)
        .map(move |chunk| {
            let pool = pool.clone();
            let copier = Arc::clone(&copier);
            async move {
                let mut bounce = pool.acquire().await?;
                if chunk.len() > pool.buffer_len() as u64 {
                    return Err(StagingError::Oversized {
                        len: chunk.len(),
                        buffer_len: pool.buffer_len(),
                    });
                }
                let filled = tokio::task::spawn_blocking(move || {
                    bounce.fill(copier.as_ref(), &chunk).map(|()| bounce)
                })
                .await
                .map_err(StagingError::CopyThread)??;
                pool.inner.copies.fetch_add(1, Ordering::Relaxed);
                Ok(filled)
            }
        })
        .buffered(depth.max(1))
}

/// Copies `bytes` into the pieces of `chunk`, in order, on a blocking thread (the read
/// direction's copy leg).
///
/// # Errors
/// [`StagingError::Short`] when `bytes` is shorter than the chunk, [`StagingError::Copy`], or
/// [`StagingError::CopyThread`].
pub async fn copy_in(
    copier: Arc<dyn Copier>,
    chunk: Chunk,
    bytes: bytes::Bytes,
) -> Result<(), StagingError> {
    if (bytes.len() as u64) < chunk.len() {
        return Err(StagingError::Short {
            expected: chunk.len(),
            got: bytes.len() as u64,
        });
    }
    tokio::task::spawn_blocking(move || {
        let mut pos = 0usize;
        for p in &chunk.pieces {
            let n = p.len as usize;
            copier.host_to_device(&bytes[pos..pos + n], &p.region, p.offset)?;
            pos += n;
        }
        Ok(())
    })
    .await
    .map_err(StagingError::CopyThread)?
}

/// Sends each buffer `staged` yields with `leg` (the I/O leg), at most `depth` legs at once,
/// and returns their results (in completion order) or the first error.
///
/// The copy leg runs in a task of its own, ahead of the I/O by as many buffers as the pool
/// lends, and each leg in a task of its own: a copy never waits for an upload to be polled, and
/// an upload never waits for a copy. Dropping the future aborts both (the buffers they own go
/// back to the pool).
pub(crate) async fn drain<T, E, F>(
    staged: impl Stream<Item = Result<Bounce, StagingError>> + Send + 'static,
    depth: usize,
    mut leg: impl FnMut(Bounce) -> F,
) -> Result<Vec<T>, E>
where
    F: Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: From<StagingError> + Send + 'static,
{
    let depth = depth.max(1);
    let (tx, mut rx) = tokio::sync::mpsc::channel(depth);
    let mut copies = tokio::task::JoinSet::new();
    copies.spawn(async move {
        let mut staged = std::pin::pin!(staged);
        while let Some(b) = staged.next().await {
            if tx.send(b).await.is_err() {
                break;
            }
        }
    });
    let mut legs = tokio::task::JoinSet::new();
    let mut out = Vec::new();
    let joined = |r: Result<Result<T, E>, tokio::task::JoinError>| -> Result<T, E> {
        r.map_err(|e| E::from(StagingError::IoTask(e)))?
    };
    let mut staging = true;
    while staging || !legs.is_empty() {
        tokio::select! {
            b = rx.recv(), if staging && legs.len() < depth => match b {
                Some(b) => {
                    legs.spawn(leg(b?));
                }
                None => staging = false,
            },
            Some(r) = legs.join_next(), if !legs.is_empty() => out.push(joined(r)?),
        }
    }
    Ok(out)
}

/// Runs `legs` (futures of the I/O leg) `depth` at a time and returns the first error.
pub(crate) async fn run_bounded<F, E>(
    legs: impl IntoIterator<Item = F>,
    depth: usize,
) -> Result<(), E>
where
    F: Future<Output = Result<(), E>>,
{
    let mut s = stream::iter(legs).buffer_unordered(depth.max(1));
    while let Some(r) = s.next().await {
        r?;
    }
    Ok(())
}
