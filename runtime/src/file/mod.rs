//! The FILE tier: files as memory, moved to and from [`Region`]s through glommio's DMA files
//! (O_DIRECT, io_uring) on the engine's own core.
//!
//! A transfer pairs a local descriptor list with a list of [`FileDesc`]s (offset, length) in
//! order, like an RDMA transfer pairs local and remote lists. Before any I/O is issued:
//! - every descriptor is range-checked (the local ones against their regions, the file ones
//!   against the registered size);
//! - file descriptors that are adjacent in the list and in the file are merged, and long ones are
//!   split, into I/Os of at most [`FileConfig::max_io`] bytes;
//! - WRITE I/Os must start and end on the file's O_DIRECT alignment (512 or 4096 bytes). An
//!   unaligned write is refused with [`FileError::Unaligned`] (no read-modify-write is done, so
//!   nothing next to it can be clobbered); unaligned READs are served by reading the enclosing
//!   aligned range.
//!
//! Up to [`FileConfig::queue_depth`] I/Os of one transfer are in flight at once. Data is staged in
//! glommio's DMA buffers (one copy per byte on the engine's core). The transfer's tasks own the
//! job (its regions and the open file), so dropping the future never frees memory or closes a
//! file an I/O still uses; a timed-out transfer stops issuing I/Os and reports
//! [`crate::TransferError::Timeout`] while the ones in flight finish in the background.
//!
//! A registration with [`FileMode::Create`] or [`FileMode::CreateNew`] reserves its whole size
//! with `fallocate`, so a full file system is reported at registration ([`FileError::NoSpace`])
//! rather than half-way through a transfer.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use futures_channel::oneshot;
use glommio::io::{DmaFile, OpenOptions};
use glommio::GlommioError;

mod memory;

use crate::desc::{LocalDescList, Op};
use crate::error::{InvalidDescriptor, SharedError, TransferError};
use memory::StreamMemory;
pub use rixl_proto::error::{FileError, FileId};

/// How a file is opened by a registration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FileMode {
    /// Create the file, or truncate an existing one, and reserve `size` bytes.
    Create,
    /// Create a new file (an existing one is [`FileError::Exists`]) and reserve `size` bytes.
    CreateNew,
    /// Open an existing file read-write; it must hold at least `size` bytes (`size` 0: use the
    /// file's current size).
    Open,
}

/// What to register: a path, a size and a mode.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileSpec {
    /// The file's path.
    pub path: PathBuf,
    /// Size of the registration in bytes (descriptors must lie inside it).
    pub size: u64,
    /// How to open it.
    pub mode: FileMode,
}

impl FileSpec {
    /// A spec for `path` of `size` bytes opened with `mode`.
    pub fn new(path: impl Into<PathBuf>, size: u64, mode: FileMode) -> Self {
        FileSpec {
            path: path.into(),
            size,
            mode,
        }
    }
}

/// `len` bytes at `offset` of a registered file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileDesc {
    /// Offset into the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl FileDesc {
    /// `len` bytes at `offset`.
    pub fn new(offset: u64, len: u64) -> Self {
        FileDesc { offset, len }
    }
}

/// What registering a file returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileInfo {
    /// Id for transfers.
    pub id: FileId,
    /// Registered size.
    pub size: u64,
    /// O_DIRECT alignment of the file's device (bytes).
    pub alignment: u64,
    /// Whether I/O bypasses the page cache (false on tmpfs, which has no O_DIRECT).
    pub direct: bool,
}

/// A FILE-tier error from an OS error of `op` on `path`.
fn io_error(path: &Path, op: &'static str, e: io::Error) -> FileError {
    match e.kind() {
        io::ErrorKind::NotFound => FileError::NotFound { path: path.into() },
        io::ErrorKind::AlreadyExists => FileError::Exists { path: path.into() },
        io::ErrorKind::StorageFull => FileError::NoSpace {
            path: path.into(),
            during: op.to_string(),
        },
        kind => FileError::Io {
            path: path.into(),
            op,
            kind,
            source: SharedError::new(e),
        },
    }
}

/// A FILE-tier error from glommio's error of `op` on `path`.
fn glommio_error(path: &Path, op: &'static str, e: GlommioError<()>) -> FileError {
    match e {
        GlommioError::IoError(e) | GlommioError::EnhancedIoError { source: e, .. } => {
            io_error(path, op, e)
        }
        other => {
            // glommio's other errors hold a `Box<dyn Any + Send>` (not `Sync`), so they are
            // kept as the `io::Error` glommio itself converts them to: its kind and message.
            let e = io::Error::from(other);
            FileError::Io {
                path: path.into(),
                op,
                kind: e.kind(),
                source: SharedError::new(e),
            }
        }
    }
}

/// Tuning of the FILE tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileConfig {
    /// I/Os of one transfer in flight at once (fio's `iodepth`).
    pub queue_depth: usize,
    /// Largest single I/O after merging and splitting (a multiple of 4096).
    pub max_io: u64,
}

impl Default for FileConfig {
    fn default() -> Self {
        FileConfig {
            queue_depth: 32,
            max_io: 1 << 20,
        }
    }
}

/// Counters of the FILE tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FileCounters {
    /// Transfers started (validated).
    pub transfers: u64,
    /// I/Os issued.
    pub ios: u64,
    /// Descriptors that were merged into a preceding I/O.
    pub merged: u64,
    /// Bytes read from files.
    pub bytes_read: u64,
    /// Bytes written to files.
    pub bytes_written: u64,
}

struct OpenFile {
    dma: DmaFile,
    // A second descriptor of the same inode, for `fstat` (is it still linked?).
    probe: std::fs::File,
    path: PathBuf,
    size: u64,
}

/// One I/O: `len` bytes at `offset` of the file, which are stream bytes `stream..stream+len` of
/// the transfer (the local list read in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Io {
    offset: u64,
    len: u64,
    stream: u64,
    first_desc: usize,
}

/// Merges and splits file descriptors into I/Os (pure; see the module docs).
fn plan_ios(descs: &[FileDesc], max_io: u64, merged: &mut u64) -> Vec<Io> {
    let mut ios: Vec<Io> = Vec::with_capacity(descs.len());
    let mut stream = 0u64;
    for (index, d) in descs.iter().enumerate() {
        let (mut off, mut left) = (d.offset, d.len);
        if let Some(last) = ios.last_mut() {
            if last.offset + last.len == off && last.len < max_io {
                let take = left.min(max_io - last.len);
                last.len += take;
                off += take;
                left -= take;
                stream += take;
                *merged += 1;
            }
        }
        while left > 0 {
            let take = left.min(max_io);
            ios.push(Io {
                offset: off,
                len: take,
                stream,
                first_desc: index,
            });
            off += take;
            left -= take;
            stream += take;
        }
    }
    ios
}

fn validate_file(descs: &[FileDesc], size: u64) -> Result<u64, TransferError> {
    if descs.is_empty() {
        return Err(InvalidDescriptor::Empty { side: "file" }.into());
    }
    let mut total = 0u64;
    for (index, d) in descs.iter().enumerate() {
        if d.len == 0 {
            return Err(InvalidDescriptor::ZeroLength {
                side: "file",
                index,
            }
            .into());
        }
        match d.offset.checked_add(d.len) {
            Some(end) if end <= size => {}
            _ => {
                return Err(FileError::OutOfRange {
                    index,
                    offset: d.offset,
                    len: d.len,
                    size,
                }
                .into())
            }
        }
        total += d.len;
    }
    Ok(total)
}

/// A transfer's shared state, owned by its I/O tasks.
struct Job {
    file: Rc<OpenFile>,
    op: Op,
    mem: Rc<dyn StreamMemory>,
    ios: Vec<Io>,
    next: Cell<usize>,
    stop: Cell<bool>,
    error: RefCell<Option<FileError>>,
    workers: Cell<usize>,
    done: RefCell<Option<oneshot::Sender<Option<FileError>>>>,
    counters: Rc<Cell<FileCounters>>,
}

impl Job {
    fn fail(&self, e: FileError) {
        self.stop.set(true);
        self.error.borrow_mut().get_or_insert(e);
    }

    async fn run_one(&self, io: Io) -> Result<(), FileError> {
        let f = &self.file;
        let len = io.len as usize;
        match self.op {
            Op::Write => {
                let mut buf = f.dma.alloc_dma_buffer(len);
                self.mem.copy_out(io.stream, buf.as_bytes_mut());
                let wrote = f
                    .dma
                    .write_at(buf, io.offset)
                    .await
                    .map_err(|e| glommio_error(&f.path, "write", e))
                    .map_err(|e| match e {
                        FileError::NoSpace { path, .. } => FileError::NoSpace {
                            path,
                            during: format!("writing {} bytes at {}", io.len, io.offset),
                        },
                        e => e,
                    })?;
                if wrote != len {
                    return Err(FileError::ShortWrite {
                        path: f.path.clone(),
                        offset: io.offset,
                        expected: io.len,
                        got: wrote as u64,
                    });
                }
                self.count(|c| c.bytes_written += io.len);
            }
            Op::Read => {
                let aligned = io.offset.is_multiple_of(f.dma.alignment())
                    && io.len.is_multiple_of(f.dma.alignment());
                let res = if aligned {
                    f.dma.read_at_aligned(io.offset, len).await
                } else {
                    f.dma.read_at(io.offset, len).await
                }
                .map_err(|e| glommio_error(&f.path, "read", e))?;
                if res.len() != len {
                    return Err(FileError::ShortRead {
                        path: f.path.clone(),
                        offset: io.offset,
                        expected: io.len,
                        got: res.len() as u64,
                    });
                }
                self.mem.copy_in(io.stream, &res);
                self.count(|c| c.bytes_read += io.len);
            }
        }
        Ok(())
    }

    fn count(&self, f: impl FnOnce(&mut FileCounters)) {
        let mut c = self.counters.get();
        f(&mut c);
        self.counters.set(c);
    }
}

async fn worker(job: Rc<Job>) {
    loop {
        if job.stop.get() {
            break;
        }
        let i = job.next.get();
        let Some(&io) = job.ios.get(i) else { break };
        job.next.set(i + 1);
        job.count(|c| c.ios += 1);
        if let Err(e) = job.run_one(io).await {
            job.fail(e);
        }
    }
    job.workers.set(job.workers.get() - 1);
    if job.workers.get() == 0 {
        if let Some(tx) = job.done.borrow_mut().take() {
            let _ = tx.send(job.error.borrow_mut().take());
        }
    }
}

/// The FILE tier of one engine (one core): its open files and counters. `!Send`.
pub struct FileStore {
    cfg: FileConfig,
    files: RefCell<HashMap<FileId, Rc<OpenFile>>>,
    next: Cell<u64>,
    counters: Rc<Cell<FileCounters>>,
    // File systems (st_dev) whose glommio poll-ring probe has been primed on this executor.
    primed: RefCell<std::collections::HashSet<u64>>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("cfg", &self.cfg)
            .field("files", &self.files.borrow().len())
            .finish()
    }
}

impl FileStore {
    /// A store with `cfg` (call on the engine's executor).
    pub fn new(cfg: FileConfig) -> Self {
        FileStore {
            cfg: FileConfig {
                queue_depth: cfg.queue_depth.max(1),
                max_io: (cfg.max_io / 4096).max(1) * 4096,
            },
            files: RefCell::new(HashMap::new()),
            next: Cell::new(1),
            counters: Rc::new(Cell::new(FileCounters::default())),
            primed: RefCell::new(std::collections::HashSet::new()),
        }
    }

    /// glommio decides once per device and executor whether reads may use the I/O-polling ring,
    /// by reading the first block of the first file it opens there. On a new or sparse file that
    /// read never reaches the device, so the probe "succeeds" on devices without poll queues and
    /// every later read fails with `EOPNOTSUPP`. Before the first open on a file system, open a
    /// small file whose first block is really on the device, so the probe tells the truth.
    async fn prime_probe(&self, path: &Path) {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let Ok(meta) = std::fs::metadata(&dir) else {
            return;
        };
        if !self.primed.borrow_mut().insert(meta.dev()) {
            return;
        }
        let probe = dir.join(format!(
            ".rixl-probe-{}-{}",
            std::process::id(),
            self.next.get()
        ));
        let written = (|| -> io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::File::create(&probe)?;
            f.write_all(&[0x5a; 4096])?;
            f.sync_all()
        })();
        match written {
            Ok(()) => {
                if let Ok(f) = glommio::io::DmaFile::open(&probe).await {
                    let _ = f.close().await;
                }
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot prime the poll-ring probe");
            }
        }
        let _ = std::fs::remove_file(&probe);
    }

    /// The counters.
    pub fn counters(&self) -> FileCounters {
        self.counters.get()
    }

    /// Opens (and for the create modes, reserves) a file.
    ///
    /// # Errors
    /// [`FileError::NotFound`], [`FileError::Exists`], [`FileError::TooSmall`],
    /// [`FileError::NoSpace`], [`FileError::ZeroSize`] or [`FileError::Io`].
    pub async fn open(&self, spec: &FileSpec) -> Result<FileInfo, FileError> {
        let path = spec.path.as_path();
        let creates = matches!(spec.mode, FileMode::Create | FileMode::CreateNew);
        if spec.size == 0 && creates {
            return Err(FileError::ZeroSize { path: path.into() });
        }
        self.prime_probe(path).await;
        let mut opts = OpenOptions::new();
        opts.read(true).write(true);
        match spec.mode {
            FileMode::Create => opts.create(true).truncate(true),
            FileMode::CreateNew => opts.create_new(true),
            FileMode::Open => &mut opts,
        };
        let dma = opts
            .dma_open(path)
            .await
            .map_err(|e| glommio_error(path, "open", e))?;
        let probe = std::fs::File::open(path).map_err(|e| io_error(path, "open", e))?;
        let meta = probe.metadata().map_err(|e| io_error(path, "stat", e))?;
        if meta.ino() != dma.inode() {
            return Err(FileError::Io {
                path: path.into(),
                op: "open",
                kind: io::ErrorKind::Other,
                source: SharedError::new(io::Error::other(
                    "the path was replaced while it was being opened",
                )),
            });
        }
        let size = if creates {
            if let Err(e) = dma.pre_allocate(spec.size, false).await {
                let err = glommio_error(path, "reserve", e);
                // Leave no half-reserved file behind that would hold on to the space.
                let _ = std::fs::remove_file(path);
                return Err(match err {
                    FileError::NoSpace { path, .. } => FileError::NoSpace {
                        path,
                        during: format!("reserving {} bytes", spec.size),
                    },
                    e => e,
                });
            }
            spec.size
        } else {
            let actual = meta.len();
            if spec.size > actual {
                return Err(FileError::TooSmall {
                    path: path.into(),
                    size: actual,
                    needed: spec.size,
                });
            }
            if spec.size == 0 {
                if actual == 0 {
                    return Err(FileError::ZeroSize { path: path.into() });
                }
                actual
            } else {
                spec.size
            }
        };
        let id = FileId(self.next.get());
        self.next.set(id.0 + 1);
        let direct = !is_tmpfs(path);
        let info = FileInfo {
            id,
            size,
            alignment: dma.alignment(),
            direct,
        };
        tracing::debug!(path = %path.display(), size, alignment = info.alignment, direct, "file registered");
        self.files.borrow_mut().insert(
            id,
            Rc::new(OpenFile {
                dma,
                probe,
                path: path.into(),
                size,
            }),
        );
        Ok(info)
    }

    /// Forgets a file; it is closed now, or when its last in-flight I/O is done.
    pub fn close(&self, id: FileId) {
        if let Some(f) = self.files.borrow_mut().remove(&id) {
            if let Ok(f) = Rc::try_unwrap(f) {
                crate::supervise::spawn("file close", async move {
                    let _ = f.dma.close().await;
                });
            }
        }
    }

    /// Closes every file no I/O uses any more (at shutdown).
    pub async fn close_all(&self) {
        let files: Vec<Rc<OpenFile>> = self.files.borrow_mut().drain().map(|(_, f)| f).collect();
        for f in files {
            if let Ok(f) = Rc::try_unwrap(f) {
                let _ = f.dma.close().await;
            }
        }
    }

    /// Moves bytes between `local` and the file (`Op::Write`: memory to file, `Op::Read`: file to
    /// memory). See the module docs for merging, alignment, depth and timeout.
    ///
    /// # Errors
    /// [`TransferError::InvalidDescriptor`] or [`TransferError::File`] before any I/O is issued;
    /// [`TransferError::File`] for the first failing I/O (no new I/O is issued after it);
    /// [`TransferError::Timeout`].
    pub async fn transfer(
        &self,
        id: FileId,
        op: Op,
        local: LocalDescList,
        descs: &[FileDesc],
        timeout: Duration,
    ) -> Result<rixl_proto::TransferStats, TransferError> {
        let mem = memory::Regions::new(local)?;
        let n_descs = mem.descriptors();
        self.run(id, op, Rc::new(mem), n_descs, descs, timeout)
            .await
    }

    /// Writes `data` into the file at `descs` (paired in order, same total length): the I/O leg
    /// of a staged transfer, whose bytes were copied out of memory the engine cannot read
    /// itself (VRAM) into a host bounce buffer.
    ///
    /// # Errors
    /// As [`Self::transfer`].
    pub async fn write_bytes(
        &self,
        id: FileId,
        data: bytes::Bytes,
        descs: &[FileDesc],
        timeout: Duration,
    ) -> Result<rixl_proto::TransferStats, TransferError> {
        let mem = Rc::new(memory::Outgoing(data));
        self.run(id, Op::Write, mem, 1, descs, timeout).await
    }

    /// Reads the file at `descs` into one host buffer, returned with the stats.
    ///
    /// # Errors
    /// As [`Self::transfer`].
    pub async fn read_bytes(
        &self,
        id: FileId,
        descs: &[FileDesc],
        timeout: Duration,
    ) -> Result<(rixl_proto::TransferStats, Vec<u8>), TransferError> {
        let total = descs.iter().fold(0u64, |t, d| t.saturating_add(d.len));
        let len = usize::try_from(total).map_err(|_| InvalidDescriptor::LengthMismatch {
            local: usize::MAX as u64,
            remote: total,
        })?;
        let mem = Rc::new(memory::Incoming::new(len));
        let stats = self
            .run(
                id,
                Op::Read,
                Rc::clone(&mem) as Rc<dyn StreamMemory>,
                1,
                descs,
                timeout,
            )
            .await?;
        Ok((stats, mem.take()))
    }

    async fn run(
        &self,
        id: FileId,
        op: Op,
        mem: Rc<dyn StreamMemory>,
        n_descs: usize,
        descs: &[FileDesc],
        timeout: Duration,
    ) -> Result<rixl_proto::TransferStats, TransferError> {
        let t0 = Instant::now();
        let file = self
            .files
            .borrow()
            .get(&id)
            .cloned()
            .ok_or(FileError::UnknownFile(id))?;
        let span = tracing::debug_span!(
            "file_transfer",
            ?op,
            descs = descs.len(),
            bytes = tracing::field::Empty
        );
        let _e = span.enter();
        let file_total = validate_file(descs, file.size)?;
        let local_total = mem.len();
        if local_total != file_total {
            return Err(InvalidDescriptor::LengthMismatch {
                local: local_total,
                remote: file_total,
            }
            .into());
        }
        span.record("bytes", file_total);
        let mut merged = 0u64;
        let ios = plan_ios(descs, self.cfg.max_io, &mut merged);
        if op == Op::Write {
            if let Some(io) = ios.iter().find(|io| {
                !io.offset.is_multiple_of(file.dma.alignment())
                    || !io.len.is_multiple_of(file.dma.alignment())
            }) {
                return Err(FileError::Unaligned {
                    index: io.first_desc,
                    offset: io.offset,
                    len: io.len,
                    alignment: file.dma.alignment(),
                }
                .into());
            }
        }
        match file.probe.metadata() {
            Ok(m) if m.nlink() == 0 => {
                return Err(FileError::Deleted {
                    path: file.path.clone(),
                }
                .into())
            }
            Ok(_) => {}
            Err(e) => return Err(io_error(&file.path, "stat", e).into()),
        }
        let mut c = self.counters.get();
        c.transfers += 1;
        c.merged += merged;
        self.counters.set(c);
        let prepare = t0.elapsed();
        let workers = self.cfg.queue_depth.min(ios.len());
        let n_ios = ios.len();
        let (tx, rx) = oneshot::channel();
        let job = Rc::new(Job {
            file,
            op,
            mem,
            ios,
            next: Cell::new(0),
            stop: Cell::new(false),
            error: RefCell::new(None),
            workers: Cell::new(workers),
            done: RefCell::new(Some(tx)),
            counters: Rc::clone(&self.counters),
        });
        for _ in 0..workers {
            crate::supervise::spawn("file worker", worker(Rc::clone(&job)));
        }
        let finished = async { Some(rx.await) };
        let expired = async {
            glommio::timer::sleep(timeout).await;
            None
        };
        match futures_lite::future::or(finished, expired).await {
            Some(Ok(None)) => {
                let mut stats = rixl_proto::TransferStats::new(file_total, n_descs, n_ios, 0);
                stats.prepare = prepare;
                stats.total = t0.elapsed();
                Ok(stats)
            }
            Some(Ok(Some(e))) => Err(e.into()),
            Some(Err(_)) => Err(FileError::EngineGone.into()),
            None => {
                job.stop.set(true);
                Err(TransferError::Timeout(timeout))
            }
        }
    }
}

fn is_tmpfs(path: &Path) -> bool {
    // glommio turns O_DIRECT off on tmpfs; report it so users know the page cache is in play.
    let Ok(canon) = std::fs::canonicalize(path) else {
        return false;
    };
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return false;
    };
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, mnt, fs) = (f.next()?, f.next()?, f.next()?);
            Some((mnt, fs))
        })
        .filter(|(mnt, _)| canon.starts_with(mnt))
        .max_by_key(|(mnt, _)| mnt.len())
        .is_some_and(|(_, fs)| fs == "tmpfs")
}

#[cfg(test)]
mod tests;
