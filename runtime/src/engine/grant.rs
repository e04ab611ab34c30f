//! Grants: a peer reaches a region only through a type-2 memory window bound on the queue pair
//! of its connection, so its rkey works from that queue pair alone, with the rights granted.
//!
//! With [`EngineConfig::window_grants`](super::EngineConfig::window_grants) the engine registers
//! memory with local access and `MW_BIND` only: the region's own rkey reaches nothing. A bind
//! is a work request on the connection's send queue, accounted by the core like any other (a
//! send credit, a slot, its completion routed by the progress task). Dropping a [`Grant`]
//! deallocates its window, which revokes it at once; the window keeps the region registered
//! (and the queue pair alive) until then.

use std::future::poll_fn;
use std::rc::Rc;

use rixl_proto::{ConnId, Op};
use rixl_verbs::{AccessFlags, BoundWindow, MemoryWindow};
use smallvec::smallvec;

use super::nic::KeepAlive;
use super::wait::{wait_slot, SlotGuard};
use super::Engine;
use crate::desc::Region;
use crate::error::{PostError, RuntimeError, TransferError};

/// What a peer may do with a region through its grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Access {
    /// RDMA READ only: a WRITE completes with a remote access error.
    Read,
    /// READ and WRITE.
    ReadWrite,
}

impl Access {
    /// The window's remote access flags.
    pub fn flags(self) -> AccessFlags {
        match self {
            Access::Read => AccessFlags::REMOTE_READ,
            Access::ReadWrite => AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        }
    }
}

/// One region to grant, whole, with `access`.
#[derive(Debug, Clone)]
pub struct GrantSpec {
    /// The region (registered with this engine's NIC).
    pub region: Region,
    /// The rights.
    pub access: Access,
}

/// A region granted to the peer of one connection: a window bound on its queue pair. Dropping
/// it revokes the grant at once.
#[derive(Debug)]
pub struct Grant {
    bound: BoundWindow<Region>,
    access: Access,
}

impl Grant {
    /// The key the peer addresses the region with on that connection.
    pub fn rkey(&self) -> u32 {
        self.bound.rkey()
    }

    /// The rights granted.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The region granted.
    pub fn region(&self) -> &Region {
        self.bound.keep()
    }
}

impl Engine {
    /// Grants the peer of `conn` each region of `specs` (whole, with its access): binds a
    /// window per region on the connection's queue pair and waits for the binds to complete.
    /// The grants are in the order of `specs`.
    ///
    /// # Errors
    /// [`RuntimeError::Verbs`] if a window cannot be allocated (no memory-window support) or a
    /// bind is refused at posting (the region lacks `MW_BIND`); [`RuntimeError::Grant`] with
    /// the connection's or the bind's completion error. Grants already bound are dropped
    /// (revoked) on an error.
    pub async fn grant(
        &self,
        conn: ConnId,
        specs: Vec<GrantSpec>,
    ) -> Result<Vec<Grant>, RuntimeError> {
        let inner = Rc::clone(&self.inner);
        let mut pending = Vec::with_capacity(specs.len());
        for spec in specs {
            let window = MemoryWindow::new(&inner.pd)?;
            poll_fn(|cx| inner.core.borrow_mut().poll_credits(conn, 1, cx))
                .await
                .map_err(RuntimeError::Grant)?;
            let keep = KeepAlive {
                regions: smallvec![spec.region.clone()],
                _message: None,
            };
            let mut bound = None;
            let mut refused = None;
            let posting =
                inner
                    .core
                    .borrow_mut()
                    .post_control(conn, Op::Write, keep, |q, wr_id| {
                        let (addr, len) = (spec.region.addr(), spec.region.len());
                        match q.qp.bind_window(
                            window,
                            spec.region,
                            Region::registration,
                            addr,
                            len,
                            spec.access.flags(),
                            wr_id,
                        ) {
                            Ok(b) => {
                                bound = Some(b);
                                Ok(())
                            }
                            Err(e) => {
                                let shown = rixl_verbs::Error::InvalidArgument(e.to_string());
                                refused = Some(e);
                                Err(shown)
                            }
                        }
                    });
            let guard = SlotGuard {
                inner: Rc::clone(&inner),
                posting,
            };
            if let Some(e) = refused {
                return Err(RuntimeError::Verbs(e));
            }
            pending.push((guard, bound, spec.access));
        }
        inner.kick_progress();
        let mut out = Vec::with_capacity(pending.len());
        for (mut guard, bound, access) in pending {
            wait_slot(&mut guard).await.map_err(RuntimeError::Grant)?;
            let bound = bound.ok_or(RuntimeError::Grant(TransferError::Post(
                PostError::NoWindow,
            )))?;
            out.push(Grant { bound, access });
        }
        Ok(out)
    }
}
