//! Protection domains.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::context::{Context, ContextInner};
use crate::error::{Error, Result};
use crate::sys;

pub(crate) struct PdInner {
    pub(crate) raw: NonNull<sys::ibv_pd>,
    pub(crate) ctx: Arc<ContextInner>,
}

// SAFETY: protection domains may be used from any thread (libibverbs is thread-safe).
unsafe impl Send for PdInner {}
// SAFETY: as above.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: memory regions and queue pairs hold an `Arc` to this value, so none is left when
        // the PD is deallocated, exactly once; `ctx` is still open.
        let rc = unsafe { sys::ibv_dealloc_pd(self.raw.as_ptr()) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain (`ibv_pd`). Cheap to clone; memory regions and queue pairs keep it alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    ///
    /// # Errors
    /// the failing verb's error variant if `ibv_alloc_pd` fails.
    pub fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: the context is open.
        let raw = unsafe { sys::ibv_alloc_pd(ctx.as_raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os(Error::AllocPd))?;
        Ok(ProtectionDomain {
            inner: Arc::new(PdInner {
                raw,
                ctx: Arc::clone(&ctx.inner),
            }),
        })
    }

    /// The context this PD belongs to.
    pub fn context(&self) -> Context {
        Context {
            inner: Arc::clone(&self.inner.ctx),
        }
    }

    /// The raw `ibv_pd`.
    pub fn as_raw(&self) -> *mut sys::ibv_pd {
        self.inner.raw.as_ptr()
    }
}
