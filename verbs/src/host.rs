//! Host memory a registration covers: page-aligned memory allocated here, or memory the caller
//! already owns (a `Vec`, a boxed slice, a memory map, a `'static` slice, or a raw range under
//! the caller's promise). It is what [`crate::RegisteredBuffer`] registers with the NIC, and what
//! the runtime hands to local tiers (files) on machines without a NIC.

use std::alloc::{self, Layout};
use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::error::{Error, Result};

/// Alignment of [`HostBuffer`] (and so [`crate::RegisteredBuffer`]) allocations.
pub const BUFFER_ALIGN: usize = 4096;

/// A range of host memory that stays valid for as long as this value lives: allocated here
/// ([`Self::new`]: page aligned, zeroed) or the caller's own memory, owned
/// ([`Self::from_vec`], [`Self::from_boxed`], [`Self::from_mmap`]), `'static`
/// ([`Self::from_static`]), or under the caller's promise ([`Self::from_raw`]).
///
/// Shared access copies through raw pointers ([`Self::write_at`], [`Self::read_at`]) so the
/// buffer may be used while a NIC or another copy engine also addresses it; such concurrent use
/// is the caller's protocol concern, as for any DMA memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// What keeps a [`HostBuffer`]'s memory valid.
enum Backing {
    /// Allocated by [`HostBuffer::new`] with this layout, freed on drop.
    Allocated(Layout),
    /// The caller's memory, owned by this value and dropped with it (a `Vec`, a boxed slice, a
    /// memory map, or another buffer this one is a slice of). Its heap or mapping does not move
    /// when the owner value is moved.
    Owned(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
    /// Memory that outlives this value: `'static`, or the caller's promise ([`HostBuffer::from_raw`]).
    Borrowed,
}

// SAFETY: the buffer exclusively owns (or, for borrowed memory, exclusively uses through this
// value, by its constructor's contract) its range; owners are `Send`.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only copies through raw pointers (no `&mut` is formed from `&self`);
// owners are `Sync`.
unsafe impl Sync for HostBuffer {}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish()
    }
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes, aligned to [`BUFFER_ALIGN`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for zero length or an impossible layout,
    /// [`Error::OutOfMemory`] if the allocation fails.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument("buffer length must be > 0".into()));
        }
        let layout = Layout::from_size_align(len, BUFFER_ALIGN)
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc::alloc_zeroed(layout) }).ok_or(
            Error::OutOfMemory(std::io::Error::from(std::io::ErrorKind::OutOfMemory)),
        )?;
        Ok(HostBuffer {
            ptr,
            len,
            backing: Backing::Allocated(layout),
        })
    }

    /// Caller memory at `ptr` kept valid by `backing`; refused if null or empty.
    fn caller(ptr: *mut u8, len: usize, backing: Backing) -> Result<Self> {
        let ptr = NonNull::new(ptr).filter(|_| len > 0).ok_or_else(|| {
            Error::InvalidArgument("caller memory must be non-null and non-empty".into())
        })?;
        Ok(HostBuffer { ptr, len, backing })
    }

    fn owned(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send + Sync>) -> Result<Self> {
        Self::caller(ptr, len, Backing::Owned(owner))
    }

    /// The caller's `Vec`, owned from now on (its length is the buffer's; its heap allocation
    /// does not move with the value, and is freed when the buffer is dropped).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty vector.
    pub fn from_vec(mut v: Vec<u8>) -> Result<Self> {
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        Self::owned(ptr, len, Box::new(v))
    }

    /// The caller's boxed slice, owned from now on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty slice.
    pub fn from_boxed(mut b: Box<[u8]>) -> Result<Self> {
        let (ptr, len) = (b.as_mut_ptr(), b.len());
        Self::owned(ptr, len, Box::new(b))
    }

    /// A writable memory map (of a file, a shared-memory file under `/dev/shm`, anonymous or huge
    /// pages), owned from now on and unmapped when the buffer is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty map.
    pub fn from_mmap(mut m: memmap2::MmapMut) -> Result<Self> {
        let (ptr, len) = (m.as_mut_ptr(), m.len());
        Self::owned(ptr, len, Box::new(m))
    }

    /// A `'static` slice (a leaked or static buffer), used exclusively through this value.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty slice.
    pub fn from_static(s: &'static mut [u8]) -> Result<Self> {
        let ptr = NonNull::new(s.as_mut_ptr())
            .filter(|_| !s.is_empty())
            .ok_or_else(|| {
                Error::InvalidArgument("caller memory must be non-null and non-empty".into())
            })?;
        Ok(HostBuffer {
            ptr,
            len: s.len(),
            backing: Backing::Borrowed,
        })
    }

    /// `len` bytes at `ptr` that the caller owns and keeps valid (NIXL's `registerMem` of an
    /// address and a length).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be memory of this process that stays mapped (not freed, not unmapped,
    /// not remapped) until this buffer **and** every registration made from it have been
    /// dropped or released, and no transfer or peer may still reach it: for an agent
    /// registration, until `release().await` has resolved. While it is registered the NIC and
    /// peers may read and (with write access) modify it at any time; the caller must not hold
    /// Rust references to it that assume otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a null pointer or zero length.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<Self> {
        Self::caller(ptr, len, Backing::Borrowed)
    }

    /// `len` bytes at `offset` of `buf`, as a buffer of their own that keeps `buf` alive (a
    /// registration inside a larger one).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty range or one outside `buf`.
    pub fn slice_of(buf: &std::sync::Arc<HostBuffer>, offset: usize, len: usize) -> Result<Self> {
        buf.check_range(offset, len)?;
        // SAFETY: the range is inside `buf` (checked), which the owner below keeps alive.
        let ptr = unsafe { buf.ptr.as_ptr().add(offset) };
        Self::owned(ptr, len, Box::new(std::sync::Arc::clone(buf)))
    }

    /// Whether the memory was allocated by [`Self::new`] (page aligned) rather than given by the
    /// caller.
    pub fn is_allocated(&self) -> bool {
        matches!(self.backing, Backing::Allocated(_))
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The contents. Do not rely on them while a transfer may be writing the buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is a live, initialised allocation of `len` bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// `len` bytes at `offset` (`None` if outside the buffer), without forming a reference to
    /// the rest of it: a NIC may be writing other parts of the buffer meanwhile. Do not rely on
    /// these bytes while a transfer may be writing them.
    pub fn slice_at(&self, offset: usize, len: usize) -> Option<&[u8]> {
        self.check_range(offset, len).ok()?;
        // SAFETY: the range is inside the live, initialised allocation of `len()` bytes owned
        // by `self` (checked); the slice covers only that range and lives no longer than `self`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) })
    }

    /// The contents, mutably. Do not write while a transfer may be reading the buffer.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` gives exclusive access on the CPU side.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// Copies `src` into the buffer at `offset`, through a raw pointer (no reference to the
    /// buffer is formed, so this may be used while the buffer is shared).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside the buffer.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: the range is inside the live allocation (checked); `src` cannot overlap it since
        // it is a separate Rust borrow; concurrent DMA access is the caller's protocol concern.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len())
        };
        Ok(())
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the buffer.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range is outside the buffer.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: as in `write_at`, with source and destination swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        Ok(())
    }

    /// Copies `len` bytes at `offset` of this buffer into `dst` at `dst_offset` (a staging copy:
    /// one `memcpy`, through raw pointers, no reference to either buffer formed).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if either range is outside its buffer, or the two overlap in
    /// one buffer.
    pub fn copy_to(
        &self,
        offset: usize,
        dst: &HostBuffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check_range(offset, len)?;
        dst.check_range(dst_offset, len)?;
        let (src, to) = (
            self.addr() as usize + offset,
            dst.addr() as usize + dst_offset,
        );
        if src < to + len && to < src + len {
            return Err(Error::InvalidArgument(format!(
                "copy of {len} bytes from {src:#x} to {to:#x} overlaps"
            )));
        }
        // SAFETY: both ranges lie inside live allocations (checked) and do not overlap
        // (checked); concurrent DMA access is the caller's protocol concern, as in `write_at`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                dst.ptr.as_ptr().add(dst_offset),
                len,
            )
        };
        Ok(())
    }

    /// Reads the byte at `offset` with an acquire load: a flag a peer's RDMA WRITE sets. Once it
    /// reads the flag's new value, bytes the same peer wrote earlier on the same RC connection are
    /// visible too (RC places WRITEs in order; perftest's `write_lat` relies on the same).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `offset` is outside the buffer.
    pub fn load_u8(&self, offset: usize) -> Result<u8> {
        self.check_range(offset, 1)?;
        // SAFETY: the byte is inside the live allocation (checked) and `AtomicU8` has the layout
        // of `u8`; no `&mut` to the buffer can exist while `&self` is borrowed, and other writers
        // (the NIC, `write_at`) are outside the Rust memory model's view, as for any DMA memory.
        let flag = unsafe { AtomicU8::from_ptr(self.ptr.as_ptr().add(offset)) };
        Ok(flag.load(Ordering::Acquire))
    }

    /// Reads the 8-byte word at `offset` (a multiple of 8) with an acquire load; see
    /// [`Self::load_u8`]. A word written by one RDMA WRITE is never seen half old, half new.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `offset` is not 8-aligned or the word is outside the buffer.
    pub fn load_u64(&self, offset: usize) -> Result<u64> {
        self.check_range(offset, 8)?;
        if !(self.addr() + offset as u64).is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} of an 8-byte flag is not 8-byte aligned"
            )));
        }
        // SAFETY: the word is inside the live allocation (checked) and 8-aligned (checked), as
        // `AtomicU64` requires; aliasing as in `load_u8`.
        let word = unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(offset).cast::<u64>()) };
        Ok(word.load(Ordering::Acquire))
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(Error::InvalidArgument(format!(
                "range {offset}+{len} outside a buffer of {} bytes",
                self.len()
            ))),
        }
    }

    /// Raw pointer to the start.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Backing::Allocated(layout) = self.backing {
            // SAFETY: allocated in `HostBuffer::new` with this layout and freed only here. An
            // owner that registered it (`RegisteredBuffer`) deregisters before this runs.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        // Owned caller memory is dropped with `backing`, after this; borrowed memory is the
        // caller's to free.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_range_checked() {
        let b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.addr() % BUFFER_ALIGN as u64, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.write_at(9_996, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 4];
        b.read_at(9_996, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        assert!(matches!(
            b.write_at(9_997, &[0; 4]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            b.read_at(usize::MAX, &mut out),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(HostBuffer::new(0), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn caller_memory_is_kept_at_its_address_and_empty_memory_is_refused() {
        let mut v = vec![0u8; 8192];
        v[100] = 9;
        let addr = v.as_ptr() as u64;
        let b = HostBuffer::from_vec(v).unwrap();
        assert_eq!((b.addr(), b.len()), (addr, 8192));
        assert!(!b.is_allocated());
        let mut out = [0u8; 1];
        b.read_at(100, &mut out).unwrap();
        assert_eq!(out, [9]);
        let boxed = HostBuffer::from_boxed(vec![1u8; 10].into_boxed_slice()).unwrap();
        assert_eq!(boxed.as_slice(), &[1u8; 10]);
        let m = memmap2::MmapMut::map_anon(4096).unwrap();
        assert_eq!(HostBuffer::from_mmap(m).unwrap().len(), 4096);
        let s: &'static mut [u8] = Box::leak(vec![2u8; 16].into_boxed_slice());
        assert_eq!(HostBuffer::from_static(s).unwrap().as_slice(), &[2u8; 16]);
        assert!(matches!(
            HostBuffer::from_vec(Vec::new()),
            Err(Error::InvalidArgument(_))
        ));
        // SAFETY: refused before the range is used.
        let raw = unsafe { HostBuffer::from_raw(std::ptr::null_mut(), 10) };
        assert!(matches!(raw, Err(Error::InvalidArgument(_))));
        let parent = std::sync::Arc::new(HostBuffer::new(8192).unwrap());
        parent.write_at(4096, &[5]).unwrap();
        let slice = HostBuffer::slice_of(&parent, 4096, 4096).unwrap();
        slice.read_at(0, &mut out).unwrap();
        assert_eq!((slice.addr(), out), (parent.addr() + 4096, [5]));
        assert!(HostBuffer::slice_of(&parent, 4096, 4097).is_err());
        assert!(HostBuffer::slice_of(&parent, 0, 0).is_err());
    }

    #[test]
    fn flag_loads_see_written_values_and_check_range_and_alignment() {
        let b = HostBuffer::new(4096).unwrap();
        b.write_at(4095, &[7]).unwrap();
        assert_eq!(b.load_u8(4095).unwrap(), 7);
        b.write_at(16, &0x0102_0304_0506_0708u64.to_ne_bytes())
            .unwrap();
        assert_eq!(b.load_u64(16).unwrap(), 0x0102_0304_0506_0708);
        assert!(matches!(b.load_u8(4096), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.load_u64(4092), Err(Error::InvalidArgument(_))));
        assert!(matches!(b.load_u64(4), Err(Error::InvalidArgument(_))));
    }
}
