//! GPUDirect Storage (cuFile), loaded at run time: file I/O straight between a file and GPU
//! memory, without a host bounce buffer (with the nvidia-fs module; libcufile's compatibility
//! mode moves the bytes through its own host buffers otherwise).
//!
//! [`Gds::open`] loads `libcufile` and opens its driver. Without the library it is
//! [`GdsError::NotPresent`], and rixl stages VRAM through pinned host buffers instead. A file is
//! registered once ([`GdsFile::open`]); [`GdsFile::write`] and [`GdsFile::read`] move one range
//! each, blocking the calling thread (call them from a blocking pool, never an engine core).
//!
//! No machine rixl was developed on has libcufile: this path has not run. The loader, the
//! absent-library path and the argument checks are tested; the transfers are exercised by the
//! GPU check (`gpu_tiers`) on a machine that has it.

use std::ffi::{c_int, c_void};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;

use crate::memory::{DeviceMemory, Gpu};

/// A cuFile error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GdsError {
    /// `libcufile` could not be loaded (no GPUDirect Storage on this machine).
    #[error("GPUDirect Storage is not available: {0}")]
    NotPresent(#[source] libloading::Error),
    /// A cuFile call failed.
    #[error("{call} failed: cuFile error {err}, CUDA error {cu_err}")]
    Call {
        /// The function.
        call: &'static str,
        /// `CUfileOpError`.
        err: i32,
        /// `CUresult`, when the error came from the driver.
        cu_err: i32,
    },
    /// A read or write moved fewer bytes than asked (or returned an error code).
    #[error("{call} of {len} bytes at file offset {offset} returned {got}")]
    Short {
        /// "cuFileRead" or "cuFileWrite".
        call: &'static str,
        /// Bytes asked for.
        len: usize,
        /// File offset.
        offset: u64,
        /// What it returned (negative: an error).
        got: isize,
    },
    /// The range is outside the device memory.
    #[error("device range {offset}+{len} is outside the {size}-byte allocation")]
    OutOfRange {
        /// Offset into the memory.
        offset: usize,
        /// Length.
        len: usize,
        /// The memory's size.
        size: usize,
    },
    /// The file could not be opened.
    #[error("opening {path} for GPUDirect Storage: {source}")]
    Open {
        /// The path.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Binding the GPU's context to the calling thread failed.
    #[error(transparent)]
    Gpu(#[from] crate::Error),
}

/// `CUfileError_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CuFileError {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t`: the handle type, the descriptor (a union of an fd and a pointer), and the
/// file-system operations (null for a plain fd).
#[repr(C)]
struct CuFileDescr {
    kind: c_int,
    handle: CuFileHandleUnion,
    fs_ops: *const c_void,
}

#[repr(C)]
union CuFileHandleUnion {
    fd: c_int,
    handle: *mut c_void,
}

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD`.
const HANDLE_TYPE_OPAQUE_FD: c_int = 1;
/// `O_DIRECT` (its value differs between x86_64 and aarch64); cuFile needs files opened with it.
#[cfg(target_arch = "aarch64")]
const O_DIRECT: i32 = 0o200_000;
#[cfg(not(target_arch = "aarch64"))]
const O_DIRECT: i32 = 0o40_000;

type DriverOpen = unsafe extern "C" fn() -> CuFileError;
type DriverClose = unsafe extern "C" fn() -> CuFileError;
type HandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut CuFileDescr) -> CuFileError;
type HandleDeregister = unsafe extern "C" fn(*mut c_void);
type Io = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;

/// The loaded library and its driver, open while this lives.
pub struct Gds {
    driver_close: DriverClose,
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    read: Io,
    write: Io,
    // Last: the function pointers above point into it.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Gds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gds")
    }
}

fn check(call: &'static str, e: CuFileError) -> Result<(), GdsError> {
    if e.err == 0 {
        Ok(())
    } else {
        Err(GdsError::Call {
            call,
            err: e.err,
            cu_err: e.cu_err,
        })
    }
}

impl Gds {
    /// Loads `libcufile` and opens its driver.
    ///
    /// # Errors
    /// [`GdsError::NotPresent`] without the library; [`GdsError::Call`] if the driver does not
    /// open.
    pub fn open() -> Result<Arc<Gds>, GdsError> {
        let mut first = None;
        for name in ["libcufile.so.0", "libcufile.so", "libcufile.so.1"] {
            // SAFETY: loading libcufile runs its initialisers, which only set up the library's
            // own state; it is NVIDIA's library for exactly this use, loaded by name.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => return Self::with(lib),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        Err(GdsError::NotPresent(
            first.unwrap_or(libloading::Error::DlOpenUnknown),
        ))
    }

    fn with(lib: libloading::Library) -> Result<Arc<Gds>, GdsError> {
        // SAFETY: each symbol is looked up by its documented cuFile name and given the type of
        // its documented C signature (cufile.h): the types above mirror those declarations.
        let (driver_open, driver_close, handle_register, handle_deregister, read, write) = unsafe {
            (
                *lib.get::<DriverOpen>(b"cuFileDriverOpen\0")
                    .map_err(GdsError::NotPresent)?,
                *lib.get::<DriverClose>(b"cuFileDriverClose\0")
                    .map_err(GdsError::NotPresent)?,
                *lib.get::<HandleRegister>(b"cuFileHandleRegister\0")
                    .map_err(GdsError::NotPresent)?,
                *lib.get::<HandleDeregister>(b"cuFileHandleDeregister\0")
                    .map_err(GdsError::NotPresent)?,
                *lib.get::<Io>(b"cuFileRead\0")
                    .map_err(GdsError::NotPresent)?,
                *lib.get::<Io>(b"cuFileWrite\0")
                    .map_err(GdsError::NotPresent)?,
            )
        };
        // SAFETY: cuFileDriverOpen takes no arguments; it is paired with cuFileDriverClose in
        // Drop.
        check("cuFileDriverOpen", unsafe { driver_open() })?;
        Ok(Arc::new(Gds {
            driver_close,
            handle_register,
            handle_deregister,
            read,
            write,
            _lib: lib,
        }))
    }
}

impl Drop for Gds {
    fn drop(&mut self) {
        // SAFETY: the driver was opened in `with`; every GdsFile holds an Arc of this, so no
        // handle outlives it.
        let _ = unsafe { (self.driver_close)() };
    }
}

/// A file registered with cuFile (opened with `O_DIRECT`), deregistered on drop.
pub struct GdsFile {
    gds: Arc<Gds>,
    handle: *mut c_void,
    // Kept open while registered; closed after the deregistration in Drop.
    file: std::fs::File,
}

// SAFETY: a cuFile handle may be used from any thread (cuFile is thread-safe per its
// documentation); the file descriptor is owned.
unsafe impl Send for GdsFile {}
// SAFETY: as above; reads and writes through the handle take `&self` and cuFile serialises
// what it must.
unsafe impl Sync for GdsFile {}

impl std::fmt::Debug for GdsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdsFile")
            .field("fd", &self.file.as_raw_fd())
            .finish()
    }
}

impl GdsFile {
    /// Opens `path` read-write with `O_DIRECT` and registers it.
    ///
    /// # Errors
    /// [`GdsError::Open`], or [`GdsError::Call`] from `cuFileHandleRegister`.
    pub fn open(gds: &Arc<Gds>, path: &Path) -> Result<GdsFile, GdsError> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(O_DIRECT)
            .open(path)
            .map_err(|source| GdsError::Open {
                path: path.into(),
                source,
            })?;
        let mut descr = CuFileDescr {
            kind: HANDLE_TYPE_OPAQUE_FD,
            handle: CuFileHandleUnion {
                fd: file.as_raw_fd(),
            },
            fs_ops: std::ptr::null(),
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: `descr` describes an open fd that `file` keeps open for the handle's life;
        // cuFile writes the new handle into `handle`.
        check("cuFileHandleRegister", unsafe {
            (gds.handle_register)(&mut handle, &mut descr)
        })?;
        Ok(GdsFile {
            gds: Arc::clone(gds),
            handle,
            file,
        })
    }

    fn io(
        &self,
        write: bool,
        gpu: &Gpu,
        mem: &DeviceMemory,
        offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<(), GdsError> {
        if offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(GdsError::OutOfRange {
                offset,
                len,
                size: mem.len(),
            });
        }
        gpu.bind()?;
        let (call, f) = if write {
            ("cuFileWrite", self.gds.write)
        } else {
            ("cuFileRead", self.gds.read)
        };
        let at = i64::try_from(file_offset).unwrap_or(i64::MAX);
        let dev_off = i64::try_from(offset).unwrap_or(i64::MAX);
        // SAFETY: the handle is registered and its file open; `mem` is a live device allocation
        // of this context (bound above) and `offset..offset+len` lies inside it (checked).
        let got = unsafe { f(self.handle, mem.addr() as *mut c_void, len, at, dev_off) };
        if got != len as isize {
            return Err(GdsError::Short {
                call,
                len,
                offset: file_offset,
                got,
            });
        }
        Ok(())
    }

    /// Writes `len` bytes at `offset` of `mem` to the file at `file_offset` (blocking).
    ///
    /// # Errors
    /// [`GdsError::OutOfRange`], [`GdsError::Short`], or a context error.
    pub fn write(
        &self,
        mem: &DeviceMemory,
        offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<(), GdsError> {
        self.io(true, mem.gpu(), mem, offset, len, file_offset)
    }

    /// Reads `len` bytes of the file at `file_offset` into `mem` at `offset` (blocking).
    ///
    /// # Errors
    /// As [`Self::write`].
    pub fn read(
        &self,
        mem: &DeviceMemory,
        offset: usize,
        len: usize,
        file_offset: u64,
    ) -> Result<(), GdsError> {
        self.io(false, mem.gpu(), mem, offset, len, file_offset)
    }
}

impl Drop for GdsFile {
    fn drop(&mut self) {
        // SAFETY: registered in `open`, deregistered once, before `file` closes the fd.
        unsafe { (self.gds.handle_deregister)(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gds_a_library_without_cufile_symbols_is_not_present() {
        // SAFETY: the C library is loaded by every Rust program already; loading it again only
        // takes a reference.
        let libc = unsafe { libloading::Library::new("libc.so.6") }.expect("libc loads");
        assert!(matches!(Gds::with(libc), Err(GdsError::NotPresent(_))));
        // On this machine: absent (typed), or present and opened, or present with a driver
        // that refused; never a panic.
        match Gds::open() {
            Err(GdsError::NotPresent(e)) => println!("libcufile not present: {e}"),
            Err(e) => println!("libcufile present, its driver did not open: {e}"),
            Ok(_) => println!("libcufile present and its driver opened"),
        }
    }
}
