//! Owned, page-aligned host memory: what [`crate::RegisteredBuffer`] registers with the NIC, and
//! what the runtime hands to local tiers (files) on machines without a NIC.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use crate::error::{Error, Result};

/// Alignment of [`HostBuffer`] (and so [`crate::RegisteredBuffer`]) allocations.
pub const BUFFER_ALIGN: usize = 4096;

/// Page-aligned, zero-initialised heap memory owned by this value.
///
/// Shared access copies through raw pointers ([`Self::write_at`], [`Self::read_at`]) so the
/// buffer may be used while a NIC or another copy engine also addresses it; such concurrent use
/// is the caller's protocol concern, as for any DMA memory.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer exclusively owns its allocation.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only copies through raw pointers (no `&mut` is formed from `&self`).
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
        Ok(HostBuffer { ptr, layout })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
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
        if !offset.is_multiple_of(8) {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} of an 8-byte flag is not a multiple of 8"
            )));
        }
        // SAFETY: the word is inside the live allocation (checked) and 8-aligned (the buffer is
        // page-aligned and `offset` a multiple of 8), as `AtomicU64` requires; aliasing as in
        // `load_u8`.
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
        // SAFETY: allocated in `HostBuffer::new` with this layout and freed only here. An owner
        // that registered it (`RegisteredBuffer`) deregisters before this runs.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
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
