//! Memory windows (type 2): a grant of part of a memory region to one peer, enforced by the NIC.
//!
//! A type-2 window is bound with a work request on one queue pair, and its rkey then works only
//! on that queue pair: a peer on another queue pair that uses the same address and rkey gets a
//! remote access error, and so does a WRITE through a window bound read-only. Invalidating the
//! window (a local invalidate posted on the queue pair it is bound to) revokes the grant: the
//! next access through its rkey fails. The region under a window needs
//! [`AccessFlags::MW_BIND`](crate::AccessFlags::MW_BIND); it can leave out the remote access
//! flags, so that only windows reach it.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;
use crate::sys;

/// A type-2 memory window (`ibv_mw`). It keeps its protection domain alive.
pub struct MemoryWindow {
    raw: NonNull<sys::ibv_mw>,
    /// The rkey of the last bind posted (type-2 windows take a new key on every bind).
    rkey: AtomicU32,
    _pd: ProtectionDomain,
}

// SAFETY: an `ibv_mw` is a handle the provider accesses under its own locks; binds and
// invalidations are posted through a queue pair (thread-safe in libibverbs).
unsafe impl Send for MemoryWindow {}
// SAFETY: as above; `&MemoryWindow` reads the handle and an atomic key.
unsafe impl Sync for MemoryWindow {}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow")
            .field("rkey", &format_args!("{:#x}", self.rkey()))
            .finish()
    }
}

impl MemoryWindow {
    /// Allocates a type-2 window in `pd` (`ibv_alloc_mw`).
    ///
    /// # Errors
    /// [`Error::AllocMw`] if the device refuses (no memory-window support, or out of
    /// resources).
    pub fn new(pd: &ProtectionDomain) -> Result<Self> {
        // SAFETY: the PD is live.
        let raw = unsafe { sys::ibv_alloc_mw(pd.as_raw(), sys::ibv_mw_type::IBV_MW_TYPE_2) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::AllocMw))?;
        // SAFETY: `raw` was just returned by a successful allocation.
        let rkey = unsafe { (*raw.as_ptr()).rkey };
        Ok(MemoryWindow {
            raw,
            rkey: AtomicU32::new(rkey),
            _pd: pd.clone(),
        })
    }

    /// The rkey of the last bind posted (before any bind: the unbound window's key, which
    /// grants nothing).
    pub fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::Acquire)
    }

    /// The key of the next bind: the window's key with its low (consumer) byte incremented,
    /// so that a key of an earlier bind does not work after a re-bind.
    pub(crate) fn next_rkey(&self) -> u32 {
        // SAFETY: a pure function of its argument (`ibv_inc_rkey`).
        unsafe { sys::ibv_inc_rkey(self.rkey()) }
    }

    /// Makes `rkey` (of a bind just posted) the window's key. The provider names the window by
    /// `ibv_mw.rkey` in the next bind and the device checks it against the key of the last
    /// one; a type-2 bind posted as a work request does not update it by itself.
    pub(crate) fn set_rkey(&mut self, rkey: u32) {
        self.rkey.store(rkey, Ordering::Release);
        // SAFETY: `&mut self`: no bind of this window is being posted now; the provider reads
        // the field only while one is.
        unsafe { (*self.raw.as_ptr()).rkey = rkey };
    }

    /// The raw `ibv_mw`.
    pub fn as_raw(&self) -> *mut sys::ibv_mw {
        self.raw.as_ptr()
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: deallocated exactly once; its PD is kept alive by our field until after this.
        // A window still bound is invalidated by the deallocation.
        let rc = unsafe { sys::ibv_dealloc_mw(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_mw failed");
        }
    }
}

/// A window bound to one queue pair over memory whose keep-alive it owns: the safe form of
/// [`QueuePair::post_bind_window`](crate::QueuePair::post_bind_window). Dropping it
/// deallocates the window first (the grant ends at once: its rkey reaches nothing from then
/// on), then releases the queue pair and the keep-alive, so the memory's registration always
/// outlives the window bound over it.
pub struct BoundWindow<K> {
    // Dropped first (field order): the window is deallocated before what it reaches goes.
    window: MemoryWindow,
    rkey: u32,
    _qp: std::sync::Arc<crate::QueuePair>,
    keep: K,
}

impl<K> fmt::Debug for BoundWindow<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoundWindow")
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .finish()
    }
}

impl<K> BoundWindow<K> {
    /// The rkey the queue pair's peer addresses the window with.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// What it keeps alive.
    pub fn keep(&self) -> &K {
        &self.keep
    }

    /// The window.
    pub fn window(&self) -> &MemoryWindow {
        &self.window
    }

    pub(crate) fn new(
        window: MemoryWindow,
        rkey: u32,
        qp: std::sync::Arc<crate::QueuePair>,
        keep: K,
    ) -> Self {
        BoundWindow {
            window,
            rkey,
            _qp: qp,
            keep,
        }
    }
}
